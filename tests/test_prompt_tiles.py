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


# ----------------------------------------------------------------------------- the route in a model

ROUTES = ["reference"] + (["emulated"] if TILES_BUILT else [])


@pytest.fixture
def route():
    """switch the route for one test and put it back off"""
    yield kernels.use_prompt_tiles
    kernels.use_prompt_tiles("off")


@pytest.fixture(scope="module")
def q4k_model(tmp_path_factory):
    from tiny import write_tiny_model
    from tsspec.models import load_model

    d = tmp_path_factory.mktemp("prompt_tiles")
    m = load_model(write_tiny_model(d / "q4k.gguf", "qwen2", seed=3, quant="Q4_K", d_model=256, ffn_dim=512,
                                    n_heads=4, n_kv_heads=2, vocab_size=300, ctx=512))
    if m.fused is None:
        pytest.skip("the tiny model runs off the native blocks here")
    return m


PROMPT = [int(t) for t in np.random.default_rng(1).integers(0, 300, 40)]


def last_logits(model, chunks, step=5):
    cache = model.make_cache()
    out = None
    for a, b in chunks:
        out = model.forward(PROMPT[a:b], cache, prompt=True)
    return out.logits[-1].clone(), model.forward([step], cache).logits[-1].clone()


def test_prompt_rows_take_the_route_in_any_chunking(q4k_model, route):
    off = last_logits(q4k_model, [(0, 40)])
    outs = {}
    for mode in ROUTES:
        route(mode)
        outs[mode] = [last_logits(q4k_model, [(0, 40)]), last_logits(q4k_model, [(0, 17), (17, 40)])]
    route("off")
    ref = outs["reference"][0]
    # another arithmetic (so the route really ran), near the default one
    assert not torch.equal(bits(ref[0]), bits(off[0]))
    assert torch.nn.functional.cosine_similarity(ref[0], off[0], 0) > 0.99
    for mode, (whole, chunked) in outs.items():  # every mode, every chunking: the same bits
        for a, b in zip((*whole, *chunked), (*ref, *ref)):
            assert torch.equal(bits(a), bits(b)), mode


@HW
def test_hardware_route_equals_reference_in_a_model(q4k_model, route):
    route("reference")
    ref = last_logits(q4k_model, [(0, 40)])
    route("tiles")
    got = last_logits(q4k_model, [(0, 25), (25, 40)])
    for a, b in zip(got, ref):
        assert torch.equal(bits(a), bits(b))


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
def test_speculative_equals_plain_with_the_route(q4k_model, route, mode):
    from tsspec.sampling import Sampler, SamplingParams
    from tsspec.spec.loop import decode
    from tsspec.spec.ngram import NGramSpeculator
    from tsspec.spec.plan import SpecPlan
    from tsspec.spec.stats import SpecStats

    route(mode)
    prompt = [5, 6, 7, 8, 9] * 6 + PROMPT[:300]
    for sampler in (Sampler(), Sampler(SamplingParams(temperature=0.8, top_k=20, seed=4))):
        want = decode(q4k_model, sampler, prompt, 32)
        stats = SpecStats()
        got = decode(q4k_model, sampler, prompt, 32, SpecPlan(NGramSpeculator(max_draft_tokens=6), window=6),
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
