"""Which device a run computes on: ``auto``, ``cpu`` or ``cuda``.

``cuda`` is the Triton backend of the weight seam (``triton_gguf``, ``triton_attention``); it needs
torch to see a CUDA GPU and triton to be importable. ``auto`` picks it when both hold, else the CPU.
Nothing here reads the environment (``tsspec.settings`` passes the operator's choice in).
"""

from __future__ import annotations

import glob
import os
import sys

DEVICES = ("auto", "cpu", "cuda")


def triton_missing() -> str | None:
    """Why the Triton kernels cannot be imported, or None when they can."""
    try:
        import triton  # noqa: F401
    except Exception as e:  # noqa: BLE001 - an ImportError, or a broken install
        return f"triton is not importable ({type(e).__name__}: {e}); install it with pip install 'tsspec[gpu]'"
    return None


def no_nvidia_device() -> bool:
    """Whether this is a Linux system without any NVIDIA device node or driver (no /dev/nvidia*,
    /proc/driver/nvidia nor WSL's /dev/dxg): torch could see no CUDA GPU there, which ``auto`` then
    knows without importing it (a second of a plain run's start, ``models.lean``)."""
    if not sys.platform.startswith("linux"):
        return False
    return not (glob.glob("/dev/nvidia*") or os.path.exists("/proc/driver/nvidia") or os.path.exists("/dev/dxg"))


def cuda_missing() -> str | None:
    """Why there is no CUDA GPU for torch, or None when there is one."""
    import torch

    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is built without CUDA"
    try:
        if not torch.cuda.is_available():
            return "torch sees no CUDA GPU"
    except Exception as e:  # noqa: BLE001 - a broken driver says so here
        return f"CUDA is not usable ({e})"
    return None


def cuda_unusable() -> str | None:
    """Why ``cuda`` cannot run here (no GPU, or no triton), or None."""
    return cuda_missing() or triton_missing()


def resolve(requested: str) -> str:
    """"auto" -> "cuda" when a GPU and triton are there, else "cpu"; "cpu" and "cuda" as asked (the
    caller refuses "cuda" where ``cuda_unusable()`` says why)."""
    if requested not in DEVICES:
        raise ValueError(requested)
    if requested == "auto":
        return "cuda" if not no_nvidia_device() and cuda_unusable() is None else "cpu"
    return requested
