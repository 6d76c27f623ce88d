"""N-gram speculation: the pure proposer on hand-written arrays, the incremental index against the
brute-force reference (random histories, truncations), and the Speculator wrapper."""

from __future__ import annotations

import random

import pytest

from tsspec.spec.ngram import NGramIndex, NGramSpeculator, ngram_propose
from tsspec.spec.protocols import Draft, DraftContext, Speculator


def reference_lookup(history, k, min_order, max_order, periodic=True):
    """Longest order with an earlier occurrence wins; defined through the pure proposer."""
    for n in range(max_order, min_order - 1, -1):
        draft = ngram_propose(history, n, k, periodic=periodic)
        if draft:
            return draft
    return []


# ----------------------------------------------------------------------------- ngram_propose


def test_propose_vllm_example():
    assert ngram_propose([1, 2, 3, 4, 1, 2, 3], n=2, k=3) == [4, 1, 2]


def test_propose_no_match_or_degenerate():
    assert ngram_propose([1, 2, 3, 4, 5], n=2, k=3) == []
    assert ngram_propose([1, 2], n=2, k=3) == []  # the suffix is the whole history
    assert ngram_propose([], n=1, k=3) == []
    assert ngram_propose([1, 2, 1, 2], n=2, k=0) == []


def test_propose_prefers_recent_occurrence_with_full_continuation():
    #         0  1  2  3  4  5  6  7  8  9
    history = [5, 6, 1, 1, 5, 6, 2, 2, 5, 6]
    # occurrences of (5, 6) end at 2 and 6; both have >= 3 tokens after them: the newest wins
    assert ngram_propose(history, n=2, k=3) == [2, 2, 5]
    # only the one ending at 2 has 5 tokens after it
    assert ngram_propose(history, n=2, k=5) == [1, 1, 5, 6, 2]


def test_propose_repeated_token_run_drafts_full_window():
    # the newest earlier (x, x) ends one before the end: a newest-only rule drafts one token
    assert ngram_propose([7, 7, 7, 7], n=2, k=4) == [7, 7, 7, 7]
    assert ngram_propose([7, 7, 7, 7], n=2, k=4, periodic=False) == [7, 7]
    assert ngram_propose([3, 9, 7, 7, 7, 7, 7], n=3, k=8) == [7] * 8


def test_propose_periodic_extension_repeats_the_period():
    # (a, b) last seen ending at 3; period 3 -> c a b c a b ...
    assert ngram_propose([1, 2, 3, 1, 2], n=2, k=7) == [3, 1, 2, 3, 1, 2, 3]
    assert ngram_propose([1, 2, 3, 1, 2], n=2, k=7, periodic=False) == [3, 1, 2]


# ----------------------------------------------------------------------------- NGramIndex


def test_index_matches_hand_examples():
    idx = NGramIndex(min_order=2, max_order=4)
    idx.extend([1, 2, 3, 4, 1, 2, 3])
    assert idx.lookup(3) == [4, 1, 2]  # order 3 (1, 2, 3) matches
    assert idx.lookup_order(3)[0] == 3
    assert idx.lookup(3, min_order=4) == []  # the 4-gram suffix (4, 1, 2, 3) was never seen
    idx.extend([9])
    assert idx.lookup(3) == []


def test_index_prefers_longest_order():
    #         the 2-gram (2, 3) last occurred before 7; the 3-gram (1, 2, 3) before 4
    history = [1, 2, 3, 4, 8, 2, 3, 7, 1, 2, 3]
    idx = NGramIndex(min_order=2, max_order=8)
    idx.extend(history)
    assert idx.lookup_order(2) == (3, [4, 8])
    assert ngram_propose(history, 2, 2) == [7, 1]  # what order 2 alone would say


@pytest.mark.parametrize("periodic", [True, False])
def test_index_agrees_with_brute_force_on_random_histories(periodic):
    rng = random.Random(1234)
    for trial in range(60):
        lo = rng.randint(1, 3)
        hi = lo + rng.randint(0, 5)
        alphabet = rng.randint(2, 4)
        idx = NGramIndex(min_order=lo, max_order=hi, periodic=periodic)
        history: list[int] = []
        for step in range(120):
            if history and rng.random() < 0.15:  # rollback of a few tokens
                cut = max(0, len(history) - rng.randint(1, 6))
                history = history[:cut]
                idx.truncate(cut)
            else:
                chunk = [rng.randrange(alphabet) for _ in range(rng.randint(1, 4))]
                history.extend(chunk)
                idx.extend(chunk)
            assert list(idx.tokens) == history
            k = rng.randint(1, 10)
            req = rng.randint(lo, hi + 1)
            want = reference_lookup(history, k, req, hi, periodic)
            assert idx.lookup(k, min_order=req) == want, (trial, step, history, k, req)


