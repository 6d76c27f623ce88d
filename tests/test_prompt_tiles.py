"""The prompt routes' arithmetic for prompt rows (tsspec/kernels/prompt_tiles.c).

Q4_K and Q6_K products with inputs quantized per 256 elements and one float step per super-block (the
super-block route); Q4_0, Q4_1, Q5_0 and Q8_0 products with one float step per 32-element block (the
32-element route). Three ways
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
# the two tile forms, each where it runs: the emulation (any AVX-512 VBMI build) and the hardware
TILE_FORMS = [pytest.param("emulated", marks=EMU), pytest.param("tiles", marks=HW)]


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


def numpy_codes(x: np.ndarray, block: int):
    """x quantized per ``block`` elements as the kernels do it in numpy: float32 operations, rint (ties to
    even) -> codes [m, k / block, block] (int8), dx [m, k / block]"""
    m, k = x.shape
    v = x.reshape(m, k // block, block).astype(np.float32)
    amax = np.abs(v).max(axis=2)
    with np.errstate(divide="ignore"):
        iscale = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    dx = np.where(amax > 0, amax / np.float32(127), np.float32(0)).astype(np.float32)
    return np.clip(np.rint(v * iscale[:, :, None]), -127, 127).astype(np.int8), dx


def numpy_quantize(x: np.ndarray):
    """quantize_sb as numpy reads it (per 256 elements, and the 32-element code sums)"""
    m, k = x.shape
    q, dx = numpy_codes(x, 256)
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


def q6k_parts(raw: np.ndarray, k: int):
    """the stored Q6_K rows' codes [n, k] (0..63), signed sub-block scales [n, k / 16] and d
    [n, k / 256], read from the bytes as the format defines them: element 128 h + 32 u + i of a
    super-block has ql[64 h + 32 (u % 2) + i]'s low (u < 2) or high nibble, and bits 2u, 2u + 1 of
    qh[32 h + i] above them"""
    n, nsb = raw.shape[0], k // 256
    b = raw.reshape(n, nsb, 210)
    ql = b[:, :, :128].reshape(n, nsb, 2, 2, 32).astype(np.int64)
    qh = b[:, :, 128:192].reshape(n, nsb, 2, 32).astype(np.int64)
    codes = np.empty((n, nsb, 2, 4, 32), np.int64)
    for u in range(4):
        lo = ql[:, :, :, u % 2] & 15 if u < 2 else ql[:, :, :, u % 2] >> 4
        codes[:, :, :, u] = lo | (((qh >> (2 * u)) & 3) << 4)
    sc = b[:, :, 192:208].copy().view(np.int8).astype(np.int64).reshape(n, -1)
    d = b[:, :, 208:210].copy().view(np.float16)[..., 0].astype(np.float32)
    return codes.reshape(n, k), sc, d


def numpy_product_q6k(raw, k, x):
    """Q6_K's arithmetic in numpy: S = sum_j sc_j sum (q - 32) x exactly, float steps in float64"""
    q, dx, _ = numpy_quantize(x.numpy())
    codes, sc, d = q6k_parts(raw, k)
    n, m, nsb = raw.shape[0], x.shape[0], k // 256
    isum = np.einsum("nbe,mbe->nmb", (codes - 32).reshape(n, nsb * 16, 16),
                     q.reshape(m, nsb * 16, 16).astype(np.int64))
    S = (isum * sc[:, None, :]).reshape(n, m, nsb, 16).sum(axis=3)
    return (S * (d[:, None, :] * dx[None]).astype(np.float64)).sum(axis=2).T


def numpy_product(raw, k, x, type_name="Q4_K"):
    """the arithmetic in numpy: exact integer S and M per super-block, the float steps in float64
    (so within a float32 rounding or so of the C result, not bit for bit)"""
    if type_name == "Q6_K":
        return numpy_product_q6k(raw, k, x)
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


