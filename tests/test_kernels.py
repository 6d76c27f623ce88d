"""The native GGUF kernels (tsspec/kernels/products.c) against plain references.

* dequantization of every supported type equals gguf-py's, bit for bit (random blocks);
* the AVX-512 product equals the plain C reference bit for bit, and both equal a float64
  product of gguf-py's dequantized weights with the quantized input;
* batch invariance: a row's result is the same bits for 1..17, 33 and 65 rows, at 1 and 2 threads;
* weights repacked for the products (code bits transposed per group; Q4_0/Q4_1/Q8_0 groups as
  scales-first records) give the same bits, and ``unpack`` restores the file's bytes;
* the fused block forward agrees with the torch block path on the same weights, and N rows equal
  N single steps bitwise through it;
* without a compiler the library reports why, and models fall back to the torch formats.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from tiny import write_tiny_model
from tsspec import kernels
from tsspec.models import load_model
from tsspec.models.runners import TorchRunner
from tsspec.models.base import rms_norm

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"native kernels: {kernels.unavailable_reason()}")

QUANT_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"]
FLOAT_TYPES = ["F32", "F16", "BF16"]
# byte offsets of the f16 scale fields inside one block (random bytes there could be inf/nan)
F16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q8_0": [0], "Q4_K": [0, 2], "Q6_K": [208]}


def fresh_kernels(monkeypatch) -> None:
    """Make the next ``kernels.lib()`` load the library afresh (TSSPEC_* read again), and put ALL of
    the loader's state back afterwards: with ``_level`` left as a forced level had set it, a later
    test in the same process read "avx2" beside the AVX-512 library in use (an AVX-512 machine
    only: on an AVX2 one the forced level is the best one)."""
    for name in ("_tried", "_lib", "_reason", "_amx_error", "_level", "_openmp", "_amx"):
        monkeypatch.setattr(kernels, name, getattr(kernels, name))
    monkeypatch.setattr(kernels, "_skipped", [])
    kernels._tried, kernels._lib, kernels._reason, kernels._amx_error, kernels._level = False, None, None, None, None


def tiles_as_loaded() -> None:
    """The AMX tile routing back as TSSPEC_AMX set it when the library loaded (after a test that
    switched the tiles, real or emulated, on or off)."""
    kernels.use_tiles(1 if kernels.amx_status() == "in use" else 0)


def random_blocks(type_name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """A random weight [n, row_bytes] of a GGUF type with sane scales (uint8)."""
    rng = np.random.default_rng(seed)
    if type_name in FLOAT_TYPES:
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        if type_name == "F32":
            return w.view(np.uint8).reshape(n, -1)
        if type_name == "F16":
            return w.astype(np.float16).view(np.uint8).reshape(n, -1)
        return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(n, -1)
    qt = GGMLQuantizationType[type_name]
    elems, nbytes = GGML_QUANT_SIZES[qt]
    blocks = rng.integers(0, 256, size=(n * k // elems, nbytes), dtype=np.uint8)
    for off in F16_FIELDS[type_name]:
        scale = (rng.random(len(blocks)) * 0.01 + 1e-4).astype(np.float16)
        if type_name in ("Q4_1",) and off == 2:
            scale = -scale  # the min is typically negative
        blocks[:, off : off + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


def gguf_dense(type_name: str, raw: np.ndarray, k: int) -> np.ndarray:
    if type_name == "F32":
        return raw.view(np.float32).reshape(raw.shape[0], k)
    if type_name == "F16":
        return raw.view(np.float16).astype(np.float32).reshape(raw.shape[0], k)
    if type_name == "BF16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(raw.shape[0], k)
    return np.asarray(dequantize(raw.reshape(-1), GGMLQuantizationType[type_name]), np.float32).reshape(-1, k)


def quantized_input(x: torch.Tensor, block: int = 32, qmax: int = 127) -> np.ndarray:
    """x as the kernels quantize it (per ``block``: d * q, |q| <= qmax), float64, to build the exact
    reference."""
    xb = x.double().reshape(x.shape[0], -1, block)
    amax = xb.abs().amax(-1, keepdim=True)
    d = (amax.float() / qmax).double()
    iscale = torch.where(amax > 0, qmax / amax.float(), torch.zeros_like(amax.float())).double()
    q = torch.clamp(torch.round((xb.float() * iscale.float()).double()), -qmax, qmax)
    return (q * d).reshape(x.shape).numpy()


@pytest.mark.parametrize("type_name", QUANT_TYPES + FLOAT_TYPES)
def test_dequantization_equals_gguf_py(type_name):
    k = 512
    raw = random_blocks(type_name, 48, k, seed=1)
    ours = kernels.dequant_rows(type_name, raw, k, range(48)).numpy()
    np.testing.assert_array_equal(ours, gguf_dense(type_name, raw, k))
    pick = [7, 0, 47, 7]
    np.testing.assert_array_equal(kernels.dequant_rows(type_name, raw, k, pick).numpy(), ours[pick])
    if type_name not in FLOAT_TYPES:  # rows of a repacked copy (a tied head's embedding) read the same
        packed = kernels.repack(type_name, raw, k)
        np.testing.assert_array_equal(kernels.dequant_rows(type_name, packed, k, pick, packed=True).numpy(), ours[pick])


@pytest.mark.parametrize("type_name", QUANT_TYPES + FLOAT_TYPES)
def test_product_matches_references(type_name):
    n, k, m = 96, 768, 5
    raw = random_blocks(type_name, n, k, seed=2)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3)) * 2
    kind = type_name not in FLOAT_TYPES
    xq = kernels.quantize(x) if kind else None
    fast, ref = torch.zeros(m, n), torch.zeros(m, n)
    kernels.matmul(type_name, raw, k, x, xq, fast)
    kernels.matmul(type_name, raw, k, x, xq, ref, use_simd=False)
    w = gguf_dense(type_name, raw, k).astype(np.float64)
    xin = x.double().numpy() if kind == 0 else quantized_input(x)
    exact = torch.from_numpy(xin @ w.T)
    scale = float(torch.from_numpy(np.abs(xin) @ np.abs(w).T).max())
    assert float((ref.double() - exact).abs().max()) <= 1e-5 * scale
    assert float((fast.double() - exact).abs().max()) <= 1e-5 * scale
    # the quantization is what costs accuracy: against the unquantized product the error is larger
    if kind:
        plain = x.double() @ torch.from_numpy(w).T
        assert float((fast.double() - plain).abs().max()) <= 0.02 * scale


@pytest.mark.parametrize("type_name,packed", [(t, False) for t in QUANT_TYPES + ["F16"]] + [(t, True) for t in QUANT_TYPES],
                         ids=lambda v: {False: "stored", True: "repacked"}.get(v, v) if isinstance(v, bool) else v)
def test_product_is_batch_invariant(type_name, packed):
    """1..17, 33 and 65 rows (one tile up to 8 on these 512-wide rows, then 8-row tiles in weight
    blocks) give each row its single-row bits; the repacked layout is what models run."""
    n, k = 80, 512
    kind = type_name not in FLOAT_TYPES
    raw = random_blocks(type_name, n, k, seed=4)
    if packed:
        raw = kernels.repack(type_name, raw, k)
    x = torch.randn(65, k, generator=torch.Generator().manual_seed(5))
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            singles = torch.zeros(65, n)
            for i in range(65):
                xi = x[i : i + 1].contiguous()
                kernels.matmul(type_name, raw, k, xi, kernels.quantize(xi) if kind else None, singles[i : i + 1], packed=packed)
            for rows in [*range(1, 18), 33, 65]:
                xr = x[:rows].contiguous()
                y = torch.zeros(rows, n)
                kernels.matmul(type_name, raw, k, xr, kernels.quantize(xr) if kind else None, y, packed=packed)
                assert torch.equal(y, singles[:rows]), f"{type_name}: {rows} rows at {threads} threads"
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("type_name", QUANT_TYPES)
def test_long_rows_blocked_and_chunked_are_batch_invariant(type_name):
    """Past one tile of rows the product runs in blocks of weight rows, and a tile too long for L1
    in k-chunks with its accumulators parked: 4096 inputs and 130 weight rows take both paths
    (several blocks, several chunks) and must still give every row its single-row bits."""
    n, k = 130, 4096
    raw = kernels.repack(type_name, random_blocks(type_name, n, k, seed=11), k)
    x = torch.randn(33, k, generator=torch.Generator().manual_seed(12))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        singles = torch.zeros(33, n)
        for i in range(33):
            xi = x[i : i + 1].contiguous()
            kernels.matmul(type_name, raw, k, xi, kernels.quantize(xi), singles[i : i + 1], packed=True)
        for rows in (5, 8, 9, 17, 33):
            xr = x[:rows].contiguous()
            y = torch.zeros(rows, n)
            kernels.matmul(type_name, raw, k, xr, kernels.quantize(xr), y, packed=True)
            assert torch.equal(y, singles[:rows]), f"{type_name}: {rows} rows"
        ref = torch.zeros(9, n)
        kernels.matmul(type_name, raw, k, x[:9].contiguous(), kernels.quantize(x[:9].contiguous()), ref,
                       packed=True, use_simd=False)
        assert torch.equal(ref, singles[:9])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("type_name", QUANT_TYPES)
@pytest.mark.parametrize("k", [512, 576, 864])
def test_repacked_weights_give_the_same_bits(type_name, k):
    """``repack`` permutes code bits only: products of packed rows equal the stored rows' bit for bit
    (SIMD and reference), a short last group (576 = 4.5 groups) included; ``unpack`` restores."""
    if k % 256 and type_name in ("Q4_K", "Q6_K"):
        k = 768
    n = 40
    raw = random_blocks(type_name, n, k, seed=7)
    packed = kernels.repack(type_name, raw, k)
    if k >= 128:
        assert not np.array_equal(packed, raw)  # something moved
    np.testing.assert_array_equal(kernels.unpack(type_name, packed, k), raw)
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(8))
    xq = kernels.quantize(x)
    for use_simd in (True, False):
        plain, fast = torch.zeros(6, n), torch.zeros(6, n)
        kernels.matmul(type_name, raw, k, x, xq, plain, use_simd=use_simd)
        kernels.matmul(type_name, packed, k, x, xq, fast, packed=True, use_simd=use_simd)
        assert torch.equal(plain, fast), f"{type_name} k={k} simd={use_simd}"


def test_a_repack_is_the_same_at_any_thread_count_and_one_thread_off_the_main_thread():
    """``repack``/``unpack`` take an explicit thread count (same bytes at 1, 2 and 3 threads); by
    default torch's count on the main thread and one on any other (the loader's layer pool: each of
    its threads opened a machine-wide OpenMP team, 74 threads at once on 8 cores)."""
    import threading

    raw = random_blocks("Q4_K", 101, 768, seed=3)
    one = kernels.repack("Q4_K", raw, 768, threads=1)
    for nt in (2, 3):
        np.testing.assert_array_equal(kernels.repack("Q4_K", raw, 768, threads=nt), one)
        np.testing.assert_array_equal(kernels.unpack("Q4_K", one, 768, threads=nt), raw)
    with pytest.raises(ValueError, match="threads must be >= 1"):
        kernels.repack("Q4_K", raw, 768, threads=0)
    assert kernels.repack_threads() == torch.get_num_threads()
    seen = []
    t = threading.Thread(target=lambda: seen.append(kernels.repack_threads()))
    t.start()
    t.join()
    assert seen == [1]


def test_loading_in_the_layer_pool_opens_no_team_per_layer_thread(tmp_path):
    """Loading with --threads 4 and OMP_NUM_THREADS=4: the pool's threads repack on their own, so the
    process never holds more than a few threads beyond the pool (it held 4 x 4 and more)."""
    import subprocess
    import sys
    import textwrap

    path = write_tiny_model(tmp_path / "m.gguf", "llama", quant="Q4_0", d_model=256, ffn_dim=512, vocab_size=320,
                            n_layers=8)
    code = textwrap.dedent(f"""
        import os, threading, time, torch
        torch.set_num_threads(4)
        from tsspec.models import load_model
        peak, stop = [0], [False]
        def watch():
            while not stop[0]:
                peak[0] = max(peak[0], len(os.listdir("/proc/self/task")))
                time.sleep(0.0002)
        w = threading.Thread(target=watch, daemon=True)
        w.start()
        before = len(os.listdir("/proc/self/task"))
        for _ in range(3):
            load_model({str(path)!r})
        stop[0] = True
        w.join()
        print(before, peak[0])
    """)
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "4"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    before, peak = map(int, r.stdout.split())
    # the pool's 4 threads, the main thread's OpenMP team (3 more) and slack for torch's own
    assert peak - before <= 4 + 3 + 2, (before, peak)


@pytest.mark.parametrize("type_name", QUANT_TYPES)
@pytest.mark.parametrize("k", [96, 576, 608])
def test_lone_row_pairs_weight_rows_bitwise(type_name, k):
    """A lone input row takes weight rows two to a 512-bit register (the record types): each lane
    must still do the reference's steps, a short last group (576, 608, 96 < one group) and an odd
    row at the end of a thread's share (97 rows) included, at one thread and two."""
    if k % 256 and type_name in ("Q4_K", "Q6_K"):
        k = 768
    n = 97
    raw = kernels.repack(type_name, random_blocks(type_name, n, k, seed=13), k)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(14))
    xq = kernels.quantize(x)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            together = torch.zeros(3, n)
            kernels.matmul(type_name, raw, k, x, xq, together, packed=True)
            for i in range(3):
                xi = x[i : i + 1].contiguous()
                fast, ref = torch.zeros(1, n), torch.zeros(1, n)
                kernels.matmul(type_name, raw, k, xi, kernels.quantize(xi), fast, packed=True)
                kernels.matmul(type_name, raw, k, xi, kernels.quantize(xi), ref, packed=True, use_simd=False)
                assert torch.equal(fast, ref), f"{type_name} k={k} row {i} at {threads} threads"
                assert torch.equal(fast[0], together[i])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("type_name", QUANT_TYPES)
