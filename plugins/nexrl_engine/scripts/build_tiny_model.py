"""Rebuild the shipped tiny model; same as ``python -m nexrl_engine.tiny.build``.

Usage: python plugins/nexrl_engine/scripts/build_tiny_model.py [--out DIR] [--steps N] [--eval-prompts N]
"""

from __future__ import annotations

from nexrl_engine.tiny.build import main

if __name__ == "__main__":
    raise SystemExit(main())
