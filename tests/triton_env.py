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


def _row_by_row_dot() -> None:
    """The interpreter's ``tl.dot`` is one numpy matmul over the whole tile, and the host's BLAS is
    free to give a row a different rounding by where it sits in the tile: OpenBLAS's sgemm on AMD
    Zen (its Haswell and Zen kernels alike) gave 10 of 16 rows of a tile other bits than the same
    row alone. That is the host library, not the kernel under test (on a GPU each output element's
    dot reads only its own row), so here each row of the tile is its own one-row matmul, whose
    operations cannot depend on the other rows."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot
    if getattr(original, "row_by_row", False):
        return

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.ndim != 2:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        out = original(self, a, b, d, input_precision, max_num_imprecise_acc)  # types, fp8 handling
        rows = [original(self, interpreter.TensorHandle(a.data[i:i + 1], a.dtype.scalar), b,
                         interpreter.TensorHandle(d.data[i:i + 1], d.dtype.scalar), input_precision,
                         max_num_imprecise_acc).data for i in range(a.data.shape[0])]
        out.data = np.concatenate(rows, axis=0)
        return out

    create_dot.row_by_row = True
    builder.create_dot = create_dot


if not ON_GPU:
    _row_by_row_dot()
