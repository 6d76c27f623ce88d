"""A weight in its GGUF block layout (``GGUFWeight``), as the native kernels multiply it.

Apart from ``weights`` (the weight seam, which re-exports these names) because nothing here needs
torch: a plain native run (``models.lean``) loads its trunk from these and numpy alone.
"""

from __future__ import annotations

import numpy as np

# The weight seam's formats (``weights``; settings checks --weights against them here, without torch).
# "auto": every tensor in its own GGUF layout on the native kernels (tsspec.kernels); without them,
# int4 for the tensors stored as Q4_0/Q4_1/Q4_K, f32 for F32/F16, bf16 for everything else.
FORMATS = ("bf16", "f32", "auto", "int4")
# "int4" also requantizes the other tensors to 4 bits (lossy): for drafters, whose guesses the trunk
# verifies, so their precision costs acceptance, never correctness


class GGUFWeight:
    """A weight in its GGUF block layout, exactly as the file stores it: ``raw`` uint8
    [N, row_bytes] (a view of the file's map when read by ``from_file``), logical shape [N, K]. Multiplied by the native
    kernels (``tsspec.kernels``) without dequantizing; ``dense()`` is the exact float32 value."""

    __slots__ = ("type_name", "raw", "shape", "packed")

    def __init__(self, type_name: str, raw: np.ndarray, shape: tuple[int, int], packed: bool = False):
        self.type_name, self.raw, self.shape = type_name, raw, (int(shape[0]), int(shape[1]))
        self.packed = packed  # raw as kernels.repack stores it (same values, laid out for the products)

    def for_products(self) -> "GGUFWeight":
        """This weight as the native products read it fastest (``kernels.repack``; float types and
        packed weights as they are)."""
        from . import kernels

        if self.packed or self.type_name in kernels.FLOAT_TYPES:
            return self if self.raw.flags.writeable else self.private()
        from .gguf_file import release_view

        # a view of the file's map: its pages are let go as the repack passes them, so the file's
        # copy and ours are not both held (a 178 MB embedding held twice for a moment)
        done = None if self.raw.flags.writeable else release_view
        return GGUFWeight(self.type_name, kernels.repack(self.type_name, self.raw, self.shape[1], done=done),
                          self.shape, True)

    def private(self) -> "GGUFWeight":
        """This weight with ``raw`` a contiguous copy of its own (not a view of the file's map)."""
        return GGUFWeight(self.type_name, np.array(self.raw, copy=True, order="C"), self.shape, self.packed)

    def stored(self) -> np.ndarray:
        """raw in the file's own layout"""
        if not self.packed:
            return self.raw
        from . import kernels

        return kernels.unpack(self.type_name, self.raw, self.shape[1])

    def take_rows(self, rows) -> "GGUFWeight":
        """The rows ``rows`` (indices along N, in that order) as stored: a GGUF row is whole blocks,
        so selecting or reordering rows is exact in every type (no dequantization)."""
        idx = np.asarray(rows, dtype=np.int64)
        return GGUFWeight(self.type_name, np.ascontiguousarray(self.stored()[idx]), (len(idx), self.shape[1]))

    @classmethod
    def from_file(cls, type_name: str, flat: np.ndarray, shape: tuple[int, int]) -> "GGUFWeight":
        """The weight as the file's map holds it: ``raw`` a read-only view, no copy. What a
        ``Linear`` keeps is its own (``for_products``: repacked, stacked or copied), so the file's
        bytes pass through memory once and its pages can be let go after the load."""
        n = int(shape[0])
        return cls(type_name, np.asarray(flat, dtype=np.uint8).reshape(n, -1), shape)

    def dense(self) -> np.ndarray:
        from . import kernels

        if kernels.available():
            return kernels.dequant_rows_np(self.type_name, self.raw, self.shape[1], range(self.shape[0]),
                                           packed=self.packed)
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize

        flat = dequantize(self.stored().reshape(-1), GGMLQuantizationType[self.type_name])
        return np.asarray(flat, np.float32).reshape(self.shape)


def gguf_native(type_name: str, shape: tuple[int, ...]) -> bool:
    """Whether the native kernels multiply a tensor of this type and numpy shape [N, K] as stored
    (the plain-C path is only their reference: without AVX-512 VNNI the torch formats are faster)."""
    from . import kernels

    return len(shape) == 2 and kernels.takes(type_name, shape[1])


def stack_parts(ws: list[GGUFWeight]) -> list[GGUFWeight]:
    """Weights stacked along N for one product (fused QKV, gate+up): neighbours of one type and
    width share one block array; the rest stay parts of their own."""
    merged: list[GGUFWeight] = []
    for w in ws:
        if merged and merged[-1].type_name == w.type_name and merged[-1].shape[1] == w.shape[1]:
            m = merged[-1]
            merged[-1] = GGUFWeight(m.type_name, np.concatenate([m.stored(), w.stored()]),
                                    (m.shape[0] + w.shape[0], m.shape[1]))
        else:
            merged.append(w)
    return merged


def stack_biases(biases: list, rows: list[int]) -> np.ndarray | None:
    """The biases of stacked products as one (zeros where a part has none), or None where none has one."""
    if all(b is None for b in biases):
        return None
    return np.concatenate([b if b is not None else np.zeros(n, np.float32) for b, n in zip(biases, rows)])
