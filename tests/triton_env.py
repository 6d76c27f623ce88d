"""What the Triton tests run on: the GPU when torch sees one, else Triton's interpreter on the CPU.

Import this before anything imports a Triton kernel module: ``TRITON_INTERPRET`` is read when a
kernel is decorated (``triton.jit``), so it must be set first. Without a GPU the kernels run in the
interpreter (numpy, on CPU tensors): the same kernel source and the same tiles, not the GPU's
instructions. The tests skip, with the reason, when triton cannot be imported.
"""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]' brings it)")

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
