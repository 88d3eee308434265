"""The runtime's public face: everything a protocol package (the Tinker- and
Weaver-compatible services, or a third party's) may use of `nexrl_service`.

A protocol package imports from this module only (its test kit may also use
`nexrl_service.testing`); `tests/test_distribution_imports.py` holds it to that. The
modules behind it (the store's tables, the scheduler's lanes, the janitor, the engine
pool) can then change shape without breaking a protocol, and a reader of a protocol
package sees in one place what it builds on. Importing it imports the whole runtime
(fastapi, uvicorn, sqlalchemy, the engine), which only a service process needs.
"""

from __future__ import annotations

from nexrl_service.auth import Authenticator
from nexrl_service.bounds import SQL_INT_MAX, SeqId, StoredInt
from nexrl_service.checkpoint_paths import CheckpointPathFormat, check_checkpoint_name
from nexrl_service.downloads import add_download_route
from nexrl_service.engines import WeightsRef
from nexrl_service.errors import ApiError, BadRequest, Forbidden, Gone, NotFound, TooManyRequests
from nexrl_service.futures import JSON_CONTENT_TYPE, Outcome, new_request_id
from nexrl_service.hub import add_hub_routes
from nexrl_service.paging import Page
from nexrl_service.sampling import MAX_LOGPROB_CELLS, SampleTask, SamplingOps
from nexrl_service.server import LocalService
from nexrl_service.sessions import Sessions
from nexrl_service.state import ServiceState
from nexrl_service.store import COPY_STATUS, CheckpointRow, ModelRow, SamplerRow, SessionRow
from nexrl_service.training import NewModel, Prepare, TrainingOps

__all__ = [
    "COPY_STATUS",
    "JSON_CONTENT_TYPE",
    "MAX_LOGPROB_CELLS",
    "SQL_INT_MAX",
    "ApiError",
    "Authenticator",
    "BadRequest",
    "CheckpointPathFormat",
    "CheckpointRow",
    "Forbidden",
    "Gone",
    "LocalService",
    "ModelRow",
    "NewModel",
    "NotFound",
    "Outcome",
    "Page",
    "Prepare",
    "SampleTask",
    "SamplerRow",
    "SamplingOps",
    "SeqId",
    "ServiceState",
    "SessionRow",
    "Sessions",
    "StoredInt",
    "TooManyRequests",
    "TrainingOps",
    "WeightsRef",
    "add_download_route",
    "add_hub_routes",
    "check_checkpoint_name",
    "new_request_id",
]
