"""Rebuild the shipped tiny model; same as ``python -m nexrl_fsdp.tiny.build``.

Usage: python nexrl_fsdp/scripts/build_tiny_model.py [--out DIR] [--steps N] [--eval-prompts N]
"""

from __future__ import annotations

from nexrl_fsdp.tiny.build import main

if __name__ == "__main__":
    raise SystemExit(main())