def test_simd_equals_reference_bitwise(type_name):
    """The reference performs the SIMD path's float steps lane by lane, so the two agree exactly."""
    n, k = 33, 1024 if type_name in ("Q4_K", "Q6_K") else 608
    raw = random_blocks(type_name, n, k, seed=9)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(10))
    xq = kernels.quantize(x)
    fast, ref = torch.zeros(5, n), torch.zeros(5, n)
    kernels.matmul(type_name, raw, k, x, xq, fast)
    kernels.matmul(type_name, raw, k, x, xq, ref, use_simd=False)
    assert torch.equal(fast, ref)


@pytest.mark.parametrize("gelu", [0, 1])
def test_activation_lanes_equal_the_element_by_element_form(gelu):
    """tsq_act_row takes eight lanes at a time (AVX2 and up), then the rest one element at a time with
    the same operations: at every level this CPU runs, each element's bits equal that element alone
    (n = 1, the scalar form), over tanh's two branches (|z| < 0.625), exp's clamps and signed zeros.
    (Sixteen lanes on AVX-512 were tried, same bits: no faster, the division bounds it.)"""
    g = torch.cat([torch.linspace(-120, 120, 2001), torch.randn(997, generator=torch.Generator().manual_seed(4)) * 4,
                   torch.tensor([0.0, -0.0, 0.62, -0.62, 0.63, 1e-30, -1e30, 88.5, -88.5])]).contiguous()
    u = (torch.randn(g.numel(), generator=torch.Generator().manual_seed(5)) * 3).contiguous()
    n = g.numel()
    assert n % 8  # both forms of the row take part
    first = None
    for name in kernels.cpu_levels():
        h = kernels.load_level(name)
        row, alone = torch.empty(n), torch.empty(n)
        h.tsq_act_row(gelu, g.data_ptr(), u.data_ptr(), row.data_ptr(), n)
        for i in range(n):
            h.tsq_act_row(gelu, g.data_ptr() + 4 * i, u.data_ptr() + 4 * i, alone.data_ptr() + 4 * i, 1)
        assert torch.equal(row.view(torch.int32), alone.view(torch.int32)), name
        first = row if first is None else first
        assert torch.equal(row.view(torch.int32), first.view(torch.int32)), name
    ref = torch.nn.functional.gelu(g, approximate="tanh") if gelu else torch.nn.functional.silu(g)
    assert torch.allclose(first, ref * u, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- fused blocks


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "gemma3"])
def tiny_q(request, tmp_path_factory):
    arch = request.param
    path = write_tiny_model(tmp_path_factory.mktemp("kq") / f"{arch}.gguf", arch, quant="Q4_0",
                            d_model=64, ffn_dim=128, vocab_size=320)
    return arch, path