def test_truncate_is_inverse_of_extend():
    rng = random.Random(7)
    tokens = [rng.randrange(3) for _ in range(200)]
    idx = NGramIndex(2, 6)
    idx.extend(tokens[:50])
    snapshot = {i: {k: list(v) for k, v in t.items()} for i, t in enumerate(idx._ends)}
    idx.extend(tokens[50:])
    idx.truncate(50)
    assert {i: {k: list(v) for k, v in t.items()} for i, t in enumerate(idx._ends)} == snapshot
    idx.truncate(0)
    assert len(idx) == 0 and all(not t for t in idx._ends)
    idx.truncate(10)  # longer than the history: nothing to forget
    with pytest.raises(ValueError):
        idx.truncate(-1)


def test_index_rejects_bad_orders():
    with pytest.raises(ValueError):
        NGramIndex(min_order=0)
    with pytest.raises(ValueError):
        NGramIndex(min_order=5, max_order=4)


# ----------------------------------------------------------------------------- NGramSpeculator


def ctx(history, max_tokens=8):
    return DraftContext(
        last_token=history[-1], position=len(history) - 1, max_tokens=max_tokens, history=history
    )


def test_speculator_satisfies_protocol_and_flags():
    s = NGramSpeculator()
    assert isinstance(s, Speculator)
    assert s.name == "ngram"
    assert s.default_min_draft_prob == 0.0 and s.min_draft_prob == 0.0
    assert s.needs_hidden_state is False and s.taps == ()
    assert s.can_arm_after_prefix_reuse is True
    assert s.default_accept_rule == "match"


def test_speculator_drafts_from_prompt_and_respects_max_tokens():
    prompt = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    s = NGramSpeculator(max_draft_tokens=4)
    s.begin(prompt, None)
    hist = prompt + [10, 11, 12]
    d = s.propose(ctx(hist, max_tokens=8))
    assert isinstance(d, Draft)
    assert d.tokens == [13, 14, 15, 16]  # capped by max_draft_tokens
    assert s.propose(ctx(hist, max_tokens=2)).tokens == [13, 14]  # capped by the context
    assert s.propose(ctx(hist + [99])).tokens == []


def test_speculator_tracks_growing_and_rolled_back_history():
    rng = random.Random(3)
    s = NGramSpeculator(max_draft_tokens=5, min_order=2, max_order=5)
    hist = [rng.randrange(4) for _ in range(30)]
    s.begin(hist, None)
    for step in range(200):
        if rng.random() < 0.1:
            hist = hist[: max(1, len(hist) - rng.randint(1, 4))]  # a history that got shorter
        else:
            hist = hist + [rng.randrange(4) for _ in range(rng.randint(1, 3))]
        k = rng.randint(1, 8)
        d = s.propose(ctx(hist, max_tokens=k))
        assert list(s.index.tokens) == hist
        assert d.tokens == reference_lookup(hist, min(k, 5), 2, 5)


def test_speculator_resyncs_when_history_is_a_different_sequence():
    s = NGramSpeculator()
    s.begin([1, 2, 3, 1, 2], None)
    other = [5, 6, 7, 5, 6]
    assert s.propose(ctx(other)).tokens == [7, 5, 6, 7, 5, 6, 7, 5]
    assert list(s.index.tokens) == other


def test_commit_writes_landed_tokens():
    s = NGramSpeculator()
    s.begin([1, 2, 3, 4], None)
    s.commit([4, 1, 2], None, start_pos=3)  # last_token 4 plus two accepted drafts
    assert list(s.index.tokens) == [1, 2, 3, 4, 1, 2]
    s.commit([9], None, start_pos=5)  # overwrites a stale tail
    assert list(s.index.tokens) == [1, 2, 3, 4, 1, 9]
    s.commit([7], None, start_pos=50)  # a gap: ignored, propose re-syncs from history
    assert len(s.index) == 6
    s.reset()
    assert len(s.index) == 0


def test_pmin_scales_required_match_length():
    s = NGramSpeculator(min_order=2, max_order=8)
    assert s.required_order == 2
    s.min_draft_prob = 0.5
    assert s.required_order == 5
    s.min_draft_prob = 1.0
    assert s.required_order == 8
    # a 3-token repeat drafts at pmin 0 but not when pmin asks for 5-token matches
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    hist = prompt + [4, 5, 6]
    s0 = NGramSpeculator(min_draft_prob=0.0)
    s0.begin(prompt, None)
    assert s0.propose(ctx(hist)).tokens[:3] == [7, 8, 9]
    s5 = NGramSpeculator(min_draft_prob=0.5)
    s5.begin(prompt, None)
    assert s5.propose(ctx(hist)).tokens == []
    with pytest.raises(ValueError):
        NGramSpeculator(min_draft_prob=1.5)


def test_speculator_counters():
    s = NGramSpeculator(max_draft_tokens=3)
    s.begin([1, 2, 3, 4, 1, 2], None)
    s.propose(ctx([1, 2, 3, 4, 1, 2]))
    s.propose(ctx([1, 2, 3, 4, 1, 2, 8]))
    assert (s.proposals, s.matches, s.drafted) == (2, 1, 3)
    assert s.last_order == 0
