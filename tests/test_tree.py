"""Token trees in the trunk's forward (issue 38's first step): a tree row gets a chain's bits.

A forward whose tokens carry parents (``ForwardItem.parents``) puts each token at the cache's
length plus its depth and lets it attend to the cache and its own ancestors only. The contract
that keeps speculative output exact: a tree row's logits equal, bit for bit, those of the last row
of a chain verify of its path, on the native blocks and on the torch reference alike, for every
attention-trunk architecture (gemma3's sliding window included), alone or beside other sequences
in one batched forward. ``KVCache.keep_path`` then moves an accepted path into place so that the
next forward sees exactly the chain's cache.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiny import write_tiny_model
from tsspec import kernels
from tsspec.models import load_model
from tsspec.models.protocols import ForwardItem
from tsspec.models.runners import TorchRunner

ARCHS = [("llama", "Q4_0"), ("qwen2", "Q8_0"), ("qwen3", "Q4_0"), ("gemma3", "Q8_0")]
# a, then b and c under a, d under b, e under c, f under d: paths a, ab, ac, abd, ace, abdf
TREE = [-1, 0, 0, 1, 2, 3]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def path(parents, r):
    out = [r]
    while parents[out[-1]] >= 0:
        out.append(parents[out[-1]])
    return out[::-1]


def use_runner(model, runner: str) -> None:
    """Run ``model`` on ``runner``: its native blocks (skipped where the kernels are not built) or
    the torch reference."""
    if runner == "native" and model.fused is None:
        pytest.skip(f"native kernels: {kernels.unavailable_reason()}")
    if runner == "torch":
        model.runner = TorchRunner()


@pytest.fixture(params=ARCHS, ids=lambda a: a[0])
def model(request, tmp_path, one_thread):
    arch, quant = request.param
    p = write_tiny_model(tmp_path / f"{arch}.gguf", arch, quant=quant, d_model=64, ffn_dim=128, vocab_size=320)
    return load_model(p, n_ctx=128)


@pytest.mark.parametrize("runner", ["native", "torch"])
def test_tree_rows_equal_chain_verifies_of_their_paths(model, runner):
    use_runner(model, runner)
    rng = np.random.default_rng(3)
    prefix = [int(t) for t in rng.integers(0, 300, size=11)]  # past gemma3's window of 8
    tree = [int(t) for t in rng.integers(0, 300, size=len(TREE))]
    c = model.make_cache()
    model.forward(prefix, c)
    out = model.forward(tree, c, all_logits=True, parents=TREE).logits
    assert c.length == len(prefix) + len(tree)
    for r in range(len(TREE)):
        chain = [tree[a] for a in path(TREE, r)]
        cc = model.make_cache()
        model.forward(prefix, cc)
        ref = model.forward(chain, cc, all_logits=True).logits[-1]
        assert torch.equal(bits(out[r]), bits(ref)), (r, runner)


# a tree grown over three forwards, as a drafter expands its best nodes depth by depth: roots a, b;
# then c, d under a and e under b; then f under d and g under e
GROWN = [[-1, -1], [0, 0, 1], [3, 4]]


@pytest.mark.parametrize("runner", ["native", "torch"])
def test_a_tree_grown_over_several_forwards_gets_its_paths_chain_bits(model, runner):
    """Rows whose ancestors an earlier forward wrote (``base``): each row's logits equal, bit for
    bit, a chain verify of its path, and beside another sequence's chain in one forward too."""
    use_runner(model, runner)
    rng = np.random.default_rng(6)
    prefix = [int(t) for t in rng.integers(0, 300, size=11)]  # past gemma3's window of 8
    other = [int(t) for t in rng.integers(0, 300, size=7)]
    c, c2 = model.make_cache(), model.make_cache()
    model.forward(prefix, c)
    model.forward(other, c2)
    base = len(prefix)
    parents: list[int] = []
    tokens: list[int] = []
    for depth, level in enumerate(GROWN):
        new = [int(t) for t in rng.integers(0, 300, size=len(level))]
        parents += level
        item = ForwardItem(new, c, True, None, list(parents), base)
        if depth == 1:  # beside another sequence's chain in one batched forward
            out = model.forward_batch([item, ForwardItem([5, 6], c2, True)])[0].logits
        else:
            out = model.forward(new, c, all_logits=True, parents=list(parents), base=base).logits
        first = len(tokens)
        tokens += new
        assert c.length == base + len(tokens)
        for r in range(len(new)):
            chain = [tokens[a] for a in path(parents, first + r)]
            cc = model.make_cache()
            model.forward(prefix, cc)
            ref = model.forward(chain, cc, all_logits=True).logits[-1]
            assert torch.equal(bits(out[r]), bits(ref)), (depth, r, runner)