KTYPES = ["Q4_K", "Q6_K"]


@pytest.mark.parametrize("type_name", KTYPES)
def test_reference_is_the_arithmetic(type_name):
    n, k = 37, 768
    raw = random_blocks(type_name, n, k, seed=11)
    x = inputs(9, k)
    got = product(raw, k, x, "reference", type_name=type_name).numpy().astype(np.float64)
    want = numpy_product(raw, k, x, type_name)
    assert np.allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # and it is a product: close to the float one (per-256 int8 inputs: ~1% of the output's scale)
    dense = gguf_dense(type_name, raw, k)
    f = x.numpy().astype(np.float64) @ dense.T.astype(np.float64)
    assert np.linalg.norm(got - f) / np.linalg.norm(f) < 0.02


@pytest.mark.parametrize("type_name", KTYPES)
def test_repacked_rows_give_the_stored_rows_bits(type_name):
    n, k = 20, 512
    raw = random_blocks(type_name, n, k, seed=2)
    x = inputs(5, k)
    assert torch.equal(bits(product(raw, k, x, "reference", type_name=type_name)),
                       bits(product(kernels.repack(type_name, raw, k), k, x, "reference", packed=True,
                                    type_name=type_name)))


@pytest.mark.parametrize("type_name", KTYPES)
def test_a_row_does_not_depend_on_the_others(type_name):
    n, k = 24, 512
    raw = random_blocks(type_name, n, k, seed=4)
    x = inputs(33, k)
    modes = ["reference"] + (["emulated"] if TILES_BUILT else [])
    for mode in modes:
        whole = product(raw, k, x, mode, threads=2, type_name=type_name)
        for r in (0, 16, 32):
            alone = product(raw, k, x[r : r + 1], mode, type_name=type_name)
            assert torch.equal(bits(alone), bits(whole[r : r + 1])), (mode, r)


@pytest.mark.parametrize("mode", TILE_FORMS)
@pytest.mark.parametrize("type_name", KTYPES)
def test_tiles_equal_reference(mode, type_name):
    for k, n in ((256, 16), (768, 37), (1536, 40)):
        raw = random_blocks(type_name, n, k, seed=k)
        x = inputs(64, k, seed=n)
        for packed in (False, True):
            w = kernels.repack(type_name, raw, k) if packed else raw
            for m in (1, 2, 15, 16, 17, 33, 64):
                ref = product(w, k, x[:m], "reference", packed=packed, type_name=type_name)
                for threads in (1, 2):
                    got = product(w, k, x[:m], mode, packed=packed, threads=threads, type_name=type_name)
                    assert torch.equal(bits(got), bits(ref)), (k, n, packed, m, threads)


