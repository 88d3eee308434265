"""Devices for tests: whether this machine has a CUDA GPU, and one it does not have.

Tests marked ``@pytest.mark.gpu`` need a CUDA GPU; the NexRL pytest plugin
(`nexrl_core.testing.pytest_plugin`) skips them, with the reason, where torch sees none,
so they are collected everywhere and run where there is one. torch is imported only
when asked (the core does not depend on it).
"""

from __future__ import annotations

__all__ = ["NO_CUDA_REASON", "absent_device", "cuda_available"]

NO_CUDA_REASON = "needs a CUDA GPU: torch.cuda.is_available() is False here (or torch is not installed)"


def cuda_available() -> bool:
    """True when torch is installed and sees a CUDA GPU."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def absent_device() -> str:
    """A CUDA device this machine does not have: ``cuda`` without CUDA, else the first
    index past its last GPU (``cuda:1`` on a one-GPU machine)."""
    if not cuda_available():
        return "cuda"
    import torch

    return f"cuda:{torch.cuda.device_count()}"
