"""x @ W.T over GGUF blocks as stored, in Triton (the CUDA backend of the weight seam).

The weight is the file's bytes, uint8 [N, row_bytes] on the device; nothing dequantizes the whole
matrix. One program computes a ``BM`` x ``BN`` tile of the output (``BM`` = 16 rows, masked), looping
over K one scale group at a time (32 elements; 16 for Q6_K, whose sub-blocks are 16 wide) in one
fixed order:

    acc[m, n] += dot(x[m, group], codes[n, group]) * scale[n, group]  (+ sum(x[m, group]) * min[n, group])

``codes`` are the integer codes as stored (Q4_0: q - 8, Q4_1: q, Q5_0: q - 16, Q8_0: q, Q4_K: q,
Q6_K: q - 32), exact in float16; ``scale``/``min`` are the float32 products gguf-py dequantizes
with (Q4_K: d * sc and -dmin * m; Q6_K: d * sc), so ``scale * code + min`` is the stored weight.
The input row is brought to float16 exactly once, scaled by a power of two of its own (its largest
magnitude, rounded up), and the product is scaled back: the only rounding of a quantized product
beyond float32 accumulation is float16's 2^-11 on each input element, row by row.

Batch invariance: a row's result is computed by the same instructions whatever M is. The tile
sizes and the loop are constants (no split-K, nothing chosen from M); rows of a tile never mix (each
output element of the dot reads one input row), and M only decides how many row tiles the grid has.
Float weights (F32/F16/BF16) are multiplied in float32 (``input_precision="ieee"``: no TF32).

``reference`` beside the kernel is the plain torch product of gguf-py's dequantization.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

# GGUF type name -> the kernel's QTYPE constant
QTYPES = {"F32": 0, "F16": 1, "BF16": 2, "Q4_0": 3, "Q4_1": 4, "Q5_0": 5, "Q8_0": 6, "Q4_K": 7, "Q6_K": 8}
FLOAT_TYPES = ("F32", "F16", "BF16")
# elements per block and bytes per block (gguf.constants.GGML_QUANT_SIZES, checked in tests)
BLOCK = {"F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22),
         "Q8_0": (32, 34), "Q4_K": (256, 144), "Q6_K": (256, 210)}
# elements sharing one scale: the K step of the kernel's loop
GROUP = {"Q6_K": 16}
DEFAULT_GROUP = 32
BM = 16  # rows per tile (fixed: the smallest tile a GPU dot takes)
BN = 64  # output columns per tile (fixed)
MAX_ROWS = 64  # decode and verify row counts the kernel is tested for (it is correct for any M)


def takes(type_name: str, k: int) -> bool:
    """Whether the kernel multiplies rows of ``k`` elements of this GGUF type."""
    if type_name not in QTYPES:
        return False
    elems = BLOCK[type_name][0]
    return k % elems == 0 and k % GROUP.get(type_name, DEFAULT_GROUP) == 0


def row_bytes(type_name: str, k: int) -> int:
    elems, nbytes = BLOCK[type_name]
    return k // elems * nbytes


@triton.jit
def _f16_at(ptr, off):
    """The float16 stored little-endian at byte ``ptr + off``, as float32."""
    lo = tl.load(ptr + off).to(tl.uint16)
    hi = tl.load(ptr + off + 1).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _group(w_ptr, rows, row_ok, rb, g, QTYPE: tl.constexpr, GS: tl.constexpr):
    """Codes [BN, GS] (float16, exact integers), scale [BN] and min [BN] (float32) of group ``g``
    of the rows ``rows`` (byte offsets of each row's start)."""
    e = tl.arange(0, GS)
    rmask = row_ok[:, None]
    if QTYPE == 3 or QTYPE == 4 or QTYPE == 5 or QTYPE == 6:  # 32-element blocks, one per group
        BB: tl.constexpr = 18 if QTYPE == 3 else 20 if QTYPE == 4 else 22 if QTYPE == 5 else 34
        base = rows + g * BB  # [BN] byte offset of the block
        d = _f16_at(w_ptr, base)
        mn = tl.zeros_like(d)
        if QTYPE == 6:
            q = tl.load(w_ptr + base[:, None] + 2 + e[None, :], mask=rmask, other=0).to(tl.int8, bitcast=True)
            q = q.to(tl.int32)
        else:
            QS: tl.constexpr = 2 if QTYPE == 3 else 4 if QTYPE == 4 else 6
            byte = tl.load(w_ptr + base[:, None] + QS + (e % 16)[None, :], mask=rmask, other=0).to(tl.int32)
            q = (byte >> (4 * (e // 16))[None, :]) & 0xF
            if QTYPE == 3:
                q = q - 8
            if QTYPE == 4:
                mn = _f16_at(w_ptr, base + 2)
            if QTYPE == 5:
                hb = tl.load(w_ptr + base[:, None] + 2 + (e // 8)[None, :], mask=rmask, other=0).to(tl.int32)
                q = (q | (((hb >> (e % 8)[None, :]) & 1) << 4)) - 16
        return q.to(tl.float16), d, mn
    elif QTYPE == 7:  # Q4_K: 256 elements = 8 groups of 32; d, dmin, scales[12], qs[128]
        base = rows + (g // 8) * 144
        j = g % 8
        d = _f16_at(w_ptr, base)
        dmin = _f16_at(w_ptr, base + 2)
        if j < 4:
            sc = tl.load(w_ptr + base + 4 + j).to(tl.int32) & 63
            m = tl.load(w_ptr + base + 8 + j).to(tl.int32) & 63
        else:
            lo = tl.load(w_ptr + base + 8 + j).to(tl.int32)  # scales[j + 4]
            sc = (lo & 0xF) | ((tl.load(w_ptr + base + j).to(tl.int32) >> 6) << 4)  # scales[j - 4]
            m = (lo >> 4) | ((tl.load(w_ptr + base + 4 + j).to(tl.int32) >> 6) << 4)  # scales[j]
        byte = tl.load(w_ptr + base[:, None] + 16 + (j // 2) * 32 + e[None, :], mask=rmask, other=0).to(tl.int32)
        q = (byte >> (4 * (j % 2))) & 0xF
        return q.to(tl.float16), d * sc.to(tl.float32), -(dmin * m.to(tl.float32))
    else:  # Q6_K: 256 elements = 16 groups of 16; ql[128], qh[64], scales[16] (int8), d
        base = rows + (g // 16) * 210
        j = g % 16
        h = j // 8  # which 128-element half
        r = (j % 8) * 16 + e  # element within the half
        ql = tl.load(w_ptr + base[:, None] + 64 * h + (r % 64)[None, :], mask=rmask, other=0).to(tl.int32)
        ql = (ql >> (4 * (r // 64))[None, :]) & 0xF
        qh = tl.load(w_ptr + base[:, None] + 128 + 32 * h + (r % 32)[None, :], mask=rmask, other=0).to(tl.int32)
        qh = (qh >> (2 * (r // 32))[None, :]) & 3
        q = (ql | (qh << 4)) - 32
        sc = tl.load(w_ptr + base + 192 + j).to(tl.int8, bitcast=True).to(tl.float32)
        d = _f16_at(w_ptr, base + 208)
        return q.to(tl.float16), d * sc, tl.zeros_like(d)


@triton.jit
def _tile(M, N, rb, BM: tl.constexpr, BN: tl.constexpr):
    """This program's output tile: its rows of x and y (``rm``), its weight rows (``rn``), their
    masks, and each weight row's byte offset (masked columns read row 0 and are never stored)."""
    rm = tl.program_id(1) * BM + tl.arange(0, BM)
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    n_ok = rn < N
    return rm, rn, rm < M, n_ok, tl.where(n_ok, rn, 0).to(tl.int64) * rb


@triton.jit
def _qmatmul_kernel(x_ptr, s_ptr, w_ptr, y_ptr, M, N, K, rb, ldy,
                    QTYPE: tl.constexpr, GS: tl.constexpr, HAS_MIN: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr):
    """y[m, n] = s[m] * sum_g (dot(x16[m, g], codes[n, g]) * scale[n, g] + sum(x16[m, g]) * min[n, g])."""
    rm, rn, m_ok, n_ok, rows = _tile(M, N, rb, BM, BN)
    e = tl.arange(0, GS)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for g in range(0, K // GS):
        xg = tl.load(x_ptr + rm[:, None] * K + g * GS + e[None, :], mask=m_ok[:, None], other=0.0)  # fp16
        q, sc, mn = _group(w_ptr, rows, n_ok, rb, g, QTYPE, GS)
        part = tl.dot(xg, tl.trans(q), out_dtype=tl.float32)
        acc += part * sc[None, :]
        if HAS_MIN:
            acc += tl.sum(xg.to(tl.float32), axis=1)[:, None] * mn[None, :]
    s = tl.load(s_ptr + rm, mask=m_ok, other=1.0)
    acc = acc * s[:, None]
    tl.store(y_ptr + rm[:, None] * ldy + rn[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _fmatmul_kernel(x_ptr, w_ptr, y_ptr, M, N, K, rb, ldy,
                    QTYPE: tl.constexpr, GS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Float weights (F32 0, F16 1, BF16 2) times float32 x, in float32 (no TF32)."""
    rm, rn, m_ok, n_ok, rows = _tile(M, N, rb, BM, BN)
    e = tl.arange(0, GS)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for g in range(0, K // GS):
        xg = tl.load(x_ptr + rm[:, None] * K + g * GS + e[None, :], mask=m_ok[:, None], other=0.0)
        col = g * GS + e
        if QTYPE == 0:
            b0 = tl.load(w_ptr + rows[:, None] + 4 * col[None, :]).to(tl.uint32)
            b1 = tl.load(w_ptr + rows[:, None] + 4 * col[None, :] + 1).to(tl.uint32)
            b2 = tl.load(w_ptr + rows[:, None] + 4 * col[None, :] + 2).to(tl.uint32)
            b3 = tl.load(w_ptr + rows[:, None] + 4 * col[None, :] + 3).to(tl.uint32)
            w = (b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)).to(tl.float32, bitcast=True)
        else:
            lo = tl.load(w_ptr + rows[:, None] + 2 * col[None, :]).to(tl.uint16)
            hi = tl.load(w_ptr + rows[:, None] + 2 * col[None, :] + 1).to(tl.uint16)
            h16 = lo | (hi << 8)
            if QTYPE == 1:
                w = h16.to(tl.float16, bitcast=True).to(tl.float32)
            else:
                w = (h16.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        acc += tl.dot(xg, tl.trans(w), input_precision="ieee", out_dtype=tl.float32)
    tl.store(y_ptr + rm[:, None] * ldy + rn[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])


def prepare(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x float32 [M, K] -> (x16, s): float16 rows scaled into [-1, 1] by a power of two per row
    (its largest magnitude rounded up; 1 for a zero row) and that power, float32 [M]. Exact apart
    from float16's rounding of each element; every row on its own. Shared by all parts of a Linear."""
    amax = x.abs().amax(dim=1)
    _, e = torch.frexp(amax)  # amax = f * 2^e, f in [0.5, 1): amax <= 2^e
    s = torch.where(amax > 0, torch.ldexp(torch.ones_like(amax), e), torch.ones_like(amax))
    return (x / s[:, None]).to(torch.float16).contiguous(), s.contiguous()


def matmul(type_name: str, w: torch.Tensor, k: int, x: torch.Tensor, y: torch.Tensor, col0: int = 0,
           prepared: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """y[:, col0 : col0 + n] = x @ W.T for W the GGUF rows ``w`` (uint8 [n, row_bytes], on the
    device of x and y). x float32 [M, k] contiguous; y float32 [M, >= col0 + n] contiguous;
    ``prepared``: ``prepare(x)``, to share it between parts (quantized types only)."""
    n, rb = w.shape
    m = x.shape[0]
    if not takes(type_name, k) or rb != row_bytes(type_name, k):
        raise ValueError(f"{type_name}: cannot multiply rows of {k} elements stored in {rb} bytes")
    if m == 0 or n == 0:
        return
    grid = (triton.cdiv(n, BN), triton.cdiv(m, BM))
    out = y[:, col0:]
    qtype = QTYPES[type_name]
    if type_name in FLOAT_TYPES:
        _fmatmul_kernel[grid](x, w, out, m, n, k, rb, y.stride(0), QTYPE=qtype, GS=DEFAULT_GROUP, BM=BM, BN=BN)
        return
    x16, s = prepared if prepared is not None else prepare(x)
    _qmatmul_kernel[grid](x16, s, w, out, m, n, k, rb, y.stride(0), QTYPE=qtype,
                          GS=GROUP.get(type_name, DEFAULT_GROUP), HAS_MIN=type_name in ("Q4_1", "Q4_K"),
                          BM=BM, BN=BN)


# ----------------------------------------------------------------------------- reference


def dequantize(type_name: str, raw: np.ndarray, k: int) -> np.ndarray:
    """gguf-py's float32 dequantization of the rows ``raw`` (uint8 [n, row_bytes])."""
    raw = np.ascontiguousarray(raw)
    n = raw.shape[0]
    if type_name == "F32":
        return raw.view(np.float32).reshape(n, k).copy()
    if type_name == "F16":
        return raw.view(np.float16).astype(np.float32).reshape(n, k)
    if type_name == "BF16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(n, k)
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    return np.asarray(gguf_dequantize(raw.reshape(-1), GGMLQuantizationType[type_name]), np.float32).reshape(n, k)


def reference(type_name: str, raw: np.ndarray, k: int, x: torch.Tensor) -> torch.Tensor:
    """x @ W.T in float64 with gguf-py's dequantized W (float64 result), on the CPU."""
    w = torch.from_numpy(dequantize(type_name, raw, k)).double()
    return x.detach().cpu().double() @ w.T


def error_bound(type_name: str, raw: np.ndarray, k: int, x: torch.Tensor) -> torch.Tensor:
    """How far the kernel may be from ``reference``, per element: float16 rounding of each input
    element (relative 2^-11, or 2^-25 of the row's scale in float16's subnormal range) for quantized
    types, plus float32 accumulation over k terms (k * 2^-24 of the absolute sum, a loose bound)."""
    w = torch.from_numpy(dequantize(type_name, raw, k)).double().abs()
    xa = x.detach().cpu().double().abs()
    mag = xa @ w.T
    bound = k * 2.0 ** -24 * mag
    if type_name not in FLOAT_TYPES:
        s = xa.amax(dim=1, keepdim=True) * 2  # the row's power-of-two scale is at most twice its max
        bound = bound + 2.0 ** -11 * mag + 2.0 ** -25 * s * w.sum(dim=1)[None, :]
    return bound + 1e-30