@pytest.mark.parametrize("mode", TILE_FORMS)
@pytest.mark.parametrize("type_name", KTYPES)
def test_grouped_panels_equal_reference(mode, type_name):
    """inputs past L2 (prompt_tiles.c's SB_L2_INPUT, 1 MiB of operands: here 30 input tiles x 9
    super-blocks x 4 KiB), where panels take each input tile in turn, in groups of at most eight as
    even as the threads allow (19 panels: 7, 7, 5 on one thread; 5, 5, 5, 4 on two), the last panel 5
    rows, the last input tile one row"""
    k, n, m = 2304, 293, 465
    assert -(-m // 16) * (k // 256) * 4096 > 1 << 20
    raw = random_blocks(type_name, n, k, seed=11)
    x = inputs(m, k, seed=3)
    ref = product(raw, k, x, "reference", type_name=type_name)
    for threads in (1, 2):
        got = product(raw, k, x, mode, threads=threads, type_name=type_name)
        assert torch.equal(bits(got), bits(ref)), threads


@HW
def test_products_on_several_threads_at_once_keep_their_bits():
    """each calling thread keeps its own block for the input operands (grown as products need, freed
    when the thread ends): three threads at once, sizes growing and shrinking, each equal to the
    reference of its own inputs"""
    import threading

    k, n = 1536, 40
    raw = random_blocks("Q4_K", n, k, seed=2)
    cases = [inputs(m, k, seed=m) for m in (17, 200, 5, 64, 300, 1)]
    refs = [product(raw, k, x, "reference") for x in cases]
    bad = []

    def work(order):
        for i in order:
            for _ in range(3):
                got = product(raw, k, cases[i], "tiles", threads=2)
                if not torch.equal(bits(got), bits(refs[i])):
                    bad.append(i)

    ts = [threading.Thread(target=work, args=(o,)) for o in ([0, 1, 2, 3, 4, 5], [5, 4, 3, 2, 1, 0], [2, 4, 0, 5, 1, 3])]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not bad


@EMU
def test_q6k_extremes_stay_exact():
    """codes 0 and 63 under scales -128 and 127 (element products (q - 32) sc of 4096, -4064, -3968 and
    3937: the split's ends, 128 hi + lo with hi 32 and -32), inputs at +-127: the largest integer sums
    Q6_K's operands make"""
    n, k = 32, 512
    raw = random_blocks("Q6_K", n, k, seed=1).reshape(n, k // 256, 210)
    raw[:16, :, :192] = 0  # every code 0: q - 32 = -32
    raw[16:, :, :192] = 0xFF  # every code 63: 31
    raw[::2, :, 192:208] = np.uint8(0x80)  # -128
    raw[1::2, :, 192:208] = 127
    raw = raw.reshape(n, -1)
    x = torch.ones(3, k)
    x[1] = -1
    x[2, ::2] = -1
    ref = product(raw, k, x, "reference", type_name="Q6_K")
    assert torch.equal(bits(product(raw, k, x, "emulated", threads=2, type_name="Q6_K")), bits(ref))
    assert np.allclose(ref.numpy(), numpy_product(raw, k, x, "Q6_K"), rtol=1e-6)
    if kernels.amx_usable():
        assert torch.equal(bits(product(raw, k, x, "tiles", threads=2, type_name="Q6_K")), bits(ref))


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
    raw = random_blocks("F16", 4, 256, seed=1)
    with pytest.raises(ValueError):
        product(raw, 256, torch.randn(2, 256), "reference", type_name="F16")  # a type neither route takes
    raw = random_blocks("Q5_0", 4, 160, seed=1)
    with pytest.raises(ValueError):  # Q5_0 rows read as Q4_0
        product(raw, 160, torch.randn(2, 160), "reference", type_name="Q4_0")
    raw = random_blocks("Q4_K", 4, 256, seed=1)
    with pytest.raises(ValueError):
        product(raw, 512, torch.randn(2, 512), "reference")  # rows of 256 elements taken as 512
    with pytest.raises(ValueError):
        product(raw, 256, torch.randn(2, 256), "reference", type_name="Q6_K")  # Q4_K rows read as Q6_K
    if not kernels.amx_usable():
        with pytest.raises(ValueError):
            product(raw, 256, torch.randn(2, 256), "tiles")


@pytest.mark.parametrize("type_name", KTYPES + ["Q5_0", "Q4_0", "Q8_0"])
def test_every_level_gives_the_same_bits(type_name):
    """the reference at every level this CPU runs (the quantizer has its own AVX2 code)"""
    n, k, m = 20, 768, 6
    raw = random_blocks(type_name, n, k, seed=8)
    x = inputs(m, k)
    outs = {}
    for name in kernels.cpu_levels():
        h = kernels.load_level(name)
        y = torch.zeros(m, n)
        assert h.tsq_matmul_sb(kernels.TYPE_IDS[type_name], raw.ctypes.data, 0, raw.shape[1], n, k, x.data_ptr(), m,
                               y.data_ptr(), n, 1, 0) == 0
        outs[name] = bits(y)
    first = next(iter(outs.values()))
    for name, y in outs.items():
        assert torch.equal(y, first), name


# ----------------------------------------------------------------------------- the 32-element route

LTYPES = ["Q4_0", "Q4_1", "Q5_0", "Q8_0"]


def legacy_parts(type_name: str, raw: np.ndarray, k: int):
    """the stored rows' signed codes [n, k] (the type's offset off), scales and minimums (Q4_1; else
    zero) [n, k / 32], read from the bytes as the format defines them"""
    n = raw.shape[0]
    bb = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q8_0": 34}[type_name]
    b = raw.reshape(n, k // 32, bb)
    d = b[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    mn = b[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if type_name == "Q4_1" else 0 * d
    if type_name == "Q8_0":
        return b[:, :, 2:].copy().view(np.int8).astype(np.int64).reshape(n, k), d, mn
    qs = b[:, :, bb - 16 :].astype(np.int64)
    codes = np.concatenate([qs & 15, qs >> 4], axis=2)  # element i: low nibble of qs[i], i + 16: high
    if type_name == "Q5_0":
        qh = b[:, :, 2:6].copy().view(np.uint32)[..., 0].astype(np.int64)
        codes = codes | (((qh[:, :, None] >> np.arange(32)) & 1) << 4)
        return (codes - 16).reshape(n, k), d, mn
    return (codes - (8 if type_name == "Q4_0" else 0)).reshape(n, k), d, mn


@pytest.mark.parametrize("type_name", LTYPES)
def test_b32_reference_is_the_arithmetic(type_name):
    """exact integer sums per 32-element block, one float step each (Q4_1: and one for its minimum);
    within float rounding of the shared products (the same sums and inputs, their float steps per 16
    elements); rows of 576 end in a short group"""
    n, k, m = 37, 576, 9
    raw = random_blocks(type_name, n, k, seed=11)
    x = inputs(m, k)
    got = product(raw, k, x, "reference", type_name=type_name).numpy().astype(np.float64)
    codes, d, mn = legacy_parts(type_name, raw, k)
    q, dx = numpy_codes(x.numpy(), 32)  # tsq_quantize's codes
    q = q.astype(np.int64)
    S = np.einsum("nbe,mbe->nmb", codes.reshape(n, k // 32, 32), q)
    X = q.sum(axis=2)  # [m, k / 32]
    want = (S * (d[:, None, :] * dx[None]).astype(np.float64)
            + X[None] * (mn[:, None, :] * dx[None]).astype(np.float64)).sum(axis=2).T
    assert np.allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    shared = torch.empty(m, n)
    kernels.matmul(type_name, raw, k, x, kernels.quantize(x), shared)
    assert np.abs(got - shared.numpy()).max() < 1e-5 * np.abs(want).max()
    assert not torch.equal(bits(torch.from_numpy(got.astype(np.float32))), bits(shared))  # another order


@pytest.mark.parametrize("mode", TILE_FORMS)
@pytest.mark.parametrize("type_name", LTYPES)
def test_b32_tiles_equal_reference(mode, type_name):
    """stored and repacked rows (Q4_0, Q4_1, Q8_0: four-block records; Q5_0: transposed code vectors),
    rows that end in a short group (96, 160, 576: as stored even when repacked), short panels and
    input tiles, 1 and 2 threads"""
    for k, n in ((128, 16), (96, 17), (160, 20), (576, 37), (896, 40)):
        raw = random_blocks(type_name, n, k, seed=k)
        x = inputs(64, k, seed=n)
        ref = product(raw, k, x, "reference", type_name=type_name)
        for packed in (False, True):
            w = kernels.repack(type_name, raw, k) if packed else raw
            for m in (1, 2, 15, 16, 17, 33, 64):
                for threads in (1, 2):
                    got = product(w, k, x[:m], mode, packed=packed, threads=threads, type_name=type_name)
                    assert torch.equal(bits(got), bits(ref[:m])), (k, n, packed, m, threads)


@pytest.mark.parametrize("type_name", LTYPES)
def test_b32_a_row_does_not_depend_on_the_others(type_name):
    n, k = 24, 384
    raw = kernels.repack(type_name, random_blocks(type_name, n, k, seed=4), k)
    x = inputs(33, k)
    for mode in ["reference"] + (["emulated"] if TILES_BUILT else []):
        whole = product(raw, k, x, mode, packed=True, threads=2, type_name=type_name)
        for r in (0, 16, 32):
            alone = product(raw, k, x[r : r + 1], mode, packed=True, type_name=type_name)
            assert torch.equal(bits(alone), bits(whole[r : r + 1])), (mode, r)


@EMU
def test_b32_extremes_stay_exact():
    """Q8_0 codes -128 and 127 against inputs at +-127: the largest sums a block makes"""
    n, k = 32, 256
    raw = random_blocks("Q8_0", n, k, seed=1).reshape(n, k // 32, 34)
    raw[:16, :, 2:] = 0x80
    raw[16:, :, 2:] = 0x7F
    raw = raw.reshape(n, -1)
    x = torch.ones(3, k)
    x[1] = -1
    x[2, ::2] = -1
    ref = product(raw, k, x, "reference", type_name="Q8_0")
    codes, d, _ = legacy_parts("Q8_0", raw, k)
    q = (127 * x.numpy()).astype(np.int64).reshape(3, k // 32, 32)  # inputs at +-1: codes +-127, dx 1/127
    S = np.einsum("nbe,mbe->nmb", codes.reshape(n, k // 32, 32), q)
    want = (S * (d[:, None, :] * (np.float32(1) / np.float32(127))).astype(np.float64)).sum(axis=2).T
    assert np.allclose(ref.numpy(), want, rtol=1e-6)
    for packed in (False, True):
        w = kernels.repack("Q8_0", raw, k) if packed else raw
        assert torch.equal(bits(product(w, k, x, "emulated", packed=packed, threads=2, type_name="Q8_0")), bits(ref))
        if kernels.amx_usable():
            assert torch.equal(bits(product(w, k, x, "tiles", packed=packed, threads=2, type_name="Q8_0")), bits(ref))


# ----------------------------------------------------------------------------- the route in a model

ROUTES = ["reference"] + (["emulated"] if TILES_BUILT else [])


@pytest.fixture
def route():
    """switch the route for one test and put it back off"""
    yield kernels.use_prompt_tiles
    kernels.use_prompt_tiles("off")


_MODELS: dict = {}


def _tiny(quant, tmp_path_factory):
    from tiny import write_tiny_model
    from tsspec.models import load_model

    if quant not in _MODELS:
        d = tmp_path_factory.mktemp("prompt_tiles")
        _MODELS[quant] = load_model(write_tiny_model(d / f"{quant}.gguf", "qwen2", seed=3, quant=quant, d_model=256,
                                                     ffn_dim=512, n_heads=4, n_kv_heads=2, vocab_size=300, ctx=512))
    if _MODELS[quant].fused is None:
        pytest.skip("the tiny model runs off the native blocks here")
    return _MODELS[quant]


@pytest.fixture(scope="module")
def q4k_model(tmp_path_factory):
    return _tiny("Q4_K", tmp_path_factory)


@pytest.fixture(scope="module", params=KTYPES + ["Q5_0", "Q8_0", "Q4_1"])
def k_model(request, tmp_path_factory):
    """a tiny model whose every matrix is Q4_K, then Q6_K (the super-block route), then Q5_0, Q8_0, Q4_1
    (the 32-element route)"""
    return _tiny(request.param, tmp_path_factory)


PROMPT = [int(t) for t in np.random.default_rng(1).integers(0, 300, 40)]


def last_logits(model, chunks, step=5):
    cache = model.make_cache()
    out = None
    for a, b in chunks:
        out = model.forward(PROMPT[a:b], cache, prompt=True)
    return out.logits[-1].clone(), model.forward([step], cache).logits[-1].clone()


def test_prompt_rows_take_the_route_in_any_chunking(k_model, route):
    off = last_logits(k_model, [(0, 40)])
    outs = {}
    for mode in ROUTES:
        route(mode)
        outs[mode] = [last_logits(k_model, [(0, 40)]), last_logits(k_model, [(0, 17), (17, 40)])]
    route("off")
    ref = outs["reference"][0]
    # another arithmetic (so the route really ran), near the default one
    assert not torch.equal(bits(ref[0]), bits(off[0]))
    assert torch.nn.functional.cosine_similarity(ref[0], off[0], 0) > 0.99
    for mode, (whole, chunked) in outs.items():  # every mode, every chunking: the same bits
        for a, b in zip((*whole, *chunked), (*ref, *ref)):
            assert torch.equal(bits(a), bits(b)), mode


@HW
def test_hardware_route_equals_reference_in_a_model(k_model, route):
    route("reference")
    ref = last_logits(k_model, [(0, 40)])
    route("tiles")
    got = last_logits(k_model, [(0, 25), (25, 40)])
    for a, b in zip(got, ref):
        assert torch.equal(bits(a), bits(b))


def test_the_route_takes_only_the_types_asked(k_model, route):
    """with the routes set to Q4_K only, every other model's prompt rows keep the default bits (and a
    Q4_K model's still take the route); the types come back"""
    off = last_logits(k_model, [(0, 40)])
    route("reference")
    on = last_logits(k_model, [(0, 40)])
    every = list(kernels.PROMPT_ROUTE_TYPES)
    assert kernels.prompt_tiles_types(["Q4_K"]) == every
    try:
        only = last_logits(k_model, [(0, 40)])
    finally:
        assert kernels.prompt_tiles_types(every) == ["Q4_K"]
    q4k = k_model.path.name.startswith("Q4_K")
    assert torch.equal(bits(only[0]), bits((on if q4k else off)[0]))
    assert not torch.equal(bits(on[0]), bits(off[0]))
    with pytest.raises(ValueError, match="F16"):
        kernels.prompt_tiles_types(["F16"])


def test_generated_rows_keep_the_default_arithmetic(q4k_model, route):
    """a row forwarded without the prompt mark is the same bits whether the route is on or off"""
    outs = []
    for mode in ("off", ROUTES[-1]):
        route(mode)
        cache = q4k_model.make_cache()
        q4k_model.forward(PROMPT[:10], cache)  # unmarked: not prompt rows
        outs.append(q4k_model.forward(PROMPT[10:14], cache, all_logits=True).logits.clone())
    assert torch.equal(bits(outs[0]), bits(outs[1]))


def test_a_batch_of_prompt_and_generated_rows(q4k_model, route):
    """one forward carrying one sequence's prompt chunk and another's verify rows gives each the bits
    of its own forward"""
    from tsspec.models.protocols import ForwardItem

    route(ROUTES[-1])
    c1, c2 = q4k_model.make_cache(), q4k_model.make_cache()
    q4k_model.forward(PROMPT[:8], c2, prompt=True)
    outs = q4k_model.forward_batch([ForwardItem(PROMPT[:20], c1, True, None, prompt=True),
                                    ForwardItem(PROMPT[8:12], c2, True)])
    a1, a2 = q4k_model.make_cache(), q4k_model.make_cache()
    alone1 = q4k_model.forward(PROMPT[:20], a1, all_logits=True, prompt=True).logits
    q4k_model.forward(PROMPT[:8], a2, prompt=True)
    alone2 = q4k_model.forward(PROMPT[8:12], a2, all_logits=True).logits
    assert torch.equal(bits(outs[0].logits), bits(alone1))
    assert torch.equal(bits(outs[1].logits), bits(alone2))


@pytest.mark.parametrize("mode", ROUTES)
def test_speculative_equals_plain_with_the_route(k_model, route, mode):
    from tsspec.sampling import Sampler, SamplingParams
    from tsspec.spec.loop import decode
    from tsspec.spec.ngram import NGramSpeculator
    from tsspec.spec.plan import SpecPlan
    from tsspec.spec.stats import SpecStats

    route(mode)
    prompt = [5, 6, 7, 8, 9] * 6 + PROMPT[:300]
    for sampler in (Sampler(), Sampler(SamplingParams(temperature=0.8, top_k=20, seed=4))):
        want = decode(k_model, sampler, prompt, 32)
        stats = SpecStats()
        got = decode(k_model, sampler, prompt, 32, SpecPlan(NGramSpeculator(max_draft_tokens=6), window=6),
                     stats=stats)
        assert got == want
        assert stats.drafted > 0


def test_kept_caches_offer_prompt_rows_only_while_the_route_is_on(q4k_model, route):
    from tsspec.prefix_cache import PrefixCache

    pool = PrefixCache(q4k_model.make_cache)
    cache = q4k_model.make_cache()
    q4k_model.forward(PROMPT[:30], cache, prompt=True)
    pool.give(PROMPT[:30], cache, prompt_len=20)
    assert len(next(iter(pool.entries.values()))[0]) == 30  # off: every row is made alike
    route("reference")
    pool.give(PROMPT[:30], cache, prompt_len=20)
    assert len(list(pool.entries.values())[-1][0]) == 20
    assert pool.take(PROMPT[:30])[1] == 20


def test_a_bad_switch_is_one_line(tmp_path):
    import os
    import subprocess
    import sys

    from tiny import write_tiny_model

    path = write_tiny_model(tmp_path / "m.gguf", "llama", quant="Q4_0", d_model=64, ffn_dim=128, vocab_size=320)
    env = {**os.environ, "TSSPEC_CACHE": os.environ.get("TSSPEC_CACHE", str(tmp_path / "cache"))}
    for extra, want in (({"TSSPEC_PROMPT_TILES": "often"}, "TSSPEC_PROMPT_TILES='often': expected 0 or 1"),
                        ({"TSSPEC_PROMPT_TILES": "1", "TSSPEC_AMX": "0"},
                         "TSSPEC_PROMPT_TILES=1: TSSPEC_AMX=0 forbids the tiles")):
        r = subprocess.run([sys.executable, "-m", "tsspec", "generate", "-m", str(path), "-p", "hi", "-n", "2"],
                           capture_output=True, text=True, env={**env, **extra}, timeout=300)
        assert r.returncode != 0 and want in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


@HW
def test_the_switch_through_the_cli(tmp_path):
    """TSSPEC_PROMPT_TILES=1 on a 600-token prompt on two threads: plain and n-gram speculation give
    the same tokens (the plain run on the lean path, the speculative one on the model), and
    ``tsspec info`` says the route is on"""
    import json
    import os
    import subprocess
    import sys

    from tiny import write_tiny_model

    path = write_tiny_model(tmp_path / "m.gguf", "qwen2", quant="Q4_K", d_model=256, ffn_dim=512, vocab_size=320,
                            ctx=1024)
    prompt = tmp_path / "p.txt"
    prompt.write_text(" ".join(f"w{i % 97}" for i in range(300)))
    env = {**os.environ, "TSSPEC_CACHE": os.environ.get("TSSPEC_CACHE", str(tmp_path / "cache")),
           "TSSPEC_PROMPT_TILES": "1", "OMP_NUM_THREADS": "2"}
    outs = []
    for spec in ([], ["--spec", "--spec-type", "ngram"]):
        r = subprocess.run([sys.executable, "-m", "tsspec", "generate", "-m", str(path), "-f", str(prompt), "-n", "24",
                            "--json", *spec], capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["prompt_tokens"] >= 600
        outs.append(out["token_ids"])
    assert outs[0] == outs[1] and len(outs[0]) == 24
    r = subprocess.run([sys.executable, "-m", "tsspec", "info", str(path), "--no-load"], capture_output=True, text=True,
                       env={**env, "COLUMNS": "400"}, timeout=300)  # the table's line unwrapped
    assert "prompt rows: on the AMX tiles" in r.stdout, r.stdout


def test_prefill_chunks_follow_the_route(route):
    from tsspec.spec.run import PREFILL_CHUNK, TILE_PREFILL_CHUNK, prefill_chunk

    assert prefill_chunk() == PREFILL_CHUNK
    route("reference")
    assert prefill_chunk() == TILE_PREFILL_CHUNK > PREFILL_CHUNK


def test_a_prompt_chunk_beside_a_token_tree(q4k_model, route):
    """a sequence's prompt chunk sharing a forward with another's token tree keeps its prompt rows'
    bits (the server's case with --spec-tree)"""
    from tsspec.models.protocols import ForwardItem

    route(ROUTES[-1])
    c1, c2 = q4k_model.make_cache(), q4k_model.make_cache()
    q4k_model.forward(PROMPT[:8], c2, prompt=True)
    tree = ForwardItem([7, 8, 9, 10], c2, True, None, [-1, 0, 0, 1])
    outs = q4k_model.forward_batch([ForwardItem(PROMPT[:20], c1, True, None, prompt=True), tree])
    alone = q4k_model.forward(PROMPT[:20], q4k_model.make_cache(), all_logits=True, prompt=True).logits
    assert torch.equal(bits(outs[0].logits), bits(alone))


@EMU
def test_the_load_time_self_check_runs_here():
    """the check TSSPEC_PROMPT_TILES=1 runs at load, through the emulation on any CPU with the tile
    form (on AMX, the hardware too), so its own code is run where the route is never switched on"""
    assert kernels.prompt_tiles_self_check(kernels.lib(), hardware=False) is None
    if kernels.amx_usable():
        assert kernels.prompt_tiles_self_check(kernels.lib()) is None


@pytest.mark.parametrize("mode", ROUTES)
def test_a_draft_models_catch_up_takes_the_route(q4k_model, route, mode, tmp_path_factory):
    """A draft model's forwards of ROUTE_ROWS rows or more (its catch-up over the prompt) are marked as
    prompt rows, its shorter ones not; the trunk's text stays plain's, greedy and seeded, while the
    drafter's catch-up runs on the route (its rows never reach the output)."""
    from tsspec.sampling import Sampler, SamplingParams
    from tsspec.spec import draft_model as dm
    from tsspec.spec.loop import decode
    from tsspec.spec.plan import SpecPlan
    from tsspec.spec.stats import SpecStats

    drafter = _tiny("Q6_K", tmp_path_factory)
    route(mode)
    prompt = PROMPT[:30] + PROMPT[:30]
    marks: list[tuple[int, bool]] = []
    real = drafter.forward

    def spy(tokens, cache, **kw):
        marks.append((len(tokens), kw.get("prompt", False)))
        return real(tokens, cache, **kw)

    drafter.forward = spy
    try:
        for sampler in (Sampler(), Sampler(SamplingParams(temperature=0.8, top_k=20, seed=4))):
            want = decode(q4k_model, sampler, prompt, 24)
            spec = dm.DraftModelSpeculator(drafter, vocab_size=300, max_draft_tokens=4)
            stats = SpecStats()
            assert decode(q4k_model, sampler, prompt, 24, SpecPlan(spec, window=4), stats=stats) == want
            assert stats.drafted > 0
    finally:
        del drafter.forward
    assert marks and all(p == (n >= dm.ROUTE_ROWS) for n, p in marks)
    assert any(p for _, p in marks) and any(not p for _, p in marks)