def test_a_grown_tree_with_bad_parents_or_base_is_refused_before_the_cache_changes(model):
    c = model.make_cache()
    model.forward([1, 2, 3], c)
    model.forward([4, 5], c, parents=[-1, -1])
    # two tree nodes cached from base 3: a third node needs three parents, its own before it
    for tokens, parents, base in (([6], [-1, -1], 3), ([6], [-1, -1, 2], 3), ([6, 7], [-1, 0], 4), ([6], [-1], 9),
                                  ([6], [-1] * 7, -1)):
        with pytest.raises(ValueError, match="parents must precede"):
            model.forward(tokens, c, parents=parents, base=base)
        assert c.length == 5


def test_tree_beside_another_sequence_in_one_forward(model):
    """A tree and a chain of another sequence share one batched forward; each gets its lone bits."""
    rng = np.random.default_rng(4)
    p1, p2 = [int(t) for t in rng.integers(0, 300, size=9)], [int(t) for t in rng.integers(0, 300, size=5)]
    tree, chain = [int(t) for t in rng.integers(0, 300, size=len(TREE))], [int(t) for t in rng.integers(0, 300, size=3)]
    c1, c2 = model.make_cache(), model.make_cache()
    model.forward(p1, c1)
    model.forward(p2, c2)
    both = model.forward_batch([ForwardItem(tree, c1, True, None, TREE), ForwardItem(chain, c2, True)])
    a1, a2 = model.make_cache(), model.make_cache()
    model.forward(p1, a1)
    model.forward(p2, a2)
    alone_tree = model.forward(tree, a1, all_logits=True, parents=TREE).logits
    alone_chain = model.forward(chain, a2, all_logits=True).logits
    assert torch.equal(bits(both[0].logits), bits(alone_tree))
    assert torch.equal(bits(both[1].logits), bits(alone_chain))


def test_keep_path_leaves_the_chains_cache(model):
    """After a tree forward, keeping the path a, c, e makes the next step's logits the chain's."""
    rng = np.random.default_rng(5)
    prefix = [int(t) for t in rng.integers(0, 300, size=10)]
    tree = [int(t) for t in rng.integers(0, 300, size=len(TREE))]
    nxt = int(rng.integers(0, 300))
    c = model.make_cache()
    model.forward(prefix, c)
    model.forward(tree, c, all_logits=True, parents=TREE)
    c.keep_path(len(prefix), [0, 2, 4])
    assert c.length == len(prefix) + 3
    got = model.forward([nxt], c).logits
    ref_c = model.make_cache()
    ref = model.forward(prefix + [tree[0], tree[2], tree[4], nxt], ref_c).logits
    assert torch.equal(bits(got), bits(ref))


def test_bad_parents_are_refused_before_the_cache_changes(model):
    c = model.make_cache()
    model.forward([1, 2, 3], c)
    for bad in ([0, -1], [-1, 1], [-1, 5], [-2, 0]):
        with pytest.raises(ValueError, match="parents must precede"):
            model.forward([4, 5], c, parents=bad)
        assert c.length == 3
    with pytest.raises(ValueError, match="keep_path"):
        c.keep_path(0, [2, 1])


def test_a_growth_floor_every_row_passes_grows_the_tree_grown_without_one():
    """``tree.grow`` with ``pmin`` reuses the softmax its test took for a greedy node's proposals: where
    every drafter row passes the test, the tree is the one grown without it, token for token; a root
    below it proposes nothing."""
    from tsspec.sampling import Sampler
    from tsspec.spec.tree import Growth, grow

    vocab = 40
    table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(11)) * 3.0

    def expand(nodes, toks, pars):
        return table[[toks[i] for i in nodes]]

    root = table[0]
    least = float(torch.softmax(table, dim=-1).max(dim=-1).values.min())
    plain = grow(root, Growth(12, 4, 3, 3, 0.0), expand, Sampler(), 5, None, 0)
    gated = grow(root, Growth(12, 4, 3, 3, 0.0, pmin=least * 0.99), expand, Sampler(), 5, None, 0)
    assert len(plain[0]) == 12 and gated[:2] == plain[:2]
    top = float(torch.softmax(root, dim=-1).max())
    assert grow(root, Growth(12, 4, 3, 3, 0.0, pmin=top * 1.01), expand, Sampler(), 5, None, 0)[0] == []