def test_fused_forward_matches_torch_blocks(tiny_q):
    arch, path = tiny_q
    m = load_model(path, n_ctx=256)
    assert m.fused is not None, arch
    ids = [int(t) for t in np.random.default_rng(0).integers(0, 300, size=40)]
    fused = m.forward(ids, m.make_cache(), all_logits=True, taps=[1, m.n_layers]).logits
    c = m.make_cache()
    keep, m.runner = m.runner, TorchRunner()
    ref = m.forward(ids, c, all_logits=True).logits
    m.runner = keep
    scale = float(ref.abs().max())
    # int8 inputs: the two paths round a few inputs differently, nothing more
    assert float((fused - ref).abs().max()) <= 0.05 * scale, arch
    assert float((fused.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.9


def test_native_output_matches_torch_norm_and_head(tiny_q):
    """The fused path's final norm and LM head (one native call) against torch's norm and the
    head's own product: the same weights and input quantization, so only the norm's rounding
    (a double sum natively) separates them; every row alone gives the bits it gives among others."""
    arch, path = tiny_q
    m = load_model(path, n_ctx=256)
    out = m.fused.output
    assert out is not None, arch
    h = torch.randn(7, m.hidden_size, generator=torch.Generator().manual_seed(21))
    native = out(h)
    ref = m.lm_head(rms_norm(h, m.out_norm, m.cfg.rms_eps))
    assert native.shape == ref.shape
    # measured ~2e-7 of the largest logit; a norm weight off by 1% moves them by 1e-2
    assert float((native - ref).abs().max()) <= 1e-3 * float(ref.abs().max()), arch
    for i in range(7):
        assert torch.equal(out(h[i : i + 1]), native[i : i + 1]), f"{arch} row {i}"


def test_fused_rows_equal_single_steps(tiny_q):
    arch, path = tiny_q
    m = load_model(path, n_ctx=256)
    ids = [int(t) for t in np.random.default_rng(1).integers(0, 300, size=90)]
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            c = m.make_cache()
            m.forward(ids[:10], c)
            full = m.forward(ids[10:90], c, all_logits=True, taps=[0, 1]).logits
            c.trim(c.length - 10)
            for i in range(10, 90):
                assert torch.equal(m.forward([ids[i]], c).logits[0], full[i - 10]), f"{arch} row {i} at {threads}"
            c.trim(c.length - 10)
            for i in range(10, 90, 9):
                chunk = m.forward(ids[i : i + 9], c, all_logits=True).logits
                assert torch.equal(chunk, full[i - 10 : i - 10 + chunk.shape[0]])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("head_dim,n_heads,n_kv", [(64, 4, 2), (40, 4, 2), (12, 8, 2), (64, 12, 2), (32, 9, 3),
                                                   (16, 8, 1), (64, 4, 1)])
def test_fused_attention_head_dims(tmp_path, head_dim, n_heads, n_kv):
    """The attention's register paths by head dimension: 64 outputs at a time (64), 32 then 8 (40),
    and the plain path (12, not a multiple of 8); and by query heads per KV head (1 to 8), which the
    SIMD code takes several at a time, fewer at once where a lone row must still give both threads
    work (4 heads on one KV head: 4 at once in the prompt, 2 for a lone row): close to torch's
    blocks, rows bitwise alone. The prompt's rows attend in blocks of rows, over 100 positions: more
    than one block of positions for the value sums, parked between them."""
    path = write_tiny_model(tmp_path / "m.gguf", "llama", quant="Q4_0", d_model=64, ffn_dim=128, vocab_size=320,
                            n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim)
    m = load_model(path, n_ctx=256)
    assert m.fused is not None
    ids = [int(t) for t in np.random.default_rng(2).integers(0, 300, size=100)]
    fused = m.forward(ids, m.make_cache(), all_logits=True).logits
    keep, m.runner = m.runner, TorchRunner()
    ref = m.forward(ids, m.make_cache(), all_logits=True).logits
    m.runner = keep
    assert float((fused - ref).abs().max()) <= 0.05 * float(ref.abs().max())
    c = m.make_cache()
    m.forward(ids[:30], c)
    for i in range(30, 100):
        assert torch.equal(m.forward([ids[i]], c).logits[0], fused[i])


def test_fused_taps_equal_torch_taps_layout(tiny_q):
    arch, path = tiny_q
    m = load_model(path, n_ctx=256)
    ids = list(range(3, 20))
    out = m.forward(ids, m.make_cache(), all_logits=True, taps=[0, 1, m.n_layers])
    assert out.hidden.shape == (len(ids), 3 * m.hidden_size)
    emb = m.embed[ids] * m.cfg.embed_scale
    assert torch.equal(out.hidden[:, : m.hidden_size], emb)  # tap 0 is the embedding row


def test_taps_copied_by_the_one_native_call_equal_runs_split_at_each_tap(tiny_q):
    """The fused forward copies the residual entering each tapped layer (and after the last) out of
    ONE native call; the same rows as running the blocks in stretches between the taps and
    cloning the residual at each cut (the way taps were taken before), bit for bit, with the same
    final residual; taps outside [l0, l1] are refused before anything runs."""
    arch, path = tiny_q
    m = load_model(path, n_ctx=256)
    f, L, d = m.fused, m.n_layers, m.hidden_size
    cos, sin = m.rope_lists()
    ids = list(range(3, 12))
    taps = [0, 1, L]
    c1, c2 = m.make_cache(), m.make_cache()
    c1.reserve(len(ids)); c2.reserve(len(ids))
    h1 = m._token_rows(ids).contiguous()
    h2 = h1.clone()
    rows = f.run(h1, 0, L, 0, c1.k, c1.v, cos, sin, taps)
    split = []
    for a, b in zip([0, 1], [1, L]):
        split.append(h2.clone())
        f.run(h2, a, b, 0, c2.k, c2.v, cos, sin)
    split.append(h2.clone())
    assert torch.equal(rows, torch.cat(split, dim=-1)) and torch.equal(h1, h2)
    with pytest.raises(ValueError, match="outside layers"):
        f.run(h1.clone(), 0, 1, 0, c1.k, c1.v, cos, sin, [2])


# ----------------------------------------------------------------------------- without a compiler


def test_no_compiler_falls_back_with_a_reason(monkeypatch, tmp_path):
    fresh_kernels(monkeypatch)
    monkeypatch.setattr(kernels.shutil, "which", lambda name: None)
    monkeypatch.delenv("CC", raising=False)
    assert kernels.lib() is None
    assert "no C compiler" in kernels.unavailable_reason()
    path = write_tiny_model(tmp_path / "q.gguf", "llama", quant="Q4_0", d_model=64, ffn_dim=128, vocab_size=320)
    m = load_model(path)
    assert m.fused is None and m.blocks[0].qkv.fmt == "int4"
    assert m.forward([1, 2, 3], m.make_cache()).logits.shape == (1, m.vocab_size)


def test_switch_off_by_environment(monkeypatch):
    monkeypatch.setattr(kernels, "_tried", False)
    monkeypatch.setattr(kernels, "_lib", None)
    monkeypatch.setenv("TSSPEC_KERNELS", "0")
    assert kernels.lib() is None and "TSSPEC_KERNELS=0" in kernels.unavailable_reason()


def test_tied_head_and_embedding_share_one_packed_copy(tiny_q):
    """Tied (no output.weight): the head's packed blocks serve the embedding lookups too, so the
    table is held once, and a lookup gives the same rows as the file's blocks dequantized."""
    _, path = tiny_q
    m = load_model(path)
    assert m.lm_head.fmt == "gguf" and m.embed.gguf.packed
    assert m.embed.storage_ptr() == m.lm_head.weight.ctypes.data
    stored = m.embed.gguf.stored()
    want = gguf_dense(m.embed.gguf.type_name, stored, m.embed.shape[1])[[5, 0, 17]]
    np.testing.assert_array_equal(m.embed[[5, 0, 17]].numpy(), want)


def test_huge_page_arena_hands_out_disjoint_aligned_arrays():
    """Repacked weights are carved from shared 2 MiB-page-advised chunks: each array is page
    aligned, none overlaps another, and one too large for a chunk gets a mapping of its own."""
    arena = kernels._HugeArena()
    arrays = [arena.empty((n, 100)) for n in (1, 37, 4096, 5)]
    big = arena.empty((arena.CHUNK // 4 // 1000 + 1, 1000))
    spans = []
    for a in arrays + [big]:
        assert a.ctypes.data % arena.ALIGN == 0 and a.flags.writeable
        a[...] = 7
        spans.append((a.ctypes.data, a.ctypes.data + a.nbytes))
    spans.sort()
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
    assert all(int(a.sum()) == 7 * a.size for a in arrays)
