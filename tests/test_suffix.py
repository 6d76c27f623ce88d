"""The suffix speculator: n-gram over the sequence in hand and over the engine's earlier sequences.

Shown: the frequency rule that turns what followed a suffix into a draft (chain and tree); the store's
budget, eviction and separators, and concurrent readers beside a writer; output identical to plain
decoding on tiny files (greedy and seeded) while a repeated request drafts from the store; one store
per engine, shared by its sequences and by nothing else.
"""

from __future__ import annotations

import threading

import pytest

from tiny import write_tiny_model
from tsspec.models import load_model
from tsspec.options import SpecOptions
from tsspec.sampling import Sampler, SamplingParams
from tsspec.spec import tree
from tsspec.spec.loop import decode
from tsspec.spec.plan import SpecPlan
from tsspec.spec.registry import REGISTRY
from tsspec.spec.stats import SpecStats
from tsspec.spec.suffix import SuffixSpeculator, SuffixStore, most_followed


def test_most_followed_drafts_the_majority_path():
    conts = [[1, 2, 3], [1, 2, 4], [1, 2, 3], [1, 5], [7]]
    # 4 of 5 went on with 1; all 4 of those with 2 (1 then 5 is the other); 2 of 3 with 3
    assert most_followed(conts, 5) == ([1, 2, 3], None)
    assert most_followed(conts, 2) == ([1, 2], None)
    assert most_followed(conts, 5, share=0.7) == ([1, 2], None)  # 3 took 2 of 3 < 0.7
    assert most_followed([[1], [2], [3]], 4) == ([], None)  # no majority for a first token
    toks, pars = most_followed(conts, 5, nodes=5)
    tree.check(toks, pars)
    assert toks[:3] == [1, 2, 3] and pars[:3] == [-1, 0, 1]  # the most followed first, parents first
    assert (toks, pars) == ([1, 2, 3, 7], [-1, 0, 1, -1])  # 4 and 5 were taken by under half
    toks, pars = most_followed(conts, 5, nodes=6, share=0.2)
    assert (toks, pars) == ([1, 2, 3, 7, 5, 4], [-1, 0, 1, -1, 0, 1])  # by count, then the shallower
    assert most_followed(conts, 5, nodes=2)[0] == [1, 2]


def test_store_cuts_at_sequences_and_keeps_its_budget():
    store = SuffixStore(budget=20)
    store.add([1, 2, 3, 4, 5])
    store.add([9, 1, 2, 8])
    n, conts = store.continuations([7, 1, 2], depth=4, min_order=2)
    assert n == 2 and conts == [[8], [3, 4, 5]]  # newest first, never past a sequence's end
    store.add(list(range(100, 114)))  # 23 tokens held > 20: the oldest goes, the index is rebuilt
    assert store.tokens == 18
    n, conts = store.continuations([7, 1, 2], depth=4, min_order=2)
    assert conts == [[8]]
    assert store.continuations([0, 0], depth=3, min_order=2) == (0, [])


def test_readers_beside_a_writer_never_see_half_a_sequence():
    store = SuffixStore(budget=400)
    seq = list(range(30))
    stop = threading.Event()
    seen = []

    def read():
        while not stop.is_set():
            n, conts = store.continuations([0, 1], depth=28, min_order=2)
            seen.extend(len(c) for c in conts)

    readers = [threading.Thread(target=read) for _ in range(3)]
    for t in readers:
        t.start()
    for _ in range(200):
        store.add(seq)
    stop.set()
    for t in readers:
        t.join()
    assert seen and set(seen) == {28}  # every continuation whole: no half-added sequence


@pytest.fixture(scope="module")
def trunk(tmp_path_factory):
    return load_model(write_tiny_model(tmp_path_factory.mktemp("suffix") / "t.gguf", "qwen2", seed=11, n_layers=3))


PROMPTS = [[40, 41, 42, 43, 44], [10, 11, 12], [40, 41, 42, 43, 44], [50, 51, 52, 53], [10, 11, 12]]


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, top_k=40, seed=5)],
                         ids=["greedy", "seeded"])
@pytest.mark.parametrize("tree_nodes", [0, 12])
def test_requests_in_order_equal_plain_and_later_ones_draft_from_earlier(trunk, params, tree_nodes):
    store = SuffixStore()
    spec = SuffixSpeculator(store, max_draft_tokens=6, tree=tree_nodes)
    from_store = []
    for prompt in PROMPTS:
        plain = decode(trunk, Sampler(params), prompt, 40)
        st = SpecStats()
        before = spec.from_store
        assert decode(trunk, Sampler(params), prompt, 40, SpecPlan(spec, window=6), stats=st) == plain
        from_store.append(spec.from_store - before)
    assert store.sequences_added == len(PROMPTS)
    assert from_store[0] == 0  # nothing earlier to draft from
    assert from_store[2] > 0 and from_store[4] > 0  # a repeated request drafts from its first answer


def test_one_store_per_engine(trunk):
    shared: dict = {}
    a = REGISTRY.create("suffix", trunk, SpecOptions(), None, shared)
    b = REGISTRY.create("suffix", trunk, SpecOptions(), None, shared)
    c = REGISTRY.create("suffix", trunk, SpecOptions(), None)
    assert a.store is b.store and c.store is not a.store
