"""The draft-model speculator: exact output, a drafter cache that follows the trunk, clear refusals.

Tiny random-weight files stand in for real models (``tests/tiny.py``); the real Qwen pair is the
``real_model`` layer at the bottom.
"""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tiny import rewrite_metadata, write_bad_files, write_tiny_model
from tsspec.spec.plan import SpecPlan
from tsspec.drafters import DrafterOptions, load_drafter
from tsspec.drafters.draft_model import check_vocab, load as load_draft_model
from tsspec.errors import BadInput, ModelFileError
from tsspec.gguf_file import GGUFFile
from tsspec.models import load_model
from tsspec.options import SpecOptions
from tsspec.sampling import Sampler, SamplingParams
from tsspec.spec.draft_model import DraftModelSpeculator
from tsspec.spec.loop import decode
from tsspec.spec.protocols import DraftContext, Speculator
from tsspec.spec.registry import REGISTRY
from tsspec.spec.stats import SpecStats

PROMPTS = [
    [72, 101, 108, 108, 111],
    [260, 261, 32, 100, 101, 102],
    [10],
    [84, 104, 101, 32, 113, 117, 105, 99, 107, 32, 98, 114, 111, 119, 110],
    [100, 101, 102, 32, 109, 97, 105, 110, 40, 41, 58, 10, 32, 32, 32, 32],
    list(range(40, 110)),  # a longer prompt: spans past the 64-position attention block
]
N_TOKENS = 40


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("draft_model")
    return {
        "trunk": write_tiny_model(d / "trunk.gguf", "qwen2", seed=11, n_layers=3),
        # same seed, fewer layers: shares the trunk's embedding and first blocks, so it agrees often
        "related": write_tiny_model(d / "related.gguf", "qwen2", seed=11, n_layers=2),
        # another architecture and seed, one layer: agrees by chance only
        "other": write_tiny_model(d / "other.gguf", "llama", seed=5, n_layers=1),
        "vocab400": write_tiny_model(d / "vocab400.gguf", "qwen2", seed=2, n_layers=1, vocab_size=400),
        "short_ctx": write_tiny_model(d / "short_ctx.gguf", "qwen2", seed=3, n_layers=1, ctx=128),
        "heavy": write_tiny_model(d / "heavy.gguf", "qwen2", seed=4, n_layers=6),
    }


@pytest.fixture(scope="module")
def trunk(files):
    return load_model(files["trunk"])


def _speculator(path, trunk, window=8, pmin=None):
    drafter = load_drafter(path, trunk)
    return REGISTRY.create("draft-model", trunk, SpecOptions(draft=window, pmin=pmin), drafter)


# ----------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("which", ["related", "other", "trunk"])
def test_greedy_equals_plain_for_every_window(files, trunk, which):
    # the drafter loads in the default format, "auto", like the trunk (for "trunk": the same weights)
    spec = _speculator(files[which], trunk)
    assert isinstance(spec, Speculator)
    accepted = drafted = 0
    for prompt in PROMPTS:
        plain = decode(trunk, Sampler(), prompt, N_TOKENS)
        for window in range(1, 9):
            st = SpecStats()
            out = decode(trunk, Sampler(), prompt, N_TOKENS, SpecPlan(spec, window=window), stats=st)
            assert out == plain, f"{which}: window {window}, prompt {prompt[:4]}..."
            accepted += st.accepted
            drafted += st.drafted
    rate = accepted / drafted
    if which == "trunk":
        assert rate >= 0.99, rate  # the trunk drafting for itself: every draft is what it would say
    elif which == "related":
        assert 0.1 < rate < 0.99, rate  # partial acceptance: the rewind paths are exercised


def test_seeded_sampling_with_match_equals_plain(files, trunk):
    spec = _speculator(files["related"], trunk)
    for seed in range(6):
        params = SamplingParams(temperature=0.8, top_p=0.95, seed=seed)
        plain = decode(trunk, Sampler(params), PROMPTS[0], N_TOKENS)
        for window in (2, 5):
            out = decode(trunk, Sampler(params), PROMPTS[0], N_TOKENS, SpecPlan(spec, window=window))
            assert out == plain


def test_greedy_with_penalties_equals_plain(files, trunk):
    spec = _speculator(files["related"], trunk)
    params = SamplingParams(repeat_penalty=1.3, frequency_penalty=0.2)
    plain = decode(trunk, Sampler(params), PROMPTS[1], N_TOKENS)
    assert decode(trunk, Sampler(params), PROMPTS[1], N_TOKENS, SpecPlan(spec, window=4)) == plain


