"""NexRL core: hook specs, plugin loading, registries, types, config and the CLI.

Importing this package stays cheap on purpose: it pulls in no torch, zmq, web framework
or training SDK, so `nexrl plugins` and config validation work on any machine and a
plugin's heavy code loads only when its name is chosen.
"""

__version__ = "0.1.0"
