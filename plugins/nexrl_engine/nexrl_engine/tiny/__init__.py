"""The shipped tiny model ``nexrl-tiny``: its tokenizer, its demo task and its build.

Rebuild it with ``python -m nexrl_engine.tiny.build`` (see that module).
"""