def test_pmin_stops_drafts_early_and_stays_exact(files, trunk):
    loose = _speculator(files["related"], trunk, pmin=0.0)
    strict = _speculator(files["related"], trunk, pmin=0.9)
    assert loose.min_draft_prob == 0.0 and strict.min_draft_prob == 0.9
    plain = decode(trunk, Sampler(), PROMPTS[3], N_TOKENS)
    st_loose, st_strict = SpecStats(), SpecStats()
    assert decode(trunk, Sampler(), PROMPTS[3], N_TOKENS, SpecPlan(loose, window=6), stats=st_loose) == plain
    assert decode(trunk, Sampler(), PROMPTS[3], N_TOKENS, SpecPlan(strict, window=6), stats=st_strict) == plain
    assert st_strict.drafted / max(st_strict.verify_calls, 1) < st_loose.drafted / st_loose.verify_calls
    assert st_strict.plain_steps > 0  # a draft stopped before its first token: a plain step


# ----------------------------------------------------------------------------- the drafter's cache


class EveryThird:
    """A stand-in governor that parks drafting two steps out of three (the drafter then lags)."""

    state, parks = "test", 0

    def __init__(self):
        self.step = 0

    def begin_sequence(self):
        self.step = 0

    def draft_length(self, window):
        return window

    def min_draft_prob(self):
        return None  # no cost gate: the speculator's own

    def should_draft(self):
        self.step += 1
        return self.step % 3 == 0

    def record(self, speculative, ms, emitted, drafted=None, setup_ms=0.0, shared=1):
        pass


@pytest.mark.parametrize("governor", [None, EveryThird])
def test_drafter_cache_follows_the_committed_sequence(files, trunk, governor):
    spec = _speculator(files["related"], trunk, window=5)
    prompt = PROMPTS[4]
    emitted: list[int] = []
    checks = []

    def on_token(t):
        emitted.append(t)
        return False

    def on_step(stats):
        committed = prompt + emitted[:-1]  # the last emitted token is not in the trunk's KV yet
        assert cache.length == len(committed)
        assert spec._committed == committed
        cached = spec.cached_tokens
        assert spec.cache.length == len(cached)
        assert cached == committed[: len(cached)]  # no stale draft token survives a rejection
        assert spec.cache.length + len(spec.pending) == cache.length
        checks.append(len(spec.pending))

    plain = decode(trunk, Sampler(), prompt, 60)
    cache = trunk.make_cache()
    out = decode(trunk, Sampler(), prompt, 60, SpecPlan(spec, window=5, governor=governor() if governor else None), cache=cache, on_token=on_token, on_step=on_step)
    assert out == plain
    assert checks
    if governor is None:
        assert max(checks) <= 1  # at most the last draft token of a fully accepted draft
    else:
        assert max(checks) >= 2  # parked steps left a catch-up for the next draft
    spec.sync()
    assert spec.cache.length == cache.length
    assert spec.cached_tokens == (prompt + emitted)[: cache.length]


def test_commit_rewinds_to_what_the_trunk_kept(files, trunk):
    spec = _speculator(files["other"], trunk, window=4)
    prompt = PROMPTS[0]
    spec.begin(prompt, None)
    assert spec.cache.length == 0 and spec.pending == prompt  # lazy: nothing forwarded before a propose
    sampler = Sampler()
    ctx = DraftContext(last_token=7, position=len(prompt), max_tokens=4, history=prompt + [7],
                       sampler=sampler)
    draft = spec.propose(ctx)
    assert len(draft) == 4 and draft.probs is None  # greedy: no distribution needed
    assert draft.setup_ms > 0.0  # the prompt and last token (6 rows > 4 drafts + 1): one-off setup
    # the drafter forwarded last + the first three drafts; the fourth is never forwarded
    assert spec.cache.length == len(prompt) + 4
    # the trunk keeps last + one draft, then recovers a different token
    spec.commit([7, draft.tokens[0]], None, len(prompt))
    assert spec.cache.length == len(prompt) + 2 and not spec.pending
    # a full acceptance leaves only the last draft token pending
    hist = prompt + [7, draft.tokens[0], 9]
    draft = spec.propose(DraftContext(9, len(prompt) + 2, 3, hist, sampler=sampler))
    assert draft.setup_ms == 0.0  # what a verify leaves behind is the step's own work
    spec.commit([9, *draft.tokens], None, len(prompt) + 2)
    assert spec.pending == [draft.tokens[-1]]
    # a recurrent-style re-commit of the same tokens is a no-op
    spec.commit([9, *draft.tokens], None, len(prompt) + 2)
    assert spec.pending == [draft.tokens[-1]]


