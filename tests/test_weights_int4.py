"""The int4 weight backend (``fmt="auto"``: Q4_0/Q4_1/Q4_K tensors stay 4-bit).

* the kernel's dequantization really is ``(q - 8) * scale + zero`` per 32-wide group along K;
* codes recovered through gguf-py reproduce its dequantization (tiny Q4_0 file; every Q4 tensor
  of a real file);
* the int4 product is batch invariant on the real models' shapes (1..17, 33, 65 rows; 1 and 2
  threads), and a forward of N rows equals N single steps bitwise;
* speculative output equals plain output with int4 weights.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiny import write_tiny_model
from tsspec.spec.plan import SpecPlan
from tsspec.gguf_file import GGUFFile
from tsspec.models import load_model
from tsspec.sampling import Sampler
from tsspec.spec.loop import decode
from tsspec.spec.ngram import NGramSpeculator
from tsspec.weights import (
    FORMATS,
    INT4_GROUP,
    INT4_TYPES,
    Int4Weight,
    Linear,
    int4_from_gguf,
    int4_supported,
)

GREEDY = Sampler()

# (out, in) of the products of the real models (as tests/test_weights.py), plus the 151936x1536
# head (qwen2.5-coder-1.5b's vocabulary; int4 when its file stores it as Q4_K).
SHAPES = {
    "smollm2-135m": [(576 + 2 * 192, 576), (2 * 1536, 576), (576, 1536), (576, 576)],
    "gemma3-270m": [(1024 + 2 * 256, 640), (2 * 2048, 640), (640, 2048), (640, 1024)],
    "qwen2.5-coder-0.5b": [(896 + 2 * 128, 896), (2 * 4864, 896), (896, 4864)],
    "qwen2.5-coder-1.5b": [(1536 + 2 * 256, 1536), (2 * 8960, 1536), (1536, 8960)],
    "head": [(151936, 1536)],
}
ALL_SHAPES = [(name, s) for name, shapes in SHAPES.items() for s in shapes]
ROW_COUNTS = [*range(1, 18), 33, 65]


def _random_int4(out: int, inp: int, seed: int = 0) -> Int4Weight:
    rng = np.random.default_rng(seed)
    g = inp // INT4_GROUP
    q = rng.integers(0, 16, size=(out, inp), dtype=np.uint8)
    a = (rng.random((out, g), dtype=np.float32) * 0.02 / inp**0.5 + 1e-4).astype(np.float32)
    b = (-7.5 * a + rng.standard_normal((out, g), dtype=np.float32) * a).astype(np.float32)
    return Int4Weight(q, a, b)


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("int4") / "tiny-q4.gguf", "llama", quant="Q4_0",
                            d_model=64, ffn_dim=128, vocab_size=320)


# ----------------------------------------------------------------------------- the kernel


def test_kernel_dequantizes_as_documented():
    """(q - 8) * scale + zero per group along K, checked against a float64 reference in float32."""
    torch.manual_seed(0)
    n, k = 64, 128
    q = torch.randint(0, 16, (n, k), dtype=torch.int32)
    scale = torch.rand(k // 32, n) * 0.1
    zero = torch.randn(k // 32, n) * 0.1
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    x = torch.randn(5, k)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, torch.stack([scale, zero], -1))
    w = (q.double() - 8) * scale.double().T.repeat_interleave(32, 1) + zero.double().T.repeat_interleave(32, 1)
    torch.testing.assert_close(y.double(), x.double() @ w.T, atol=1e-5, rtol=1e-5)
    # the wrong convention (no -8) is far off, so the check above does discriminate
    w_wrong = q.double() * scale.double().T.repeat_interleave(32, 1) + zero.double().T.repeat_interleave(32, 1)
    assert (y.double() - x.double() @ w_wrong.T).abs().max() > 0.1


def test_chunked_packing_equals_one_pack():
    q = torch.randint(0, 16, (4096 + 80, 64), dtype=torch.int32)
    whole = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    lin = Linear(Int4Weight(q.numpy().astype(np.uint8), np.ones((q.shape[0], 2), np.float32),
                            np.zeros((q.shape[0], 2), np.float32)), None, "auto")
    assert lin.fmt == "int4" and torch.equal(lin.weight, whole)


def test_int4_linear_matches_its_dense_weights():
    w = _random_int4(192, 256, seed=3)
    bias = np.random.default_rng(1).standard_normal(192).astype(np.float32)
    lin = Linear(w, bias, "auto")
    assert lin.fmt == "int4" and (lin.out_features, lin.in_features) == (192, 256)
    # the stored weights are a*q + b up to the bf16 rounding of scale and zero
    dense = lin.dense_weight()
    ref = torch.from_numpy(w.dense())
    assert (dense - ref).abs().max() <= 2.0**-8 * (ref.abs().max() + 16 * float(np.abs(w.a).max()))
    x = torch.randn(9, 256)
    got, want = lin(x), lin.reference(x)
    # the kernel rounds inputs and output to bf16
    bound = 2.0**-7 * (x.abs() @ dense.abs().T) + 1e-5
    assert bool(((got - want).abs() <= bound).all())
    # a float array with "auto" is f32 (never below its values' precision); an Int4Weight with "bf16" is dense bf16
    assert Linear(w.dense(), None, "auto").fmt == "f32"  # a dense array: never below f32 under auto
    assert Linear(w, None, "bf16").weight.dtype == torch.bfloat16


def test_concat_int4_and_mixed():
    a, b = _random_int4(64, 96, 1), _random_int4(32, 96, 2)
    fused = Linear.concat([(a, None), (b, None)], "auto")
    assert fused.fmt == "int4" and fused.out_features == 96
    x = torch.randn(3, 96)
    want = torch.cat([Linear(a, None, "auto")(x), Linear(b, None, "auto")(x)], dim=1)
    assert torch.equal(fused(x), want)
    mixed = Linear.concat([(a, None), (b.dense(), np.ones(32, np.float32))], "auto")
    assert mixed.fmt == "f32" and mixed.out_features == 96 and mixed.bias is not None


def test_supported_shapes():
    assert "auto" in FORMATS and set(INT4_TYPES) == {"Q4_0", "Q4_1", "Q4_K"}
    assert int4_supported("Q4_K", (1536, 1536)) and int4_supported("Q4_0", (960, 576))
    assert not int4_supported("Q4_0", (960, 48))  # K not whole groups
    assert not int4_supported("Q4_0", (100, 64))  # the CPU packing wants N % 16 == 0
    assert not int4_supported("Q6_K", (1536, 1536)) and not int4_supported("Q8_0", (64, 64))


# ----------------------------------------------------------------------------- batch invariance


@pytest.mark.parametrize("model,shape", ALL_SHAPES, ids=[f"{n}-{o}x{i}" for n, (o, i) in ALL_SHAPES])
@pytest.mark.parametrize("threads", [1, 2])
def test_int4_linear_is_batch_invariant(model, shape, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, inp = shape
        lin = Linear(_random_int4(out, inp, seed=out + inp), None, "auto")
        assert lin.fmt == "int4"
        x = torch.randn(max(ROW_COUNTS) + 8, inp, generator=torch.Generator().manual_seed(out))
        full = lin(x)
        for m in ROW_COUNTS:
            for start in (0, 5):
                got = lin(x[start : start + m])
                assert torch.equal(got, full[start : start + m]), f"{m} rows at offset {start} differ"
    finally:
        torch.set_num_threads(before)


# ----------------------------------------------------------------------------- tiny Q4_0 model


def test_tiny_q4_codes_reproduce_gguf_py(tiny_q4):
    g = GGUFFile(tiny_q4)
    n = 0
    for name in g.tensor_names():
        info = g.tensor_info(name)
        if info.type_name not in INT4_TYPES:
            continue
        type_name, raw = g.tensor_raw(name)
        assert type_name == "Q4_0" and raw.dtype == np.uint8 and raw.size == info.n_bytes
        w = int4_from_gguf(type_name, raw, info.shape)
        ref = g.tensor(name)
        assert w.q.max() <= 15
        np.testing.assert_allclose(w.dense(), ref, rtol=0, atol=1e-6 * max(1.0, float(np.abs(ref).max())))
        n += 1
    assert n > 0


@pytest.fixture
def no_native(monkeypatch):
    """The machine without native kernels (no compiler): "auto" falls back to torch's int4 kernel."""
    from tsspec import kernels

    monkeypatch.setattr(kernels, "_force_off", True)
    assert not kernels.available()


