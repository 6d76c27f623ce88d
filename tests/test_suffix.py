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
from tsspec.spec.protocols import DraftContext
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


def conts_of(store, history, depth, min_order, per_match=32):
    """``SuffixStore.lookup`` without the anchors."""
    n, found = store.lookup(history, depth, min_order, per_match)
    return n, [c for c, _ in found]


def test_store_cuts_at_sequences_and_keeps_its_budget():
    store = SuffixStore(budget=20)  # two generations of 10 tokens
    store.add([1, 2, 3, 4, 5])
    store.add([9, 1, 2, 8])
    n, conts = conts_of(store, [7, 1, 2], depth=4, min_order=2)
    assert n == 2 and conts == [[8], [3, 4, 5]]  # newest first, never past a sequence's end
    store.add(list(range(100, 114)))  # its last 10 tokens start a new generation; the first two stay
    assert (store.tokens, store.sequences) == (19, 3)
    assert conts_of(store, [7, 1, 2], depth=4, min_order=2) == (2, [[8], [3, 4, 5]])
    assert conts_of(store, [0, 110, 111], depth=2, min_order=2) == (2, [[112, 113]])
    store.add([1, 2, 6])  # the young generation is full: the oldest (the first two sequences) goes
    assert (store.tokens, store.sequences) == (13, 2)
    assert conts_of(store, [7, 1, 2], depth=4, min_order=2) == (2, [[6]])
    assert conts_of(store, [0, 0], depth=3, min_order=2) == (0, [])
    assert store.tokens <= store.budget


def test_store_lookups_prefer_the_longer_suffix_and_read_both_generations():
    store = SuffixStore(budget=16)
    store.add([5, 6, 7, 1])  # old generation
    store.add([9, 6, 7, 2])
    store.add([3, 6, 7, 4])  # 12 > 8: [5,6,7,1],[9,6,7,2] become the old one
    assert conts_of(store, [5, 6, 7], depth=2, min_order=2) == (3, [[1]])  # order 3, from the old
    assert conts_of(store, [0, 6, 7], depth=2, min_order=2) == (2, [[4], [2], [1]])  # young first
    assert conts_of(store, [0, 6, 7], depth=2, min_order=2, per_match=2) == (2, [[4], [2]])
    assert store.lookups == 3 and store.hits == 3
    names = {g[0]: g[3] for g in store.gauges()}
    assert names["tsspec_suffix_store_tokens"] == 12 and names["tsspec_suffix_hit_ratio"] == 1.0


def test_a_full_store_adds_without_rebuilding():
    """Once full, each add used to rebuild the whole index (about 1 s for 65,536 tokens); now the
    index's size never passes the budget and an add touches its own tokens only."""
    store = SuffixStore(budget=1000)
    for i in range(60):
        store.add([i] + list(range(200, 249)))
        assert store.tokens <= 1000
        assert len(store._young.index) + len(store._old.index) <= 1000 + 2 * store.sequences
    assert store.sequences_added == 60 and store.sequences >= 10
    n, conts = conts_of(store, [0, 59, 200], depth=3, min_order=2)
    assert n == 2 and conts[0] == [201, 202, 203]


def test_follow_reads_on_along_the_stored_sequence():
    store = SuffixStore()
    store.add([1, 2, 3, 70, 71, 4, 5, 3, 6, 7, 8])
    n, found = store.lookup([9, 1, 2], depth=2, min_order=2)
    assert n == 2 and [c for c, _ in found] == [[3, 70]]
    anchor = found[0][1]
    # new text (90, 91) where the stored one had 70, 71; then the token that followed it there
    assert store.follow(anchor, [1, 2, 3, 90, 91, 4], depth=3) == ([5, 3, 6], (anchor[0], 6))
    # the first occurrence after the previous token wins over an earlier one without it
    assert store.follow(anchor, [5, 3], depth=2) == ([6, 7], (anchor[0], 8))
    assert store.follow(anchor, [9, 3], depth=2) == ([70, 71], (anchor[0], 3))  # no 9 before it: the first
    assert store.follow(anchor, [5, 99], depth=2) == ([], anchor)  # not there: the place is kept
    assert store.follow(anchor, [8], depth=2) == ([], anchor)  # 8 ends its sequence: nothing after it
    assert store.follow(anchor, [4], depth=2, window=2) == ([], anchor)  # 4 is further than the window
    store.add([4, 4, 4])
    assert store.follow((anchor[0], 10), [8], depth=3) == ([], (anchor[0], 10))  # never past the separator
    # once its generation is dropped, an anchor is let go
    small = SuffixStore(budget=8)  # generations of 4 tokens
    small.add([1, 2, 3, 4])
    _, found = small.lookup([1, 2], depth=1, min_order=2)
    held = found[0][1]
    assert small.follow(held, [2, 99], depth=1) == ([], held)
    small.add([5, 6, 7])  # the young generation is full: [1, 2, 3, 4] becomes the old one
    assert small.follow(held, [9, 3], depth=1) == ([4], (held[0], 3))
    small.add([8, 9, 10])  # and now it is dropped
    assert small.follow(held, [9, 3], depth=1) == ([], None)