def test_sampling_draft_carries_the_sampler_distribution(files, trunk):
    spec = _speculator(files["related"], trunk, window=3)
    prompt = PROMPTS[0]
    spec.begin(prompt, None)
    sampler = Sampler(SamplingParams(temperature=0.7, top_k=20, seed=3))
    draft = spec.propose(DraftContext(5, len(prompt), 3, prompt + [5], sampler=sampler))
    assert draft.probs is not None and tuple(draft.probs.shape) == (3, trunk.vocab_size)
    assert np.allclose(draft.probs.sum(-1).numpy(), 1.0, atol=1e-5)
    assert all(int((row > 0).sum()) <= 20 for row in draft.probs)  # top-k was applied
    assert all(float(draft.probs[i, t]) > 0 for i, t in enumerate(draft.tokens))
    # reproducible: the same context drafts the same tokens
    spec.begin(prompt, None)
    again = spec.propose(DraftContext(5, len(prompt), 3, prompt + [5], sampler=sampler))
    assert again.tokens == draft.tokens


# ----------------------------------------------------------------------------- compatibility


def test_vocabulary_size_mismatch_is_one_clear_error(files, trunk):
    with pytest.raises(BadInput) as e:
        load_drafter(files["vocab400"], trunk)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("draft model vocabulary differs from the trunk's at token 300:")
    assert "400 tokens, the trunk 300" in msg and "not padding" in msg


def test_changed_token_is_named(files, trunk, tmp_path):
    def edit(kv):
        toks, vt, sub = kv["tokenizer.ggml.tokens"]
        toks = list(toks)
        toks[120] = "zebra"
        kv["tokenizer.ggml.tokens"] = (toks, vt, sub)

    bad = rewrite_metadata(files["related"], tmp_path / "changed.gguf", edit)
    with pytest.raises(BadInput, match=r"at token 120: 'zebra' vs 'x'"):
        load_drafter(bad, trunk)


def test_special_id_mismatch_is_refused(files, trunk, tmp_path):
    def edit(kv):
        _, vt, sub = kv["tokenizer.ggml.eos_token_id"]
        kv["tokenizer.ggml.eos_token_id"] = (258, vt, sub)

    bad = rewrite_metadata(files["related"], tmp_path / "eos.gguf", edit)
    with pytest.raises(BadInput, match="draft model eos token id differs from the trunk's: 258 vs 256"):
        load_drafter(bad, trunk)


def test_padding_differences_are_allowed_and_noted():
    base = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "c"],
            "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.pre": "qwen2"}
    padded = dict(base, **{"tokenizer.ggml.tokens": ["a", "b", "c", "[PAD3]", "<|extra_0|>"],
                           "tokenizer.ggml.pre": "default"})
    notes = check_vocab(base, padded)
    assert any("2 trailing padding token(s)" in n for n in notes)
    assert any("pre-tokenizers differ" in n for n in notes)
    assert check_vocab(padded, base)  # the trunk may be the padded one too
    typed = dict(base, **{"tokenizer.ggml.tokens": ["a", "b", "c", "whatever"],
                          "tokenizer.ggml.token_type": [1, 1, 1, 5]})
    assert check_vocab(base, typed)  # type UNUSED counts as padding whatever its text
    with pytest.raises(BadInput, match="at token 1: 'x' vs 'b'"):
        check_vocab(base, dict(base, **{"tokenizer.ggml.tokens": ["a", "x", "c"]}))
    with pytest.raises(BadInput, match="tokenizer type differs"):
        check_vocab(base, dict(base, **{"tokenizer.ggml.model": "llama"}))
    many = dict(base, **{"tokenizer.ggml.tokens": ["a", "b", "c"] + [f"[PAD{i}]" for i in range(200)]})
    with pytest.raises(BadInput, match="more than 128 padding tokens"):
        check_vocab(base, many)


def test_larger_embedding_than_token_list_is_allowed(files, trunk, tmp_path):
    # a llama file whose embedding (and vocab_size) has 4 rows more than its token list
    src = write_tiny_model(tmp_path / "wide.gguf", "llama", seed=6, n_layers=1, vocab_size=304)

    def edit(kv):
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
            value, vt, sub = kv[key]
            kv[key] = (list(value)[:300], vt, sub)

    wide = rewrite_metadata(src, tmp_path / "wide_cut.gguf", edit)
    drafter = load_drafter(wide, trunk)
    assert drafter.model.vocab_size == 304
    assert any("304 rows for 300 tokens" in n for n in drafter.notes)
    spec = REGISTRY.create("draft-model", trunk, SpecOptions(draft=4), drafter)
    plain = decode(trunk, Sampler(), PROMPTS[0], 24)
    assert decode(trunk, Sampler(), PROMPTS[0], 24, SpecPlan(spec, window=4)) == plain
    s = Sampler(SamplingParams(temperature=1.0, seed=1))
    spec.begin(PROMPTS[0], None)
    d = spec.propose(DraftContext(5, len(PROMPTS[0]), 2, PROMPTS[0] + [5], sampler=s))
    assert d.probs.shape[1] == trunk.vocab_size and all(t < trunk.vocab_size for t in d.tokens)


