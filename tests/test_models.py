"""The target trunk on tiny random-weight models of every architecture.

Two kinds of check:

* against an independent plain reference written here (full causal softmax attention in f32,
  straight from the GGUF's dequantized arrays): the loaded model computes the right function;
* against itself: batch invariance (a row's logits do not depend on how many rows share the
  forward), rewind, KV growth and span boundaries leave results bitwise unchanged. That is the
  property that makes speculative output identical to plain output.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tiny import ARCHS, write_tiny_model
from tsspec.errors import BadInput
from tsspec.gguf_file import GGUFFile
from tsspec.models import load_model
from tsspec.models.cache import SPAN_BLOCK

SEQ = 80  # crosses the 64-position attention-span boundary; 10x gemma's window of 8
GEMMA_WINDOW = 8


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_models")
    paths = {}
    for arch in ARCHS:
        paths[arch] = write_tiny_model(d / f"{arch}.gguf", arch, seed=1, ctx=1024, sliding_window=GEMMA_WINDOW)
    paths["llama-untied"] = write_tiny_model(d / "llama-untied.gguf", "llama", seed=2, tied=False, ctx=1024)
    return paths


VARIANTS = [*ARCHS, "llama-untied"]


def tokens(n: int, seed: int = 0, vocab: int = 300) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


# ----------------------------------------------------------------------------- the plain reference


def _rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, base: float, adjacent_pairs: bool) -> torch.Tensor:
    """x [T, heads, hd] rotated by position, as complex numbers: pairs are (2i, 2i+1) in GGML's
    normal mode (llama files) or (i, i + hd/2) in NEOX mode (everyone else)."""
    t, _, hd = x.shape
    freqs = base ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)  # [hd/2]
    rot = torch.polar(torch.ones(t, hd // 2, dtype=torch.float64),
                      torch.arange(t, dtype=torch.float64)[:, None] * freqs[None, :])[:, None, :]
    xd = x.double()
    if adjacent_pairs:
        z = torch.complex(xd[..., 0::2], xd[..., 1::2]) * rot
        return torch.stack([z.real, z.imag], dim=-1).flatten(-2).float()
    z = torch.complex(xd[..., : hd // 2], xd[..., hd // 2 :]) * rot
    return torch.cat([z.real, z.imag], dim=-1).float()


def reference_forward(path, ids: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """-> (logits [T, vocab], residual entering each layer plus the final one, each [T, d])."""
    g = GGUFFile(path)
    arch = g.arch
    W = lambda name: torch.from_numpy(np.array(g.tensor(name), dtype=np.float32))  # noqa: E731
    has = g.has_tensor
    meta = lambda key: g.get(f"{arch}.{key}")  # noqa: E731
    n_layers, d = meta("block_count"), meta("embedding_length")
    n_heads, n_kv = meta("attention.head_count"), meta("attention.head_count_kv")
    hd = meta("attention.key_length") or d // n_heads
    eps = meta("attention.layer_norm_rms_epsilon")
    base = meta("rope.freq_base")
    gemma = arch == "gemma3"
    t = len(ids)

    emb = W("token_embd.weight")
    x = emb[torch.tensor(ids)]
    if gemma:
        x = x * math.sqrt(d)
    pos = torch.arange(t)
    causal = pos[None, :] <= pos[:, None]  # [query, key]
    residuals = []
    for i in range(n_layers):
        residuals.append(x)
        p = f"blk.{i}."
        layer_base, mask = base, causal
        if gemma and (i + 1) % 6 != 0:  # local layer: sliding window, its own rope base
            layer_base = 10000.0
            mask = causal & (pos[None, :] > pos[:, None] - meta("attention.sliding_window"))
        h = _rms(x, W(p + "attn_norm.weight"), eps)
        q, k, v = (h @ W(p + f"attn_{n}.weight").T for n in "qkv")
        if has(p + "attn_q.bias"):
            q, k, v = q + W(p + "attn_q.bias"), k + W(p + "attn_k.bias"), v + W(p + "attn_v.bias")
        q, k, v = q.view(t, n_heads, hd), k.view(t, n_kv, hd), v.view(t, n_kv, hd)
        if has(p + "attn_q_norm.weight"):
            q, k = _rms(q, W(p + "attn_q_norm.weight"), eps), _rms(k, W(p + "attn_k_norm.weight"), eps)
        q, k = _rope(q, layer_base, arch == "llama"), _rope(k, layer_base, arch == "llama")
        k = k.repeat_interleave(n_heads // n_kv, dim=1)  # query head h reads kv head h // rep
        v = v.repeat_interleave(n_heads // n_kv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        a = torch.einsum("hqk,khd->qhd", probs, v).reshape(t, n_heads * hd) @ W(p + "attn_output.weight").T
        if gemma:
            a = _rms(a, W(p + "post_attention_norm.weight"), eps)
        x = x + a
        h = _rms(x, W(p + "ffn_norm.weight"), eps)
        act = (lambda z: F.gelu(z, approximate="tanh")) if gemma else F.silu
        f = (act(h @ W(p + "ffn_gate.weight").T) * (h @ W(p + "ffn_up.weight").T)) @ W(p + "ffn_down.weight").T
        if gemma:
            f = _rms(f, W(p + "post_ffw_norm.weight"), eps)
        x = x + f
    residuals.append(x)
    head = W("output.weight") if has("output.weight") else emb
    return _rms(x, W("output_norm.weight"), eps) @ head.T, residuals


# ----------------------------------------------------------------------------- correctness


@pytest.mark.parametrize("variant", VARIANTS)
def test_f32_matches_plain_reference(tiny_paths, variant):
    ids = tokens(SEQ, seed=3)
    want, _ = reference_forward(tiny_paths[variant], ids)
    m = load_model(tiny_paths[variant], fmt="f32")
    got = m.forward(ids, m.make_cache(), all_logits=True).logits
    assert got.shape == want.shape
    assert want.std() > 0.5  # logits are not degenerate, so agreement means something
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", VARIANTS)
def test_bf16_close_to_plain_reference(tiny_paths, variant):
    # bf16 weights and inputs to every product (8-bit mantissas). Stated tolerance, relative to the
    # logits' spread: max error < 15% and mean error < 2% of their std (measured on these tiny
    # models: max 4-9%, mean 0.7-1.2%); argmax agrees on >= 90% of rows (random logits have near-ties).
    ids = tokens(SEQ, seed=4)
    want, _ = reference_forward(tiny_paths[variant], ids)
    m = load_model(tiny_paths[variant])
    got = m.forward(ids, m.make_cache(), all_logits=True).logits
    err, scale = (got - want).abs(), float(want.std())
    assert float(err.max()) < 0.15 * scale, (float(err.max()), scale)
    assert float(err.mean()) < 0.02 * scale, (float(err.mean()), scale)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("variant", VARIANTS)
def test_taps_are_the_residual_entering_the_layer(tiny_paths, variant):
    ids = tokens(40, seed=5)
    _, residuals = reference_forward(tiny_paths[variant], ids)
    m = load_model(tiny_paths[variant], fmt="f32")
    n = m.n_layers
    taps = [n, 0, n - 1]  # any order, the after-last-layer tap included
    out = m.forward(ids, m.make_cache(), all_logits=False, taps=taps)
    assert out.logits.shape == (1, m.vocab_size)
    assert out.hidden.shape == (len(ids), len(taps) * m.hidden_size)
    for j, layer in enumerate(taps):
        got = out.hidden[:, j * m.hidden_size : (j + 1) * m.hidden_size]
        torch.testing.assert_close(got, residuals[layer], atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- batch invariance


def _step_by_step(m, ids) -> torch.Tensor:
    c = m.make_cache()
    return torch.cat([m.forward([t], c).logits for t in ids])


@pytest.mark.parametrize("variant", VARIANTS)
def test_one_forward_equals_single_steps_bitwise(tiny_paths, variant):
    ids = tokens(SEQ, seed=6)
    m = load_model(tiny_paths[variant])
    whole = m.forward(ids, m.make_cache(), all_logits=True).logits
    steps = _step_by_step(m, ids)
    assert torch.equal(whole, steps)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt", ["bf16", "f32"])
def test_rows_do_not_depend_on_chunking(tiny_paths, variant, fmt):
    ids = tokens(SEQ, seed=7)
    m = load_model(tiny_paths[variant], fmt=fmt)
    whole = m.forward(ids, m.make_cache(), all_logits=True).logits
    for sizes in ([1, 2, 3, 5, 9], [9, 5, 3, 2, 1], [4, 7, 2, 8, 1, 6]):
        c = m.make_cache()
        rows, i, s = [], 0, 0
        while i < len(ids):
            n = sizes[s % len(sizes)]
            rows.append(m.forward(ids[i : i + n], c, all_logits=True).logits)
            i, s = i + n, s + 1
        assert torch.equal(torch.cat(rows), whole), sizes


@pytest.mark.parametrize("variant", VARIANTS)
def test_rewind_then_redecode_equals_fresh_run(tiny_paths, variant):
    prefix, a, b = tokens(30, seed=8), tokens(9, seed=9), tokens(12, seed=10)
    m = load_model(tiny_paths[variant])
    c = m.make_cache()
    m.forward(prefix, c)
    m.forward(a, c, all_logits=True)  # a rejected draft: written into the cache, then forgotten
    c.trim(len(a) - 2)  # keep two of its rows, as a partial accept does
    assert c.length == len(prefix) + 2
    after = m.forward(b, c, all_logits=True).logits
    want = m.forward(prefix + a[:2] + b, m.make_cache(), all_logits=True).logits[-len(b) :]
    assert torch.equal(after, want)
    with pytest.raises(ValueError):
        c.trim(c.length + 1)
    with pytest.raises(ValueError):
        c.trim(-1)


@pytest.mark.parametrize("variant", VARIANTS)
def test_kv_growth_and_span_boundaries_keep_results(tiny_paths, variant):
    # the cache starts at 512 positions and doubles; rows straddle every 64-position span boundary
    ids = tokens(656, seed=11)
    m = load_model(tiny_paths[variant])
    c = m.make_cache()
    assert c.capacity == 512
    rows, i = [], 0
    for n in [250, 9, 1, 3, 200, 9, 9, 9, 9, 1, 1, 7, 40, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9]:
        rows.append(m.forward(ids[i : i + n], c, all_logits=True).logits)
        i += n
    assert i > 512 and c.capacity == 1024
    big = m.make_cache()
    big.reserve(1024)
    want = m.forward(ids[:i], big, all_logits=True).logits
    got = torch.cat(rows)
    # compare per row so a failure names the first position that differs
    bad = [p for p in range(i) if not torch.equal(got[p], want[p])]
    assert not bad, f"rows differ from position {bad[0]} (span block {SPAN_BLOCK})"


def test_context_overflow_raises_bad_input(tiny_paths):
    m = load_model(tiny_paths["llama"], n_ctx=100)
    assert m.max_context == 100
    c = m.make_cache()
    m.forward(tokens(99), c)
    m.forward([1], c)  # exactly full
    with pytest.raises(BadInput):
        m.forward([1], c)
    c.reset()
    with pytest.raises(BadInput):
        m.forward(tokens(101), c)
    with pytest.raises(BadInput):
        c.reserve(101)
    # n_ctx is capped at the trained context the file declares
    assert load_model(tiny_paths["llama"], n_ctx=10**6).max_context == 1024


def test_out_of_range_token_raises_bad_input(tiny_paths):
    m = load_model(tiny_paths["qwen2"])
    with pytest.raises(BadInput):
        m.forward([m.vocab_size], m.make_cache())
    with pytest.raises(BadInput):
        m.forward([-1], m.make_cache())


@pytest.mark.parametrize("arch", ARCHS)
def test_config_comes_from_metadata(tmp_path, arch):
    p = write_tiny_model(tmp_path / "m.gguf", arch, d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=64,
                         n_layers=7 if arch == "gemma3" else 3, vocab_size=270, ctx=128)
    m = load_model(p)
    c = m.cfg
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.ffn_dim, c.vocab_size, m.max_context) == (
        7 if arch == "gemma3" else 3, 32, 2, 1, 64, 270, 128)
    assert m.hidden_size == 32 and m.vocab_size == 270
    if arch == "gemma3":  # five local layers, then a global one
        assert [s.window for s in c.layers] == [8, 8, 8, 8, 8, None, 8]
    else:
        assert all(s.window is None for s in c.layers)


def test_kv_cache_keep(tiny_paths):
    m = load_model(tiny_paths["llama"])
    c = m.make_cache()
    m.forward(tokens(20), c)
    assert c.keep(30) == 20 and c.keep(12) == 12 and c.length == 12 and c.keep(-1) == 0