def test_a_second_request_drafts_past_its_new_value_from_the_first():
    """The agent shape: the same structure, a different value. A suffix match needs two tokens of the
    new text before it finds anything; following the first request drafts right after the value."""
    store = SuffixStore()
    sys_prompt = [100, 101, 102, 103]
    first = [6, 7, 8, 9, 10, 50, 51, 11, 12, 13, 14]  # structure 6-10, value 50 51, structure 11-14
    spec = SuffixSpeculator(store, max_draft_tokens=8)
    spec.begin(sys_prompt + [200], None)
    spec.end_sequence(sys_prompt + [200] + first)
    spec.begin(sys_prompt + [201], None)

    def propose(history):
        return spec.propose(DraftContext(last_token=history[-1], position=len(history) - 1, max_tokens=8,
                                         history=history)).tokens

    h = sys_prompt + [201, 6, 7]
    assert propose(h) == [8, 9, 10, 50, 51, 11, 12, 13]  # from the store (its first proposal)
    h += [8, 9, 10, 60]  # a different value
    assert propose(h) == []  # 60 is nowhere: nothing to follow yet
    h += [61, 11]
    assert propose(h) == [12, 13, 14]  # followed past the value; a suffix match has only [61, 11]
    assert spec.followed == 1 and spec.from_store == 2
    spec.begin(sys_prompt + [202], None)  # a new sequence follows nothing until the store drafts again
    assert propose(sys_prompt + [202, 60, 61, 11]) == []


def test_readers_beside_a_writer_never_see_half_a_sequence():
    store = SuffixStore(budget=400)
    seq = list(range(30))
    stop = threading.Event()
    seen = []

    def read():
        while not stop.is_set():
            n, conts = conts_of(store, [0, 1], depth=28, min_order=2)
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


# then two requests that vary an earlier one, past which the speculator follows the stored request
PROMPTS = [[40, 41, 42, 43, 44], [10, 11, 12], [40, 41, 42, 43, 44], [50, 51, 52, 53], [10, 11, 12],
           [40, 41, 42, 43, 45], [9, 10, 11, 13]]


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
    assert spec.followed > 0  # and output equals plain where it followed a stored request's tokens


def test_one_store_per_engine(trunk):
    shared: dict = {}
    a = REGISTRY.create("suffix", trunk, SpecOptions(), None, shared)
    b = REGISTRY.create("suffix", trunk, SpecOptions(), None, shared)
    c = REGISTRY.create("suffix", trunk, SpecOptions(), None)
    assert a.store is b.store and c.store is not a.store


def test_pmin_is_one_value_the_sequences_own_lookup_reads():
    spec = SuffixSpeculator(SuffixStore(), min_draft_prob=0.5)
    assert spec.min_draft_prob == 0.5 and spec.own.required_order == 5  # orders 2..8: 2 + round(0.5 * 6)
    spec.min_draft_prob = None  # the default, as n-gram's
    assert spec.min_draft_prob == 0.0 and spec.own.required_order == 2
    with pytest.raises(ValueError, match=r"--spec-pmin for suffix must be in \[0, 1\]"):
        spec.min_draft_prob = 1.5
    assert spec.min_draft_prob == 0.0
    with pytest.raises(ValueError, match="for suffix"):
        SuffixSpeculator(SuffixStore(), min_draft_prob=-0.1)