def test_warnings_for_a_heavy_or_short_drafter(files, trunk):
    light = load_model(files["other"])  # 1 layer: the heavy 6-layer file outweighs it
    # in the same weight format: the tiny files are F32, which the trunk keeps at full precision
    heavy = load_drafter(files["heavy"], light, DrafterOptions(weights="auto"))
    assert any("more weight bytes than the trunk" in w for w in heavy.warnings)
    short = load_drafter(files["short_ctx"], trunk)
    assert any("context (128) is shorter than the trunk's (256)" in w for w in short.warnings)
    assert not load_drafter(files["related"], trunk).warnings
    # drafting stops where the short drafter's context ends; output stays exact
    prompt = list(range(40, 150))  # 110 tokens + 60 generated runs past 128
    plain = decode(trunk, Sampler(), prompt, 60)
    spec = REGISTRY.create("draft-model", trunk, SpecOptions(draft=4), short)
    st = SpecStats()
    assert decode(trunk, Sampler(), prompt, 60, SpecPlan(spec, window=4), stats=st) == plain
    assert st.plain_steps > 0 and st.verify_calls > 0
    # a grown tree takes more of the drafter's context than a chain (three rows a depth): a full one
    # at the short drafter's end overflowed its context ("129 tokens do not fit the context of 128")
    for depth in (8, 64):
        spec = DraftModelSpeculator(short.model, vocab_size=trunk.vocab_size, max_draft_tokens=depth, tree=64,
                                    sibling_min=0.0)
        st = SpecStats()
        assert decode(trunk, Sampler(), prompt, 60, SpecPlan(spec, window=depth), stats=st) == plain
        assert st.tree_verifies > 0 and spec.cache.length <= short.model.max_context


def test_non_language_model_and_missing_files_are_refused(files, trunk, tmp_path):
    bad = write_bad_files(tmp_path / "bad")
    with pytest.raises(ModelFileError, match="not a drafter this tool can use"):
        load_drafter(bad["unknown_arch"], trunk)
    with pytest.raises(ModelFileError, match="is not a language model"):
        load_draft_model(GGUFFile(bad["unknown_arch"]), trunk, DrafterOptions())
    with pytest.raises(ModelFileError, match="not found"):
        load_drafter(tmp_path / "nope.gguf", trunk)


# ----------------------------------------------------------------------------- registry


def test_registry_entry(files, trunk):
    opts = SpecOptions(draft=5, pmin=0.25)
    spec, why = REGISTRY.try_create("draft-model", trunk, opts, None)
    assert spec is None and "no draft model attached" in why and "attached drafter" not in why
    drafter = load_drafter(files["related"], trunk)
    # the other algorithms name the drafter that is attached, and the --spec-type that takes it
    for other in ("block", "draft-head"):
        spec, why = REGISTRY.try_create(other, trunk, opts, drafter)
        assert spec is None
    assert f"{Path(files['related']).name} is for --spec-type draft-model, not block" in \
        REGISTRY.try_create("block", trunk, opts, drafter)[1]
    spec = REGISTRY.create("draft-model", trunk, opts, drafter)
    assert isinstance(spec, DraftModelSpeculator)
    # its preferred window (4) bounds its drafts unless the user chose one
    assert (spec.max_draft_tokens, spec.min_draft_prob) == (4, 0.25)
    chosen = REGISTRY.create("draft-model", trunk, SpecOptions(draft=5, draft_explicit=True), drafter)
    assert chosen.max_draft_tokens == 5
    assert spec.default_accept_rule == "match" and spec.can_arm_after_prefix_reuse
    assert not spec.needs_hidden_state and spec.taps == ()
    assert REGISTRY.auto_order(drafter)[0] == "draft-model"
    assert isinstance(REGISTRY.create("auto", trunk, opts, drafter), DraftModelSpeculator)


# ----------------------------------------------------------------------------- the real pair


