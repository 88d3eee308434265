"""The ``direct-zmq`` transport: a trainer drives FSDP worker ranks without pickle.

* `wire`: the message codec (a JSON header plus raw tensor frames, zero-copy);
* `api_server`: the control plane (``nexrl serve workers``): worker groups, endpoints,
  heartbeats and the "execute" broadcast; training data never passes through it;
* `transport`: the client a trainer uses (`DirectZmqTransport`);
* `launch`: starts an API server and a worker group on 127.0.0.1 for one run and ends
  them again.

The workers themselves are ``python -m nexrl_fsdp.worker``.
"""
