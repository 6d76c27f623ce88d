"""The super-block arithmetic for prompt rows (tsspec/kernels/prompt_tiles.c).

Q4_K products with inputs quantized per 256 elements and one float step per super-block. Three ways
to run it must give the same bits: the C reference (every CPU and level), the AMX tiles (hardware),
and the tiles' sequence with the tile instruction done in C (any CPU whose AVX-512 build has VBMI).
The reference is checked against numpy's reading of the same arithmetic (quantized codes exactly, the
products to float rounding), and against the float product. The hardware case skips where AMX does
not run; the emulated one wherever the build has the tile form, which is every AMX machine.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from test_kernels import gguf_dense, random_blocks
from tsspec import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"native kernels: {kernels.unavailable_reason()}")

TILES_BUILT = kernels.available() and kernels.sb_tiles_built()
EMU = pytest.mark.skipif(not TILES_BUILT, reason="this build has no super-block tile form (AVX-512 with VBMI)")
HW = pytest.mark.skipif(not (TILES_BUILT and kernels.amx_usable()),
                        reason=f"needs AMX tiles the kernel grants (this machine: {kernels.amx_status()})")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def product(w, k, x, mode, *, packed=False, threads=1, type_name="Q4_K"):
    y = torch.full((x.shape[0], w.shape[0]), float("nan"))
    kernels.matmul_sb(type_name, w, k, x.contiguous(), y, packed=packed, mode=mode, threads=threads)
    return y


def inputs(m, k, seed=5):
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 3
    x[:, :256] *= 40  # super-blocks of very different ranges
    if m > 2:
        x[2, 256:512] = 0  # an all-zero super-block: dx 0
    return x


def numpy_quantize(x: np.ndarray):
    """quantize_sb as numpy reads it: float32 operations, rint (ties to even)"""
    m, k = x.shape
    v = x.reshape(m, k // 256, 256).astype(np.float32)
    amax = np.abs(v).max(axis=2)
    with np.errstate(divide="ignore"):
        iscale = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    dx = np.where(amax > 0, amax / np.float32(127), np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(v * iscale[:, :, None]), -127, 127).astype(np.int8)
    xs = q.reshape(m, k // 32, 32).astype(np.int32).sum(axis=2).astype(np.int16)
    return q.reshape(m, k), dx, xs


def q4k_parts(raw: np.ndarray, k: int):
    """the stored rows' integer codes [n, k], sub-block scales and minimums [n, k / 32], d and dmin
    [n, k / 256] (float32), read from the bytes as the format defines them"""
    n = raw.shape[0]
    b = raw.reshape(n, k // 256, 144)
    d = b[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    dmin = b[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    s = b[:, :, 4:16].astype(np.int32)
    sc = np.empty((n, k // 256, 8), np.int32)
    mn = np.empty_like(sc)
    for j in range(8):
        if j < 4:
            sc[..., j], mn[..., j] = s[..., j] & 63, s[..., j + 4] & 63
        else:
            sc[..., j] = (s[..., j + 4] & 0xF) | ((s[..., j - 4] >> 6) << 4)
            mn[..., j] = (s[..., j + 4] >> 4) | ((s[..., j] >> 6) << 4)
    qs = b[:, :, 16:].reshape(n, k // 256, 4, 32)  # 64-element chunks: low nibbles, then high
    codes = np.concatenate([qs & 15, qs >> 4], axis=3).reshape(n, k).astype(np.int64)
    return codes, sc.reshape(n, -1), mn.reshape(n, -1), d, dmin


def numpy_product(raw, k, x):
    """the arithmetic in numpy: exact integer S and M per super-block, the float steps in float64
    (so within a float32 rounding or so of the C result, not bit for bit)"""
    q, dx, xs = numpy_quantize(x.numpy())
    codes, sc, mn, d, dmin = q4k_parts(raw, k)
    n, m, nsb = raw.shape[0], x.shape[0], k // 256
    isum = np.einsum("nbe,mbe->nmb", codes.reshape(n, nsb * 8, 32), q.reshape(m, nsb * 8, 32).astype(np.int64))
    S = (isum * sc[:, None, :]).reshape(n, m, nsb, 8).sum(axis=3)
    M = (xs.astype(np.int64)[None, :, :] * mn[:, None, :]).reshape(n, m, nsb, 8).sum(axis=3)
    y = (S * (d[:, None, :] * dx[None]).astype(np.float64) - M * (dmin[:, None, :] * dx[None]).astype(np.float64))
    return y.sum(axis=2).T


def test_quantize_sb_matches_numpy():
    x = inputs(7, 768)
    q, dx, xs = kernels.quantize_sb(x)
    nq, ndx, nxs = numpy_quantize(x.numpy())
    assert np.array_equal(q, nq)
    assert np.array_equal(dx.view(np.int32), ndx.view(np.int32))
    assert np.array_equal(xs, nxs)
    assert np.abs(q).max() == 127 and (dx[2, 1] == 0) and not q[2, 256:512].any()


def test_reference_is_the_arithmetic():
    n, k = 37, 768
    raw = random_blocks("Q4_K", n, k, seed=11)
    x = inputs(9, k)
    got = product(raw, k, x, "reference").numpy().astype(np.float64)
    want = numpy_product(raw, k, x)
    assert np.allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # and it is a product: close to the float one (per-256 int8 inputs: ~1% of the output's scale)
    dense = gguf_dense("Q4_K", raw, k)
    f = x.numpy().astype(np.float64) @ dense.T.astype(np.float64)
    assert np.linalg.norm(got - f) / np.linalg.norm(f) < 0.02


def test_repacked_rows_give_the_stored_rows_bits():
    n, k = 20, 512
    raw = random_blocks("Q4_K", n, k, seed=2)
    x = inputs(5, k)
    assert torch.equal(bits(product(raw, k, x, "reference")),
                       bits(product(kernels.repack("Q4_K", raw, k), k, x, "reference", packed=True)))


def test_a_row_does_not_depend_on_the_others():
    n, k = 24, 512
    raw = random_blocks("Q4_K", n, k, seed=4)
    x = inputs(33, k)
    modes = ["reference"] + (["emulated"] if TILES_BUILT else [])
    for mode in modes:
        whole = product(raw, k, x, mode, threads=2)
        for r in (0, 16, 32):
            assert torch.equal(bits(product(raw, k, x[r : r + 1], mode)), bits(whole[r : r + 1])), (mode, r)


def _tiles_equal_reference(mode):
    for k, n in ((256, 16), (768, 37), (1536, 40)):
        raw = random_blocks("Q4_K", n, k, seed=k)
        x = inputs(64, k, seed=n)
        for packed in (False, True):
            w = kernels.repack("Q4_K", raw, k) if packed else raw
            for m in (1, 2, 15, 16, 17, 33, 64):
                ref = product(w, k, x[:m], "reference", packed=packed)
                for threads in (1, 2):
                    got = product(w, k, x[:m], mode, packed=packed, threads=threads)
                    assert torch.equal(bits(got), bits(ref)), (k, n, packed, m, threads)


@EMU
def test_emulated_tiles_equal_reference():
    _tiles_equal_reference("emulated")


@HW
def test_hardware_tiles_equal_reference():
    _tiles_equal_reference("tiles")


@EMU
def test_extremes_stay_exact():
    """every code 15, every scale and minimum 63, inputs at +-127: the largest integer sums"""
    n, k = 16, 512
    raw = random_blocks("Q4_K", n, k, seed=1).reshape(n, k // 256, 144)
    raw[:, :, 4:16] = 0xFF
    raw[:, :, 16:] = 0xFF
    raw = raw.reshape(n, -1)
    x = torch.ones(3, k)
    x[1] = -1
    x[2, ::2] = -1
    ref = product(raw, k, x, "reference")
    assert torch.equal(bits(product(raw, k, x, "emulated", threads=2)), bits(ref))
    want = numpy_product(raw, k, x)
    assert np.allclose(ref.numpy(), want, rtol=1e-6)
    if kernels.amx_usable():
        assert torch.equal(bits(product(raw, k, x, "tiles", threads=2)), bits(ref))


def test_bad_shapes_are_refused():
    raw = random_blocks("Q4_0", 4, 256, seed=1)
    with pytest.raises(ValueError):
        product(raw, 256, torch.randn(2, 256), "reference", type_name="Q4_0")  # another type
    raw = random_blocks("Q4_K", 4, 256, seed=1)
    with pytest.raises(ValueError):
        product(raw, 512, torch.randn(2, 512), "reference")  # rows of 256 elements taken as 512
    if not kernels.amx_usable():
        with pytest.raises(ValueError):
            product(raw, 256, torch.randn(2, 256), "tiles")


def test_every_level_gives_the_same_bits():
    """the reference at every level this CPU runs (the quantizer has its own AVX2 code)"""
    n, k, m = 20, 768, 6
    raw = random_blocks("Q4_K", n, k, seed=8)
    x = inputs(m, k)
    outs = {}
    for name in kernels.cpu_levels():
        h = kernels.load_level(name)
        y = torch.zeros(m, n)
        assert h.tsq_matmul_sb(kernels.TYPE_IDS["Q4_K"], raw.ctypes.data, 0, raw.shape[1], n, k, x.data_ptr(), m, y.data_ptr(), n, 1, 0) == 0
        outs[name] = bits(y)
    first = next(iter(outs.values()))
    for name, y in outs.items():
        assert torch.equal(y, first), name