REAL_PROMPTS = {
    "code": "def binary_search(items, target):\n    \"\"\"Return the index of target in sorted items, or -1.\"\"\"\n",
    "prose": "The old lighthouse keeper climbed the stairs every evening, and on the last night of winter he",
}


@pytest.mark.real_model
def test_real_pair_greedy_equals_plain(real_model_path):
    from tsspec.tokenizer import Tokenizer

    trunk_path = real_model_path("qwen2.5-coder-1.5b")
    target = load_model(trunk_path)
    drafter = load_drafter(real_model_path("qwen2.5-coder-0.5b"), target)
    assert not drafter.warnings
    spec = REGISTRY.create("draft-model", target, SpecOptions(draft=4), drafter)
    grown = REGISTRY.create("draft-model", target, SpecOptions(draft=6, tree=16), drafter)
    per = {"chain": [0, 0], "tree": [0, 0]}  # tokens emitted by verifies, verifies
    tok = Tokenizer.from_gguf(trunk_path)
    for name, text in REAL_PROMPTS.items():
        prompt = tok.encode(text)
        plain = decode(target, Sampler(), prompt, 48)
        st = SpecStats()
        out = decode(target, Sampler(), prompt, 48, SpecPlan(spec, window=4), stats=st)
        assert out == plain, name
        assert st.acceptance_rate > 0.4, (name, st.acceptance_rate)
        ts = SpecStats()  # the grown tree
        assert decode(target, Sampler(), prompt, 48, SpecPlan(grown, window=6), stats=ts) == plain, name
        assert ts.tree_verifies > 0, name
        for which, stats in (("chain", st), ("tree", ts)):
            per[which][0] += stats.verify_emitted
            per[which][1] += stats.verify_calls
    # over the prompts, a depth-6 tree of 16 nodes emits more a verify than the depth-4 chain
    assert per["tree"][0] / per["tree"][1] > per["chain"][0] / per["chain"][1], per


@pytest.mark.real_model
def test_real_mismatched_vocabulary_is_refused(real_model_path):
    qwen = real_model_path("qwen2.5-coder-0.5b")
    target = SimpleNamespace(path=qwen, max_context=4096, vocab_size=151936)  # checked before any weight
    with pytest.raises(BadInput) as e:
        load_drafter(real_model_path("smollm2-135m"), target)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("draft model vocabulary differs from the trunk's at token 0:")


def test_drafter_weights_default_to_auto_and_env_overrides(files, monkeypatch):
    """By default a drafter loads like a trunk (native kernels where they run); lossy int4 is an
    option, and the output is exactly the trunk's either way; TSSPEC_DRAFT_WEIGHTS (resolved by
    tsspec.settings, passed down by the session) picks another format or is one clear error."""
    from tsspec import kernels
    from tsspec.errors import BadInput
    from tsspec.session import Session
    from tsspec.settings import resolve_run

    def session():
        return Session.open(resolve_run(model=str(files["trunk"])))

    s = session()
    trunk = s.target
    drafter = s.load_drafter(files["related"])
    if kernels.available():
        assert drafter.model.blocks[0].qkv.fmt == "gguf"
    monkeypatch.setenv("TSSPEC_DRAFT_WEIGHTS", "int4")
    s = session()
    assert s.config.draft_weights == "int4"
    drafter = s.load_drafter(files["related"])
    assert drafter.model.blocks[0].qkv.fmt == "int4"
    spec = REGISTRY.create("draft-model", s.target, SpecOptions(draft=4), drafter)
    for prompt in PROMPTS[:2]:
        assert decode(s.target, Sampler(), prompt, N_TOKENS, SpecPlan(spec, window=4)) == decode(trunk, Sampler(), prompt, N_TOKENS)
    monkeypatch.setenv("TSSPEC_DRAFT_WEIGHTS", "bf16")
    assert session().load_drafter(files["related"]).model.blocks[0].qkv.fmt == "bf16"
    monkeypatch.setenv("TSSPEC_DRAFT_WEIGHTS", "int3")
    with pytest.raises(BadInput, match="TSSPEC_DRAFT_WEIGHTS"):
        resolve_run()

