"""The in-memory weight format, behind one seam.

Every matrix product with a model weight goes through ``Linear``. The default format is bf16
weights with bf16 inputs (oneDNN's AVX-512 bf16 kernels): a 9-row product costs ~1.2x a 1-row one,
which is what makes a verify forward nearly as cheap as a decode step on this CPU. The ``f32``
format is the plain reference the fast path is tested against.

Batch invariance. A row's result must not depend on how many rows share the product, or
speculative output drifts from plain output at near-ties. oneDNN's bf16 GEMM meets that for any
row count >= 2 but takes a different (GEMV) route for a single row, so single rows are padded to
two; the f32 reference pads to a multiple of four for the same reason. ``tests/test_weights.py`` checks the property on the shapes our models use; a GPU/Triton
format would slot in here as another ``Linear`` backend with the same test.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F

FORMATS = ("bf16", "f32")
# Row counts are padded to stay on one batch-invariant GEMM route: oneDNN's bf16 GEMM is invariant
# for any count >= 2; MKL's multi-threaded f32 GEMM only for multiples of 4.
MIN_ROWS = {"bf16": 2, "f32": 4}
ROW_MULTIPLE = {"bf16": 1, "f32": 4}


def default_format() -> str:
    fmt = os.environ.get("TSSPEC_WEIGHTS", "bf16").strip().lower()
    if fmt not in FORMATS:
        from .errors import BadInput

        raise BadInput(f"TSSPEC_WEIGHTS={fmt!r}: expected one of {', '.join(FORMATS)}")
    return fmt


def pad_rows(x: torch.Tensor, min_rows: int, multiple: int = 1) -> torch.Tensor:
    """Repeat the last row until ``x`` has at least ``min_rows`` rows and a multiple of ``multiple``
    (the results of pad rows are dropped)."""
    m = x.shape[0]
    target = max(m, min_rows)
    target = -(-target // multiple) * multiple
    if target == m:
        return x
    return torch.cat([x, x[-1:].expand(target - m, *x.shape[1:])], dim=0)


def to_tensor(a: np.ndarray | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(a, np.ndarray):
        # dequantized F32 tensors can be read-only views of the memory map: copy those
        a = np.ascontiguousarray(a) if a.flags.writeable else np.array(a, copy=True)
        a = torch.from_numpy(a)
    return a.to(dtype).contiguous()


class Linear:
    """y = x @ W.T + b for x [rows, in] float32 -> y [rows, out] float32."""

    __slots__ = ("weight", "bias", "fmt", "min_rows", "multiple", "out_features", "in_features")

    def __init__(self, weight: np.ndarray | torch.Tensor, bias=None, fmt: str | None = None):
        self.fmt = fmt or default_format()
        dtype = torch.bfloat16 if self.fmt == "bf16" else torch.float32
        self.weight = to_tensor(weight, dtype)  # [out, in]
        self.out_features, self.in_features = self.weight.shape
        self.bias = None if bias is None else to_tensor(bias, torch.float32)  # [out]
        self.min_rows = MIN_ROWS[self.fmt]
        self.multiple = ROW_MULTIPLE[self.fmt]

    @staticmethod
    def concat(parts: list[tuple[np.ndarray, np.ndarray | None]], fmt: str | None = None) -> "Linear":
        """One Linear over row-stacked weights (fused QKV, gate+up): fewer, larger products."""
        w = np.concatenate([p[0] for p in parts], axis=0)
        if any(p[1] is not None for p in parts):
            b = np.concatenate(
                [p[1] if p[1] is not None else np.zeros(p[0].shape[0], np.float32) for p in parts]
            )
        else:
            b = None
        return Linear(w, b, fmt)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        xp = pad_rows(x, self.min_rows, self.multiple).to(self.weight.dtype)
        y = F.linear(xp, self.weight)[:m].float()
        if self.bias is not None:
            y = y + self.bias
        return y

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """Plain float32 product with the same stored weights, for tests."""
        y = x.float() @ self.weight.float().T
        return y if self.bias is None else y + self.bias

    def nbytes(self) -> int:
        n = self.weight.numel() * self.weight.element_size()
        return n + (0 if self.bias is None else self.bias.numel() * 4)
