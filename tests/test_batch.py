"""Several sequences' rows in one trunk forward (``forward_batch``), and the loop and server that
use it.

The product is exactness: a sequence's logits and tap rows from a forward it shares with others
are bitwise the ones a lone ``forward`` gives it, on every attention architecture, on the torch
path (f32, bf16, and the gguf products without the fused blocks) and on the native fused path,
for sequences at different lengths (across 64-position span boundaries and a cache's growth),
mixing 1-row steps, multi-row verifies and prefill chunks, with rejected rows trimmed between
rounds. A hybrid trunk says it does not batch (``batches_sequences`` False) and its
``forward_batch`` runs the items in turn, with the same results.
"""

from __future__ import annotations

import random

import pytest
import torch

from tiny import ARCHS, write_tiny_model
from tsspec.errors import BadInput
from tsspec.models import load_model
from tsspec.models.runners import TorchRunner
from tsspec.models.protocols import BatchedTarget, ForwardItem
from tsspec.spec.loop import forward_each

GEMMA_WINDOW = 8


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("batch_models")
    out = {a: write_tiny_model(d / f"{a}.gguf", a, seed=3, ctx=1024, sliding_window=GEMMA_WINDOW) for a in ARCHS}
    out.update({f"{a}-q4": write_tiny_model(d / f"{a}-q4.gguf", a, seed=5, ctx=1024, quant="Q4_0", d_model=64,
                                            ffn_dim=128, vocab_size=320, sliding_window=GEMMA_WINDOW)
                for a in ARCHS})
    return out


def load(paths, arch, path_kind):
    """``path_kind``: "fused" (auto weights, native blocks), "gguf-torch" (the same weights, the
    torch block path), "f32" or "bf16" (torch formats)."""
    if path_kind == "fused":
        m = load_model(paths[f"{arch}-q4"])
        assert m.fused is not None, "the native kernels are needed for the fused path"
        return m
    if path_kind == "gguf-torch":
        m = load_model(paths[f"{arch}-q4"])
        m.runner = TorchRunner()  # the same weights through the torch reference
        return m
    m = load_model(paths[arch], fmt=path_kind)
    assert m.fused is None
    return m


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(300) for _ in range(n)]


def run_rounds(m, seed: int, rounds: int = 6) -> None:
    """Four sequences at different lengths: each round a random subset forwards a random mix of
    1-row steps, verifies and prefill chunks, alone (caches A) and in one shared forward (caches B);
    every output must be bitwise equal; then each drops a random tail, as a partial accept does."""
    rng = random.Random(seed)
    prompts = [_tokens(rng, n) for n in (3, 70, 20, 130)]
    a = [m.make_cache() for _ in prompts]
    b = [m.make_cache() for _ in prompts]
    for p, ca, cb in zip(prompts, a, b):
        m.forward(p, ca)
        m.forward(p, cb)
    tap_choices = [None, None, [0, m.n_layers], [1]]
    for r in range(rounds):
        chosen = [s for s in range(len(prompts)) if rng.random() < 0.8] or [0]
        items_a, items_b = [], []
        for s in chosen:
            n = rng.choice([1, 1, 1, 3, 5, 9, 40 if r == 2 else 9])
            toks = _tokens(rng, n)
            all_logits = n > 1 or rng.random() < 0.3
            taps = rng.choice(tap_choices)
            items_a.append(ForwardItem(toks, a[s], all_logits, taps))
            items_b.append(ForwardItem(toks, b[s], all_logits, taps))
        lone = [m.forward(it.tokens, it.cache, all_logits=it.all_logits, taps=it.taps) for it in items_a]
        shared = m.forward_batch(items_b)
        assert len(shared) == len(lone)
        for s, x, y, it in zip(chosen, lone, shared, items_b):
            assert x.logits.shape == y.logits.shape
            assert torch.equal(x.logits, y.logits), f"round {r}, sequence {s}, {len(it.tokens)} rows"
            assert (x.hidden is None) == (y.hidden is None)
            if x.hidden is not None:
                assert torch.equal(x.hidden, y.hidden), f"taps, round {r}, sequence {s}"
        for s in chosen:
            assert a[s].length == b[s].length
            drop = rng.randrange(0, 3)
            drop = min(drop, a[s].length - 1)
            a[s].trim(drop)
            b[s].trim(drop)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("path_kind", ["fused", "gguf-torch", "f32", "bf16"])