def test_one_loaded_drafter_serves_interleaved_sequences(files, trunk):
    """Two sequences on one trunk and ONE loaded drafter, stepped in turn: each speculator holds its
    own drafter cache, so each sequence gets what it gets alone (and what plain decoding gives)."""
    from tsspec.spec.loop import DecodeState, decode_batched, decode_interleaved

    drafter = load_drafter(files["related"], trunk)
    specs = [REGISTRY.create("draft-model", trunk, SpecOptions(draft=4), drafter) for _ in range(2)]
    assert specs[0].model is specs[1].model and specs[0].cache is not specs[1].cache
    prompts, n = [PROMPTS[0], PROMPTS[4]], 40
    alone = [decode(trunk, Sampler(), p, n) for p in prompts]
    seqs = [DecodeState(trunk, Sampler(), SpecPlan(s, window=4)) for s in specs]
    assert decode_interleaved(seqs, prompts, n) == alone
    assert all(seq.stats.verify_calls > 0 for seq in seqs)
    specs = [REGISTRY.create("draft-model", trunk, SpecOptions(draft=4), drafter) for _ in range(2)]
    seqs = [DecodeState(trunk, Sampler(), SpecPlan(s, window=4)) for s in specs]
    assert decode_batched(seqs, prompts, n) == alone  # stepped together: shared trunk forwards
    assert all(seq.stats.verify_calls > 0 for seq in seqs)


def test_a_restart_forwards_at_most_the_context_window(files, trunk):
    """A catch-up longer than ``context`` (a long prompt, a long parked stretch, a kept cache the
    drafter never saw) restarts the drafter on the last ``context`` tokens: its cost is bounded, and
    the output stays plain's."""
    drafter = load_drafter(files["trunk"], trunk)
    spec = REGISTRY.create("draft-model", trunk, SpecOptions(draft=4), drafter)
    spec.context = 8
    prompt = PROMPTS[4]
    assert len(prompt) > 8
    rows = []
    real = spec._forward
    spec._forward = lambda toks: (rows.append(len(toks)), real(toks))[1]
    out = decode(trunk, Sampler(), prompt, 30, SpecPlan(spec, window=4))
    assert out == decode(trunk, Sampler(), prompt, 30)
    assert rows[0] == 8 and spec.restarts >= 1 and max(rows) <= 8


# ----------------------------------------------------------------------------- token trees


def test_sibling_leaves_rank_by_the_chance_of_reaching_them():
    from tsspec.spec import tree
    from tsspec.spec.tree import sibling_leaves

    chain = [5, 6, 7]
    chances = [(0.5, 0.4, 9), (0.9, 0.05, 8), (0.6, 0.3, 4)]  # scores 0.4, 0.025, 0.135
    toks, pars = sibling_leaves(chain, chances, nodes=5, floor=0.05)
    tree.check(toks, pars)
    assert toks == [5, 6, 7, 9, 4] and pars == [-1, 0, 1, -1, 1]
    assert sibling_leaves(chain, chances, nodes=4, floor=0.05) == ([5, 6, 7, 9], [-1, 0, 1, -1])
    assert sibling_leaves(chain, chances, nodes=5, floor=0.2) == ([5, 6, 7, 9], [-1, 0, 1, -1])
    assert sibling_leaves(chain, chances, nodes=2, floor=0.0) == ([5, 6], [-1, 0])  # the chain cut to the budget
    assert sibling_leaves(chain, chances, nodes=3, floor=0.0) == (chain, [-1, 0, 1])


def _accepted_per_verify(trunk, spec, params, window: int) -> float:
    """Decode every prompt with ``spec`` (each output checked equal to plain decoding's, and with a
    tree budget, trees verified); -> drafts accepted per verify over them all."""
    total = verifies = 0
    for prompt in PROMPTS:
        sampler = Sampler(params)
        plain = decode(trunk, sampler, prompt, N_TOKENS)
        st = SpecStats()
        assert decode(trunk, sampler, prompt, N_TOKENS, SpecPlan(spec, window=window), stats=st) == plain
        total += st.accepted
        verifies += st.verify_calls
        if spec.tree:
            assert st.tree_verifies > 0
    return total / verifies


class _SecondGuess:
    """A draft model (the trunk's own weights) whose top two logits are swapped at three positions
    in ten (scattered: at a fixed period a chain and a tree would emit as many tokens per verify):
    its chain is wrong there, and its best other token is the trunk's."""

    def __init__(self, model):
        self._m = model

    def __getattr__(self, name):
        return getattr(self._m, name)

    def forward(self, tokens, cache, **kw):
        out = self._m.forward(tokens, cache, **kw)
        if random.Random(cache.length).random() < 0.3:
            logits = out.logits.clone()
            row = logits[-1]
            top = row.topk(2).indices
            a, b = float(row[top[0]]), float(row[top[1]])
            row[top[0]], row[top[1]] = b, a
            out = type(out)(logits=logits, hidden=out.hidden)
        return out


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, top_k=20, seed=3)],
                         ids=["greedy", "seeded"])
