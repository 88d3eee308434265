"""nexrl-tinker: Tinker for NexRL.

The local Tinker-compatible service ("TinkerCloud", `nexrl_tinker.server`): the real
``tinker`` SDK (0.38) talks to it over HTTP as it would to the hosted API, and it runs
every request on the nexrl-engine engine. Start it with ``nexrl serve tinker`` or
``TinkerService(ServeOptions(port=0)).start()``.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
