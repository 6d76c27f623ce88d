"""The in-memory weight format, behind one seam.

Every matrix product with a model weight goes through ``Linear``. The default format (``auto``)
multiplies each tensor in its own GGUF layout on the native kernels (``tsspec.kernels``); ``bf16``
(oneDNN's bf16 kernels) and ``f32`` keep a dense copy, f32 being the plain reference.

Batch invariance. A row's result must not depend on how many rows share the product, or
speculative output drifts from plain output at near-ties. Which route oneDNN's bf16 GEMM and
MKL's f32 GEMM take depends on the row count and on the CPU (on AMD Zen 4 bf16 was invariant for
any count >= 2 and f32 for multiples of 4; on an Intel core with AMX no count was safe, the 1536 x
8960 bf16 product gave other bits at 2, 5, 8, 9, 16 ... rows than at 300). So the dense formats
never let the count vary: every product runs on exactly ``DENSE_CHUNK_ROWS`` rows at a time, the
last chunk padded with zero rows, and a row gives the same bits at any place in any chunk
(checked on both CPUs). ``tests/test_weights.py`` checks the property on the shapes our models
use; a GPU/Triton format would slot in here as another ``Linear`` backend with the same test.

The ``int4`` backend (chosen per tensor by the ``auto`` format for Q4_0/Q4_1/Q4_K tensors) keeps the
file's 4-bit codes packed for torch's CPU kernel ``_weight_int4pack_mm_for_cpu``, which computes
``x @ ((q - 8) * scale + zero).T`` per 32-wide group along K. The codes are not re-derived from any
knowledge of the block layouts: ``int4_from_gguf`` asks gguf-py to dequantize each block with all
its 4-bit codes forced to 0 and to 15, which gives every group's affine map ``w = a*q + b``; the
codes are then ``round((w - b) / a)`` of the real dequantized values, checked to reproduce them.
Decode reads a quarter of the bytes a bf16 weight needs, so a 1-row product is ~4x cheaper.

The ``triton`` backend (a ``Linear`` built with a ``device``: the GPU path, ``--device cuda``) keeps
the file's GGUF blocks as stored, uint8 on the device, and multiplies them with the Triton kernels
of ``tsspec.kernels.triton_gguf``: batch invariant for every row count by construction (fixed tiles,
one reduction order), exact weights, each input element rounded once to float16 under a per-row
power-of-two scale. Its inputs and outputs live on the device.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .gguf_weight import FORMATS, GGUFWeight, gguf_native, stack_biases, stack_parts  # noqa: F401 - the weight seam's names, re-exported

# Dense (bf16, f32) products always run on this many rows, so that the GEMM route never changes
DENSE_CHUNK_ROWS = 16
# The int4 kernel needs no padding: it is invariant for every row count (tests/test_weights_int4.py).
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
INT4_GROUP = 32  # elements sharing one (scale, zero) along K: every Q4 type's (sub-)block size
# byte offset of the 4-bit codes (``qs``) inside one block, from gguf-py's block layouts:
# Q4_0 = f16 d + qs[16]; Q4_1 = f16 d, f16 m + qs[16]; Q4_K = f16 d, f16 dmin, scales[12] + qs[128]
_QS_OFFSET = {"Q4_0": 2, "Q4_1": 4, "Q4_K": 16}
# compute dtype of the int4 product (inputs, scales/zeros and the kernel's output)
INT4_DTYPE = torch.bfloat16


# the format when none is asked for; the operator's choice (--weights, TSSPEC_WEIGHTS) is resolved
# by ``tsspec.settings`` and arrives here as an explicit argument: nothing in this module reads the
# environment
DEFAULT_FORMAT = "auto"


def pad_rows(x: torch.Tensor, min_rows: int, multiple: int = 1) -> torch.Tensor:
    """Repeat the last row until ``x`` has at least ``min_rows`` rows and a multiple of ``multiple``
    (the results of pad rows are dropped)."""
    m = x.shape[0]
    target = max(m, min_rows)
    target = -(-target // multiple) * multiple
    if target == m:
        return x
    return torch.cat([x, x[-1:].expand(target - m, *x.shape[1:])], dim=0)


def dense_product(x: torch.Tensor, w: torch.Tensor, rows: int = DENSE_CHUNK_ROWS) -> torch.Tensor:
    """x [m, k] @ w.T in products of exactly ``rows`` rows (the last padded with zeros; the
    result has a multiple of ``rows`` rows, the first m are x's)."""
    m = x.shape[0]
    target = max(-(-m // rows) * rows, rows)
    if target != m:
        x = torch.cat([x, x.new_zeros(target - m, *x.shape[1:])], dim=0)
    if target == rows:
        return F.linear(x, w)
    return torch.cat([F.linear(x[i : i + rows], w) for i in range(0, target, rows)], dim=0)


def to_tensor(a: np.ndarray | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(a, np.ndarray):
        # dequantized F32 tensors can be read-only views of the memory map: copy those
        a = np.ascontiguousarray(a) if a.flags.writeable else np.array(a, copy=True)
        a = torch.from_numpy(a)
    return a.to(dtype).contiguous()


class Int4Weight:
    """A 4-bit weight as the file stores it: ``w[n, k] = a[n, k // 32] * q[n, k] + b[n, k // 32]``.

    ``q`` uint8 [N, K] in 0..15; ``a``, ``b`` float32 [N, K/32]. Only lives while loading."""

    __slots__ = ("q", "a", "b")

    def __init__(self, q: np.ndarray, a: np.ndarray, b: np.ndarray):
        self.q, self.a, self.b = q, a, b

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape

    def dense(self) -> np.ndarray:
        """a*q + b as float32 [N, K] (equal to gguf-py's dequantization to float32 rounding)."""
        n, k = self.q.shape
        q = self.q.reshape(n, k // INT4_GROUP, INT4_GROUP).astype(np.float32)
        return (self.a[..., None] * q + self.b[..., None]).reshape(n, k)


def take_rows(w, rows):
    """Rows ``rows`` of a weight in whatever form a loader holds it (``GGUFWeight``: its stored
    blocks; ``Int4Weight``: its codes and groups; an array), for layouts that fuse or interleave
    several products in one tensor: the parts keep the file's precision."""
    idx = np.asarray(rows, dtype=np.int64)
    if isinstance(w, GGUFWeight):
        return w.take_rows(idx)
    if isinstance(w, Int4Weight):
        return Int4Weight(w.q[idx], w.a[idx], w.b[idx])
    return np.ascontiguousarray(np.asarray(w)[idx])


def load_format(fmt: str | None) -> str:
    """The format to load a weight with, given a requested one or a ``Linear``'s backend name
    (drafters load in their trunk's format: a trunk on the ``gguf`` backend was loaded as "auto");
    None: ``DEFAULT_FORMAT``."""
    fmt = fmt or DEFAULT_FORMAT
    return "auto" if fmt == "gguf" else fmt


def int4_quantize(w: np.ndarray) -> Int4Weight:
    """Lossy 4-bit codes for a float weight [N, K]: per 32-wide group, min/max affine (drafters only)."""
    n, k = w.shape
    grp = w.reshape(n, k // INT4_GROUP, INT4_GROUP).astype(np.float32)
    lo, hi = grp.min(-1), grp.max(-1)
    a = (hi - lo) / 15.0
    safe = np.where(a == 0, 1.0, a)
    q = np.clip(np.rint((grp - lo[..., None]) / safe[..., None]), 0, 15).astype(np.uint8)
    return Int4Weight(q.reshape(n, k), a.astype(np.float32), lo.astype(np.float32))


def int4_shape_ok(shape: tuple[int, ...]) -> bool:
    return len(shape) == 2 and shape[1] % INT4_GROUP == 0 and shape[0] % 16 == 0


def int4_supported(type_name: str, shape: tuple[int, ...]) -> bool:
    """Whether a tensor of this GGUF type and numpy shape [N, K] can use the int4 backend."""
    return (type_name in INT4_TYPES and len(shape) == 2 and shape[1] % INT4_GROUP == 0
            and shape[0] % 16 == 0)  # the CPU packing wants N divisible by 16


def int4_from_gguf(type_name: str, raw: np.ndarray, shape: tuple[int, int], *, check: bool = True,
                   chunk_elems: int = 1 << 22) -> Int4Weight:
    """Exact 4-bit codes and per-group affine maps of a Q4_0/Q4_1/Q4_K tensor, via gguf-py.

    ``raw``: the tensor's block bytes (uint8); ``shape``: numpy order [N, K]. Each block is
    dequantized by gguf-py three times: as stored, with every code byte 0x00 (gives the group offset
    b) and 0xFF (gives 15a + b). ``check`` asserts that a*q + b reproduces the stored dequantization
    to float32 rounding and that every 32-wide group has one affine map.
    """
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType[type_name]
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    off = _QS_OFFSET[type_name]
    assert block_bytes - off == block_elems // 2, (type_name, block_bytes, off)  # 4 bits per element
    n, k = shape
    if k % block_elems:
        raise ValueError(f"{type_name} row of {k} is not whole blocks of {block_elems}")
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(n * (k // block_elems), block_bytes)
    g = k // INT4_GROUP
    q_out = np.empty((n, k), np.uint8)
    a_out = np.empty((n, g), np.float32)
    b_out = np.empty((n, g), np.float32)
    per_row = k // block_elems
    step = max(1, chunk_elems // k)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        blk = blocks[r0 * per_row : r1 * per_row]
        lo, hi = blk.copy(), blk.copy()
        lo[:, off:] = 0x00
        hi[:, off:] = 0xFF

        def deq(b: np.ndarray) -> np.ndarray:
            # whole tensor rows per call: gguf-py loops in Python over the rows it is given
            rows = b.reshape(r1 - r0, per_row * block_bytes)
            return np.asarray(dequantize(rows, qtype), np.float32).reshape(r1 - r0, g, INT4_GROUP)

        w, w0, w15 = deq(blk), deq(lo), deq(hi)
        b = w0[..., 0]
        a64 = (w15[..., 0].astype(np.float64) - b) / 15.0
        if check and not (np.array_equal(w0, np.broadcast_to(b[..., None], w0.shape))
                          and np.array_equal(w15, np.broadcast_to(w15[..., :1], w15.shape))):
            raise ValueError(f"{type_name}: a 32-wide group does not share one affine map")
        safe = np.where(a64 == 0, 1.0, a64)
        q = np.rint((w - b[..., None]) / safe[..., None])
        q = np.where(a64[..., None] == 0, 0.0, q)
        if check:
            if q.min() < 0 or q.max() > 15:
                raise ValueError(f"{type_name}: recovered codes outside 0..15")
        a = a64.astype(np.float32)
        if check:
            back = a[..., None] * q.astype(np.float32) + b[..., None]
            # float32 rounding of the products and sum gguf-py and we compute (a few ulp of the terms)
            tol = 4 * np.finfo(np.float32).eps * (np.abs(a[..., None]) * 15 + np.abs(b[..., None]))
            if not bool((np.abs(back - w) <= tol).all()):
                raise ValueError(f"{type_name}: a*q + b does not reproduce gguf-py's dequantization")
        q_out[r0:r1] = q.reshape(r1 - r0, k).astype(np.uint8)
        a_out[r0:r1] = a
        b_out[r0:r1] = b
    return Int4Weight(q_out, a_out, b_out)


class Linear:
    """y = x @ W.T + b for x [rows, in] float32 -> y [rows, out] float32.

    Backends, chosen from the weight and ``fmt``:

    * ``gguf``: a ``GGUFWeight`` (or several, stacked along N) multiplied by the native kernels in
      the file's own block layout: exact weights, batch invariant for every row count. What
      "auto" gives every tensor whose type the kernels take (when they are available);
    * ``int4``: an ``Int4Weight`` packed for torch's int4 kernel (``self.weight`` the packed uint8
      tensor, ``self.scales_and_zeros`` [K/32, N, 2]); "auto" without native kernels;
    * ``bf16`` / ``f32``: a dense weight (f32 is the plain reference).
    """

    __slots__ = ("weight", "scales_and_zeros", "bias", "fmt", "out_features",
                 "in_features", "parts", "quantized", "device", "dev_parts")

    def __init__(self, weight, bias=None, fmt: str | None = None, device=None):
        fmt = load_format(fmt)
        self.scales_and_zeros = None
        self.parts: list[GGUFWeight] | None = None
        self.device = None  # the triton backend's device; None for the CPU backends
        self.dev_parts: list[tuple[str, torch.Tensor, int]] | None = None
        # a GGUFWeight, or several stacked along N (from ``concat``)
        parts = weight if isinstance(weight, list) else [weight] if isinstance(weight, GGUFWeight) else None
        if device is not None:
            self._init_triton(parts, weight, bias, fmt, torch.device(device))
            return
        if parts is not None:
            if fmt == "auto" and all(gguf_native(p.type_name, p.shape) for p in parts):
                from . import kernels

                self.fmt = "gguf"
                self.parts = [p.for_products() for p in parts]  # repacked once, here, not per call
                # whether any part takes the quantized input (computed once per call, shared)
                self.quantized = any(p.type_name not in kernels.FLOAT_TYPES for p in parts)
                self.out_features = sum(p.shape[0] for p in parts)
                self.in_features = parts[0].shape[1]
                self.weight = self.parts[0].raw  # (never the unpacked copy: that would stay alive)
                self.bias = None if bias is None else to_tensor(bias, torch.float32)
                return
            weight = _fallback_weight(parts, fmt)
            if fmt == "auto":
                fmt = "int4" if isinstance(weight, Int4Weight) else _fallback_dense_format(parts)
        if isinstance(weight, Int4Weight):
            if fmt in ("auto", "int4"):
                fmt = "int4"
                self.out_features, self.in_features = weight.shape
                self.weight, self.scales_and_zeros = _pack_int4(weight)
            else:
                weight = weight.dense()
        elif fmt == "auto":
            # a dense array (not the file's blocks): "auto" never holds values below their precision
            fmt = "f32"
        elif fmt == "int4":
            fmt = "bf16"  # int4 is lossy by request (drafters): a dense weight may be rounded
        self.fmt = fmt
        if fmt != "int4":
            dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
            self.weight = to_tensor(weight, dtype)  # [out, in]
            self.out_features, self.in_features = self.weight.shape
        self.bias = None if bias is None else to_tensor(bias, torch.float32)  # [out]

    def _init_triton(self, parts, weight, bias, fmt: str, device: torch.device) -> None:
        """The triton backend: each part's stored blocks as uint8 [n, row_bytes] on ``device``."""
        from .errors import BadInput
        from .kernels import triton_gguf

        if parts is None:
            raise BadInput("the GPU path multiplies GGUF weights as the file stores them (--weights auto)")
        for p in parts:
            if not triton_gguf.takes(p.type_name, p.shape[1]):
                raise BadInput(f"a {p.type_name} weight of {p.shape[0]}x{p.shape[1]} has no Triton kernel "
                               "(use --device cpu)")
        self.fmt = "triton"
        self.device = device
        # a private copy first: a view of the file's map is read-only, and .to() of a CPU tensor shares it
        self.dev_parts = [(p.type_name, torch.from_numpy(np.require(p.stored(), requirements=["C", "W"])).to(device),
                           p.shape[0]) for p in parts]
        self.quantized = any(p.type_name not in triton_gguf.FLOAT_TYPES for p in parts)
        self.out_features = sum(p.shape[0] for p in parts)
        self.in_features = parts[0].shape[1]
        self.weight = self.dev_parts[0][1]
        self.bias = None if bias is None else to_tensor(bias, torch.float32).to(device)

    @staticmethod
    def concat(parts: list[tuple], fmt: str | None = None, device=None) -> "Linear":
        """One Linear over row-stacked weights (fused QKV, gate+up): fewer, larger products.

        GGUF weights stay in their layouts (neighbours of one type share one block array); parts
        that are all ``Int4Weight`` stay int4 (codes and groups stacked along N); a mix is stacked
        dense."""
        ws = [p[0] for p in parts]
        b = stack_biases([p[1] for p in parts], [w.shape[0] for w in ws])
        if all(isinstance(w, GGUFWeight) for w in ws):
            return Linear(stack_parts(ws), b, fmt, device)
        if all(isinstance(w, Int4Weight) for w in ws):
            w = Int4Weight(*(np.concatenate([getattr(x, f) for x in ws], axis=0) for f in ("q", "a", "b")))
        else:
            w = np.concatenate([x.dense() if isinstance(x, (Int4Weight, GGUFWeight)) else np.asarray(x)
                                for x in ws], axis=0)
        return Linear(w, b, fmt)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        if self.fmt == "triton":
            from .kernels import triton_gguf

            x = x.to(self.device, torch.float32).contiguous()
            y = torch.empty(m, self.out_features, dtype=torch.float32, device=self.device)
            prepared = triton_gguf.prepare(x) if self.quantized else None
            col = 0
            for type_name, w, n in self.dev_parts:
                triton_gguf.matmul(type_name, w, self.in_features, x, y, col, prepared=prepared)
                col += n
            return y if self.bias is None else y.add_(self.bias)
        if self.fmt == "gguf":
            from . import kernels

            x = x.contiguous() if x.dtype == torch.float32 else x.float().contiguous()
            y = torch.empty(m, self.out_features, dtype=torch.float32)
            xq = kernels.quantize(x) if self.quantized else None
            col = 0
            for p in self.parts:
                kernels.matmul(p.type_name, p.raw, self.in_features, x, xq, y, col, packed=p.packed)
                col += p.shape[0]
            return y if self.bias is None else y.add_(self.bias)
        if self.fmt == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(INT4_DTYPE), self.weight, INT4_GROUP, self.scales_and_zeros).float()
        else:
            y = dense_product(x.to(self.weight.dtype), self.weight)[:m].float()
        if self.bias is not None:
            y = y + self.bias
        return y

    def dense_weight(self) -> torch.Tensor:
        """The weight the product uses, as float32 [out, in] (int4: unpacked through the kernel
        with the identity as input, in float32; gguf: the file's exact values; for tests)."""
        if self.fmt == "gguf":
            return torch.from_numpy(np.concatenate([p.dense() for p in self.parts]))
        if self.fmt == "triton":
            from .kernels import triton_gguf

            return torch.from_numpy(np.concatenate([triton_gguf.dequantize(t, w.cpu().numpy(), self.in_features)
                                                    for t, w, _ in self.dev_parts]))
        if self.fmt != "int4":
            return self.weight.float()
        k = self.in_features
        sz = self.scales_and_zeros.float()
        out = torch.empty(self.out_features, k)
        eye = torch.eye(k)
        for i in range(0, k, 256):  # identity rows in chunks: [rows, N] = W.T[rows]
            out[:, i : i + 256] = torch.ops.aten._weight_int4pack_mm_for_cpu(
                eye[i : i + 256], self.weight, INT4_GROUP, sz).T
        return out

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """Plain float32 product with the same stored weights (on the CPU), for tests."""
        y = x.float().cpu() @ self.dense_weight().T
        return y if self.bias is None else y + self.bias.cpu()

    def nbytes(self) -> int:
        if self.fmt == "gguf":
            n = sum(p.raw.nbytes for p in self.parts)
        elif self.fmt == "triton":
            n = sum(w.numel() for _, w, _ in self.dev_parts)
        else:
            n = self.weight.numel() * self.weight.element_size()
        if self.scales_and_zeros is not None:
            n += self.scales_and_zeros.numel() * self.scales_and_zeros.element_size()
        return n + (0 if self.bias is None else self.bias.numel() * 4)


def _fallback_weight(parts: list[GGUFWeight], fmt: str):
    """GGUF weights the native kernels cannot take (or "bf16"/"f32" asked): Int4Weight for 4-bit
    types under "auto" (torch's int4 kernel), else the exact float32 values."""
    if fmt == "auto" and all(int4_supported(p.type_name, p.shape) for p in parts):
        try:
            ws = [int4_from_gguf(p.type_name, p.stored().reshape(-1), p.shape) for p in parts]
            return Int4Weight(*(np.concatenate([getattr(x, f) for x in ws], axis=0) for f in ("q", "a", "b")))
        except ValueError:  # codes not recoverable exactly: keep the exact float weights instead
            pass
    return np.concatenate([p.dense() for p in parts]) if len(parts) > 1 else parts[0].dense()


def _fallback_dense_format(parts: list[GGUFWeight]) -> str:
    """Without native kernels, "auto" holds F32/F16/BF16 tensors in f32 (never below the file's
    precision) and other types in bf16."""
    return "f32" if any(p.type_name in ("F32", "F16") for p in parts) else "bf16"


class Embedding:
    """Token embedding rows. ``table[ids]`` -> float32 [len(ids), d].

    Holds either a dense tensor (bf16/f32 formats) or a ``GGUFWeight`` whose rows are dequantized
    exactly on lookup (only the rows a forward needs), so a 262k-row table costs its file size."""

    def __init__(self, weight):
        self.gguf = weight if isinstance(weight, GGUFWeight) else None
        self.dense = None if self.gguf is not None else weight
        self.shape = tuple(weight.shape)

    def __getitem__(self, ids) -> torch.Tensor:
        if self.gguf is not None:
            from . import kernels

            idx = ids.tolist() if isinstance(ids, torch.Tensor) else ids
            return kernels.dequant_rows(self.gguf.type_name, self.gguf.raw, self.shape[1], idx, packed=self.gguf.packed)
        return self.dense[ids].float()

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if self.gguf is not None else self.dense.dtype

    def nbytes(self) -> int:
        if self.gguf is not None:
            return self.gguf.raw.nbytes
        return self.dense.numel() * self.dense.element_size()

    def storage_ptr(self) -> int:
        return self.gguf.raw.ctypes.data if self.gguf is not None else self.dense.data_ptr()


def _pack_int4(w: Int4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes, scales_and_zeros [K/32, N, 2]) for ``_weight_int4pack_mm_for_cpu``, whose
    dequantization is ``(q - 8) * scale + zero``: scale = a, zero = b + 8a."""
    n, k = w.shape
    if k % INT4_GROUP or n % 16:
        raise ValueError(f"int4 needs K % {INT4_GROUP} == 0 and N % 16 == 0, not [{n}, {k}]")
    parts = []
    step = 4096  # pack in row chunks (a multiple of the kernel's 64-row tiles) to bound the int32 copy
    for r in range(0, n, step):
        q = torch.from_numpy(w.q[r : r + step].astype(np.int32))
        parts.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
    packed = parts[0] if len(parts) == 1 else torch.cat(parts)
    a = torch.from_numpy(w.a.astype(np.float64))
    b = torch.from_numpy(w.b.astype(np.float64))
    sz = torch.stack([a, b + 8 * a], dim=-1).transpose(0, 1).to(INT4_DTYPE).contiguous()
    return packed, sz