@pytest.fixture(params=["native", "int4"])
def backend(request, monkeypatch):
    """Run a test on both "auto" backends: the native GGUF kernels and the int4 fallback."""
    if request.param == "int4":
        request.getfixturevalue("no_native")
    return request.param


def test_tiny_q4_loads_int4_and_is_close_to_bf16(tiny_q4, no_native):
    auto = load_model(tiny_q4, fmt="auto")
    bf16 = load_model(tiny_q4, fmt="bf16")
    blk = auto.blocks[0]
    assert {blk.qkv.fmt, blk.o.fmt, blk.gate_up.fmt, blk.down.fmt} == {"int4"}
    assert auto.lm_head.fmt == "int4"  # tied Q4_0 embedding: an int4 copy for the head
    assert auto.embed.dtype == torch.bfloat16
    assert auto.weight_bytes() < bf16.weight_bytes()
    ids = list(range(1, 40))
    la = auto.forward(ids, auto.make_cache(), all_logits=True).logits
    lb = bf16.forward(ids, bf16.make_cache(), all_logits=True).logits
    assert la.shape == lb.shape
    scale = lb.abs().max()
    assert (la - lb).abs().max() <= 0.05 * scale
    assert (la.argmax(-1) == lb.argmax(-1)).float().mean() >= 0.8