def test_sibling_trees_equal_plain_and_take_the_second_guess(files, trunk, params):
    """With a tree budget the draft model adds its second guesses as leaves; the output stays
    plain's, and where the chain's guess was the wrong one of its top two the sibling is taken."""
    drafter = load_drafter(files["trunk"], trunk)
    accepted = {}
    for tree_nodes in (0, 12):
        # a tiny random model's distributions are flat: every sibling is let in, ranked
        spec = DraftModelSpeculator(_SecondGuess(drafter.model), vocab_size=trunk.vocab_size, max_draft_tokens=5,
                                    tree=tree_nodes, sibling_min=0.0)
        accepted[tree_nodes] = _accepted_per_verify(trunk, spec, params, 5)
    if params.greedy:
        assert accepted[12] > accepted[0] + 0.5, accepted  # the swapped positions no longer end a verify
    else:
        assert accepted[12] >= accepted[0], accepted


def test_a_tree_budget_reaches_the_draft_model_under_either_rule(files, trunk):
    """Its trees carry each node's proposal distribution, so the residual rule verifies them too."""
    drafter = load_drafter(files["related"], trunk)
    plain = REGISTRY.create("draft-model", trunk, SpecOptions(tree=10), drafter)
    assert plain.tree == 10 and not plain.residual
    res = REGISTRY.create("draft-model", trunk, SpecOptions(tree=10, accept="residual"), drafter)
    assert res.tree == 10 and res.residual


def test_best_nodes_keep_the_likeliest_with_their_ancestors():
    from tsspec.spec import tree

    def best_nodes(toks, pars, scores, budget):
        return tree.subtree(toks, pars, tree.best_indices(pars, scores, budget))

    # a(.6) b(.3) under the root; c(.5) d(.06) under a; e(.2) under b; f(.25) under c
    toks, pars = [1, 2, 3, 4, 5, 6], [-1, -1, 0, 0, 1, 2]
    scores = [0.6, 0.3, 0.5, 0.06, 0.2, 0.25]
    assert best_nodes(toks, pars, scores, 4) == ([1, 2, 3, 6], [-1, -1, 0, 2])
    assert best_nodes(toks, pars, scores, 2) == ([1, 3], [-1, 0])
    assert best_nodes(toks, pars, scores, 10) == (toks, pars)
    assert best_nodes(toks, pars, scores, 0) == ([], [])
    # ties go to the earlier node, so a child scored as its parent never comes without it
    assert best_nodes([1, 2, 3], [-1, 0, -1], [0.5, 0.5, 0.5], 2) == ([1, 2], [-1, 0])


class _SwapAt:
    """A draft model (the trunk's own weights) whose top two logits are swapped on every row at a
    position in ``swapped``, whatever forward computes the row (a chain's, or a tree's grown over
    several forwards): there its first guess is wrong and its second is the trunk's token."""

    def __init__(self, model, swapped):
        self._m, self.swapped = model, swapped

    def __getattr__(self, name):
        return getattr(self._m, name)

    def forward(self, tokens, cache, *, all_logits=False, parents=None, base=None, **kw):
        from tsspec.models.runners import chain_layout, tree_layout

        start = cache.length
        lay = chain_layout(start, len(tokens)) if parents is None else tree_layout(start, len(tokens), parents, base)
        out = self._m.forward(tokens, cache, all_logits=all_logits, parents=parents, base=base, **kw)
        logits = out.logits.clone()
        positions = lay.positions if all_logits else lay.positions[-1:]
        for r, pos in enumerate(positions):
            if pos in self.swapped:
                top = logits[r].topk(2).indices
                a, b = float(logits[r, top[0]]), float(logits[r, top[1]])
                logits[r, top[0]], logits[r, top[1]] = b, a
        return type(out)(logits=logits, hidden=out.hidden)


def _swapped_positions(seed=7, rate=0.3, n=400):
    rng = random.Random(seed)
    return {p for p in range(n) if rng.random() < rate}


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, top_k=20, seed=3)],
                         ids=["greedy", "seeded"])
def test_grown_trees_equal_plain_and_draft_past_a_second_guess(files, trunk, params):
    """With a tree budget the draft model grows a tree depth by depth: where its first guess is
    wrong and its second right, the branch under the second guess is drafted too, so a verify runs
    on past it (more than the one extra token a leaf gives); the output stays plain's."""
    drafter = load_drafter(files["trunk"], trunk)
    swapped = _swapped_positions()
    accepted = {}
    for tree_nodes in (0, 16):
        spec = DraftModelSpeculator(_SwapAt(drafter.model, swapped), vocab_size=trunk.vocab_size,
                                    max_draft_tokens=6, tree=tree_nodes, sibling_min=0.0)
        accepted[tree_nodes] = _accepted_per_verify(trunk, spec, params, 6)
        if tree_nodes:
            assert spec.tree_nodes > 0 and spec.forward_rows > spec.forwards  # several rows a depth
    if params.greedy:
        assert accepted[16] > accepted[0] + 1.0, accepted
    else:
        assert accepted[16] >= accepted[0], accepted


