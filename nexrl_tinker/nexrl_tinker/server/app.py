"""The FastAPI application: every route SDK 0.38 uses (`nexrl_tinker.server.routes`,
a router per resource), with the ``tml-`` key policy and the service objects the
routes are thin over."""

from __future__ import annotations

from fastapi import FastAPI, Header

from nexrl_service.runtime import Authenticator, ServiceState, add_download_route, add_hub_routes
from nexrl_tinker.server.copies import CopyService
from nexrl_tinker.server.routes import client, futures, runs, sampling, sessions, training
from nexrl_tinker.server.routes.errors import install_error_handlers
from nexrl_tinker.server.runs import RunService
from nexrl_tinker.server.sampling import SamplingService
from nexrl_tinker.server.sessions import SessionService
from nexrl_tinker.server.training import TrainingService

__all__ = ["create_app"]

API_KEY_PREFIX = "tml-"
"""The SDK refuses to start without a ``tml-...`` key; without a configured key, the
server accepts exactly those (and the key names the tenant)."""


def create_app(state: ServiceState) -> FastAPI:
    app = FastAPI(title="NexRL TinkerCloud", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = state
    auth = Authenticator(
        state.settings.api_key,
        header="X-API-Key",
        required_prefix=API_KEY_PREFIX,
        missing_hint="the tinker SDK sends TINKER_API_KEY there",
    )

    async def owner(x_api_key: str | None = Header(default=None, alias="X-API-Key")) -> str:
        # A coroutine: FastAPI would run a plain function on its thread pool (a hop per request).
        return auth.check(x_api_key)

    install_error_handlers(app)
    trainer = TrainingService(state)
    app.include_router(client.router(state, owner))
    app.include_router(sessions.router(state, SessionService(state), owner))
    app.include_router(training.router(trainer, state.settings.max_body_bytes, owner))
    app.include_router(sampling.router(SamplingService(state, trainer.ops), owner))
    app.include_router(futures.router(state, owner))
    app.include_router(runs.router(RunService(state), CopyService(state), owner))
    # Signed downloads of external weights: no API key, the URL's signature is the credential.
    add_download_route(app, state.downloads)
    # The tokenizer and config by the model's names, for HF_ENDPOINT=<this URL>/hf (bearer key).
    add_hub_routes(app, state.hub, state.settings.api_key)
    return app
