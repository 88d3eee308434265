"""The FastAPI application: the nex-weaver 1.19 routes (`nexrl_weaver.server.routes`, a
router per resource), thin over the Weaver modules, with the key policy: without a
configured key the SDK may send none (``X-WEAVER-API-KEY``)."""

from __future__ import annotations

from fastapi import FastAPI, Header

from nexrl_service.runtime import Authenticator, ServiceState, add_download_route
from nexrl_weaver.server.artifacts import WeaverArtifacts
from nexrl_weaver.server.routes import Bodies, artifacts, catalogue, models, operations, sampling, sessions
from nexrl_weaver.server.routes.errors import install_error_handlers
from nexrl_weaver.server.sampling import WeaverSampling
from nexrl_weaver.server.sessions import WeaverSessions
from nexrl_weaver.server.training import WeaverTraining

__all__ = ["create_app"]


def create_app(state: ServiceState) -> FastAPI:
    app = FastAPI(title="NexRL local Weaver service", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = state
    auth = Authenticator(
        state.settings.api_key,
        header="X-WEAVER-API-KEY",
        missing_hint="the nex-weaver SDK sends WEAVER_API_KEY there",
        allow_anonymous=True,
    )

    async def owner(key: str | None = Header(default=None, alias="X-WEAVER-API-KEY")) -> str:
        return auth.check(key)

    install_error_handlers(app)
    bodies = Bodies(state)
    training = WeaverTraining(state)
    app.include_router(catalogue.router(state, owner))
    app.include_router(sessions.router(state, WeaverSessions(state), bodies, owner))
    app.include_router(models.router(state, training, bodies, owner))
    app.include_router(artifacts.router(WeaverArtifacts(state, training), bodies, owner))
    # Signed downloads of artifact files: no API key, the URL's signature is the credential.
    add_download_route(app, state.downloads)
    app.include_router(sampling.router(WeaverSampling(state, training.ops), bodies, owner))
    app.include_router(operations.router(state, owner))
    return app