def test_shared_forward_equals_lone_forwards_bitwise(paths, arch, path_kind):
    m = load(paths, arch, path_kind)
    assert isinstance(m, BatchedTarget) and m.batches_sequences
    run_rounds(m, seed=hash((arch, path_kind)) % 1000)


@pytest.mark.parametrize("path_kind", ["fused", "f32"])
def test_shared_forward_at_two_threads(paths, path_kind):
    """The products split their work between threads by row count; a row's bits must not move."""
    m = load(paths, "qwen3", path_kind)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        run_rounds(m, seed=11, rounds=4)
    finally:
        torch.set_num_threads(before)


def test_cache_growth_inside_a_shared_forward(paths):
    """One sequence's cache grows (512 -> 1024 positions) inside the shared forward."""
    m = load(paths, "llama", "fused")
    rng = random.Random(2)
    long_p, short_p = _tokens(rng, 505), _tokens(rng, 9)
    ca, cb = m.make_cache(), m.make_cache()
    sa, sb = m.make_cache(), m.make_cache()
    for c in (ca, cb):
        m.forward(long_p, c)
    for c in (sa, sb):
        m.forward(short_p, c)
    more, step = _tokens(rng, 20), _tokens(rng, 1)
    want = [m.forward(more, ca, all_logits=True).logits, m.forward(step, sa).logits]
    got = m.forward_batch([(more, cb, True, None), (step, sb, False, None)])
    assert cb.capacity == 1024 and ca.capacity == 1024
    assert torch.equal(want[0], got[0].logits) and torch.equal(want[1], got[1].logits)


def test_a_bad_item_changes_no_cache(paths):
    m = load(paths, "qwen2", "fused")
    c1, c2 = m.make_cache(), m.make_cache()
    m.forward([1, 2, 3], c1)
    with pytest.raises(BadInput):
        m.forward_batch([([4], c1), ([5, 10**6], c2)])
    assert c1.length == 3 and c2.length == 0
    small = load_model(paths["qwen2"], n_ctx=64)
    c1, c2 = small.make_cache(), small.make_cache()
    with pytest.raises(BadInput):  # one item past the context: refused before anything is written
        small.forward_batch([([1, 2], c1), (list(range(70)), c2)])
    assert c1.length == 0 and c2.length == 0
    with pytest.raises(ValueError):
        m.forward_batch([([1], c1), ([2], c1)])


def test_forward_each_is_the_per_sequence_reference(paths):
    """``forward_each`` shares the forward where the target batches and runs items in turn where it
    does not; the outputs are the same either way."""
    m = load(paths, "gemma3", "fused")
    rng = random.Random(4)
    ps = [_tokens(rng, n) for n in (5, 66)]

    def fresh():
        cs = [m.make_cache() for _ in ps]
        for p, c in zip(ps, cs):
            m.forward(p, c)
        return cs

    items = lambda cs: [ForwardItem([7], cs[0]), ForwardItem([8, 9, 10], cs[1], True, [0])]  # noqa: E731
    shared = forward_each(m, items(fresh()))
    m.batches_sequences = False  # an instance that declines: one forward per item
    try:
        alone = forward_each(m, items(fresh()))
        declined = m.forward_batch(items(fresh()))
    finally:
        del m.batches_sequences
    for x, y, z in zip(shared, alone, declined):
        assert torch.equal(x.logits, y.logits) and torch.equal(x.logits, z.logits)


def test_hybrid_trunk_declines_and_runs_items_in_turn(tmp_path):
    from tiny_hybrid import write_hybrid

    path, _ = write_hybrid(tmp_path / "q35.gguf", "qwen35")
    m = load_model(path, fmt="bf16")
    assert m.batches_sequences is False
    rng = random.Random(6)
    ps = [_tokens(rng, n) for n in (6, 30)]
    a = [m.make_cache() for _ in ps]
    b = [m.make_cache() for _ in ps]
    for p, ca, cb in zip(ps, a, b):
        m.forward(p, ca)
        m.forward(p, cb)
    steps = [[11], [12, 13, 14, 15]]
    want = [m.forward(t, c, all_logits=True).logits for t, c in zip(steps, a)]
    got = m.forward_batch([ForwardItem(t, c, True) for t, c in zip(steps, b)])
    assert all(torch.equal(x, y.logits) for x, y in zip(want, got))
    lengths = [c.length for c in b]
    with pytest.raises(BadInput):  # in turn, but still refused as a whole before anything runs
        m.forward_batch([ForwardItem([1], b[0]), ForwardItem([10**6], b[1])])
    assert [c.length for c in b] == lengths
