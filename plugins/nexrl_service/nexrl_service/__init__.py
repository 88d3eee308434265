"""The local-service runtime: what every NexRL-served training API shares.

A protocol plugin (the Tinker-compatible service, a Weaver-compatible one) brings only
its wire: routes, codec and id formats. Everything else is here, one job per module:

* `settings`: `ServerSettings`, the core's `ServeOptions` plus the runtime's knobs
  (long-poll, retention, janitor period, compute threads, sampling linger, caches).
* `store`: `Store`, the SQL state (SQLAlchemy 2; SQLite file by default, any URL):
  sessions, models, samplers, futures (a protocol may call them operations) and
  checkpoints, surviving a restart.
* `futures`: `FutureBook` and `Outcome`, accepted requests recorded before their id is
  answered, resolved from worker threads, awaited by long-polls on the event loop.
* `scheduler`: `Scheduler` and `Job`, ordered training lanes (by ``seq_id``, skipping a
  number missing past the gap timeout) and FIFO sampling lanes that batch.
* `engines`: `EnginePool`, which `nexrl_engine.Engine` serves which model or weights.
* `files`: `CheckpointFiles`, the checkpoint directories under the data directory.
* `downloads`: `SignedDownloads`, expiring signed URLs for a checkpoint's files and the
  route that serves them without an API key.
* `auth`: `Authenticator`, API keys (constant-time compare, key -> owner hash, an
  optional key prefix the protocol requires).
* `errors`: `ApiError` (a refused request, 4xx) and `RequestFailed` (a failed future).
* `state`: `ServiceState`, the wiring of the above plus tenant ownership checks.
* `janitor`: `Janitor`, failing futures a killed process left pending, expiring stale
  sessions, deleting checkpoints past their TTL, pruning results, unblocking lanes.
* `sessions`, `training`, `sampling`: `Sessions`, `TrainingOps`, `SamplingOps`, the
  operations on the state and the engines, protocol-neutral (records in, records out).
* `server`: `LocalService`, the core's `Service` over uvicorn: a thread, a child
  process or the foreground, port 0, clean stop.
* `runtime`: the public face, every name of the above a protocol package may use; a
  protocol package imports from it alone (its test kit also from `testing`).

Building a service on it::

    from nexrl_service.runtime import LocalService

    class MyService(LocalService):
        name = "myproto"          # ~/.nexrl/myproto/myproto.db by default
        title = "My service"

        def create_app(self, state):          # a started ServiceState
            return build_my_fastapi_app(state)  # routes: decode, call the ops, encode

The routes authenticate with an `Authenticator`, answer `ApiError` as 4xx, decode
bodies into engine records (`nexrl_engine.types`), call `TrainingOps` / `SamplingOps`
/ `Sessions` with an ``answer`` callback that encodes the result as an `Outcome`,
and serve the outcome when the client polls (`FutureBook.wait`). The runtime needs
the ``service`` extra (fastapi, uvicorn, sqlalchemy); importing this package alone
imports none of them.
"""