def test_tiny_q4_forward_rows_equal_single_steps(tiny_q4, backend):
    m = load_model(tiny_q4, fmt="auto")
    assert m.blocks[0].qkv.fmt == ("gguf" if backend == "native" else "int4")
    ids = [int(t) for t in np.random.default_rng(0).integers(0, 300, size=80)]
    for threads in (1, 2):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            c = m.make_cache()
            m.forward(ids[:20], c)
            full = m.forward(ids[20:80], c, all_logits=True).logits
            c.trim(c.length - 20)
            for i in range(20, 80):
                step = m.forward([ids[i]], c).logits
                assert torch.equal(step[0], full[i - 20]), f"row {i} differs at {threads} threads"
            c.trim(c.length - 20)
            for i in range(20, 80, 9):  # verify-sized chunks
                chunk = m.forward(ids[i : i + 9], c, all_logits=True).logits
                assert torch.equal(chunk, full[i - 20 : i - 20 + chunk.shape[0]])
        finally:
            torch.set_num_threads(before)


def test_tiny_q4_speculative_equals_plain(tiny_q4, backend):
    m = load_model(tiny_q4, fmt="auto")
    prompt = [5, 6, 7, 8, 9, 10] * 6 + [11, 12, 13]
    plain = decode(m, GREEDY, prompt, 64)
    for window in (4, 8):
        got = decode(m, GREEDY, prompt, 64, SpecPlan(NGramSpeculator(max_draft_tokens=8), window=window))
        assert got == plain


def test_env_selects_auto(monkeypatch, tiny_q4):
    from tsspec.settings import resolve_run

    monkeypatch.setenv("TSSPEC_WEIGHTS", "auto")
    m = load_model(tiny_q4, fmt=resolve_run().weights)  # the variable is read by tsspec.settings
    assert m.blocks[0].qkv.fmt == "gguf"  # this machine kind has a compiler: the native kernels


def test_env_selects_auto_without_native(monkeypatch, tiny_q4, no_native):
    from tsspec.settings import resolve_run

    monkeypatch.setenv("TSSPEC_WEIGHTS", "auto")
    m = load_model(tiny_q4, fmt=resolve_run().weights)  # the variable is read by tsspec.settings
    assert m.blocks[0].qkv.fmt == "int4"


# ----------------------------------------------------------------------------- real model


@pytest.mark.real_model
def test_real_q4_codes_are_exact(real_model_path):
    g = GGUFFile(real_model_path("smollm2-135m"))
    n = 0
    for name in g.tensor_names():
        info = g.tensor_info(name)
        if info.type_name in INT4_TYPES:
            w = int4_from_gguf(*g.tensor_raw(name), info.shape)  # raises when a*q+b != gguf-py
            ref = g.tensor(name)
            np.testing.assert_allclose(w.dense(), ref, rtol=0, atol=1e-6 * max(1.0, float(np.abs(ref).max())))
            n += 1
    assert n == 210  # every block matrix of smollm2-135m is Q4_1


@pytest.mark.real_model
def test_real_speculative_equals_plain(real_model_path, backend):
    from tsspec.tokenizer import Tokenizer

    path = real_model_path("smollm2-135m")
    m = load_model(path, fmt="auto", n_ctx=512)
    assert m.blocks[0].gate_up.fmt == ("gguf" if backend == "native" else "int4")
    assert (m.fused is not None) == (backend == "native")
    tok = Tokenizer.from_gguf(path)
    prompt = tok.encode("def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n"
                        "def fib2(n):\n")
    plain = decode(m, GREEDY, prompt, 48)
    spec = decode(m, GREEDY, prompt, 48, SpecPlan(NGramSpeculator(max_draft_tokens=8), window=8))
    assert spec == plain and len(plain) == 48