def test_a_grown_tree_of_one_branch_is_the_chain(files, trunk):
    """Width 1, one token a node: the tree is the chain the chain code drafts, token for token,
    and the drafter's cache after each commit holds the bits a chain's forwards give."""
    drafter = load_drafter(files["related"], trunk)
    chain = DraftModelSpeculator(drafter.model, vocab_size=trunk.vocab_size, max_draft_tokens=5)
    grown = DraftModelSpeculator(load_drafter(files["related"], trunk).model, vocab_size=trunk.vocab_size,
                                 max_draft_tokens=5, tree=8, tree_width=1, tree_branch=1, sibling_min=0.0)
    seen = []
    for spec in (chain, grown):
        drafts = []
        real = spec.propose
        spec.propose = lambda ctx, real=real, drafts=drafts: (lambda d: (drafts.append(list(d.tokens)), d)[1])(real(ctx))
        for prompt in PROMPTS[:4]:
            assert decode(trunk, Sampler(), prompt, N_TOKENS, SpecPlan(spec, window=5)) == \
                decode(trunk, Sampler(), prompt, N_TOKENS)
        seen.append(drafts)
    assert seen[0] == seen[1] and any(len(d) > 1 for d in seen[0])
    # the drafter's cache holds exactly the committed tokens' rows, as a fresh chain forward gives them
    n = grown.cache.length
    assert n == len(grown.cached_tokens) > 0
    ref = grown.model.make_cache()
    grown.model.forward(grown.cached_tokens, ref)
    assert torch.equal(grown.cache.k[:, :, :n], ref.k[:, :, :n]) and torch.equal(grown.cache.v[:, :, :n], ref.v[:, :, :n])


def test_the_grown_rows_kept_after_a_commit_are_a_chains(files, trunk):
    """After trees are verified, the drafter's cache keeps the accepted path's rows (moved into
    place): every committed row it holds has the bits a fresh forward of those tokens gives."""
    drafter = load_drafter(files["trunk"], trunk)
    spec = DraftModelSpeculator(_SwapAt(drafter.model, _swapped_positions(seed=9)), vocab_size=trunk.vocab_size,
                                max_draft_tokens=6, tree=16, sibling_min=0.0)
    kept = []
    real_commit = spec.commit

    def commit(tokens, hidden, start_pos):
        real_commit(tokens, hidden, start_pos)
        n = spec.cache.length
        assert n == len(spec.cached_tokens)
        ref = drafter.model.make_cache()
        drafter.model.forward(spec.cached_tokens, ref)
        kept.append(torch.equal(spec.cache.k[:, :, :n], ref.k[:, :, :n]))

    spec.commit = commit
    prompt = PROMPTS[3]
    assert decode(trunk, Sampler(), prompt, N_TOKENS, SpecPlan(spec, window=6)) == decode(trunk, Sampler(), prompt, N_TOKENS)
    assert kept and all(kept)


def test_a_drafter_that_cannot_forward_trees_drafts_chains(files, trunk):
    """A recurrent drafter (its forward follows one chain of rows) gets no tree forward: with a tree
    budget it drafts chains, and the output stays plain's."""
    drafter = load_drafter(files["related"], trunk)

    class Recurrent:
        batches_sequences = False

        def __init__(self, model):
            self._m = model

        def __getattr__(self, name):
            return getattr(self._m, name)

        def forward(self, tokens, cache, **kw):
            assert kw.get("parents") is None and kw.get("base") is None, "a tree forward on a recurrent drafter"
            return self._m.forward(tokens, cache, **kw)

    spec = DraftModelSpeculator(Recurrent(drafter.model), vocab_size=trunk.vocab_size, max_draft_tokens=5, tree=12)
    assert not spec.grows
    drafts = []
    real = spec.propose
    spec.propose = lambda ctx: (lambda d: (drafts.append(d), d)[1])(real(ctx))
    for prompt in PROMPTS[:3]:
        assert decode(trunk, Sampler(), prompt, N_TOKENS, SpecPlan(spec, window=5)) == \
            decode(trunk, Sampler(), prompt, N_TOKENS)
    assert drafts and all(d.parents is None for d in drafts) and any(len(d) > 1 for d in drafts)
