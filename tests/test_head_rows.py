"""A drafter's cut vocabulary: the LM head's rows for the first ids and the ids its sequence used.

``HeadRows`` gives each kept id the bits the whole head gives it (native head: a view of the first
rows and a gathered copy of the others; torch head: the whole head, masked) and -inf to the rest; a
draft model that chooses among them drafts only kept ids and stays exact (greedy, seeded, trees).
"""

from __future__ import annotations

import pytest
import torch

from tiny import write_tiny_model
from tsspec.drafters import DrafterOptions, load_drafter
from tsspec.env import draft_vocab
from tsspec.errors import BadInput
from tsspec.models import load_model
from tsspec.models.head_rows import HeadRows
from tsspec.models.protocols import ForwardItem
from tsspec.models.runners import NativeRunner, TorchRunner
from tsspec.options import SpecOptions
from tsspec.sampling import Sampler, SamplingParams
from tsspec.spec import draft_model
from tsspec.spec.draft_model import DraftModelSpeculator
from tsspec.spec.loop import decode
from tsspec.spec.plan import SpecPlan
from tsspec.spec.registry import REGISTRY
from tsspec.settings import resolve_run
from tsspec.spec.stats import SpecStats

PREFIX = 150  # of the tiny files' 300 ids
TOKENS = [72, 101, 108, 108, 111, 260, 261, 32, 290, 7]


def _kept(prefix: int, extra, vocab: int) -> torch.Tensor:
    keep = torch.zeros(vocab, dtype=torch.bool)
    keep[:prefix] = True
    keep[[i for i in extra if i < vocab]] = True
    return keep


@pytest.mark.parametrize("arch, quant", [("qwen2", "Q8_0"), ("llama", "Q4_K"), ("gemma3", "Q8_0"), ("qwen2", None)])
@pytest.mark.parametrize("runner", ["native", "torch"])
def test_kept_ids_have_the_whole_heads_bits_and_the_rest_minus_infinity(tmp_path, arch, quant, runner):
    """gemma3 soft-caps its logits; F32 (quant None) and the torch runner take the masked whole head."""
    m = load_model(write_tiny_model(tmp_path / "m.gguf", arch, seed=3, quant=quant))
    if runner == "torch":
        m.runner = TorchRunner()
    hr = HeadRows(m, PREFIX)
    if runner == "torch":
        assert hr._native is None  # the whole head, masked
    elif quant is not None and isinstance(m.runner, NativeRunner):
        assert hr._native is not None  # the kept rows only
    extra = [290, 260, 299, 100, 260, 5000]  # repeats, one below the prefix, one out of range: ignored
    hr.add(extra)
    hr.add([261])  # a second gather adds to the first
    assert hr.size == PREFIX + 4
    want = m.forward(TOKENS, m.make_cache(), all_logits=True).logits
    got = m.forward(TOKENS, m.make_cache(), all_logits=True, vocab=hr).logits
    keep = _kept(PREFIX, extra + [261], m.cfg.vocab_size)
    assert torch.equal(got[:, keep], want[:, keep])
    assert bool(torch.isneginf(got[:, ~keep]).all())
    last = m.forward(TOKENS, m.make_cache(), vocab=hr).logits  # the last row only
    assert torch.equal(last, got[-1:])


def test_the_native_head_computes_only_the_kept_rows(tmp_path):
    m = load_model(write_tiny_model(tmp_path / "m.gguf", "qwen2", seed=3, quant="Q8_0"))
    hr = HeadRows(m, PREFIX)
    if hr._native is None:
        pytest.skip("the native kernels are not built here (the torch head is masked instead)")
    assert hr._prefix_out.head.n_total == PREFIX and hr._extra_out is None
    hr.add([290, 291])
    assert hr._extra_out.head.n_total == 2
    assert HeadRows(m, 10_000).prefix == m.cfg.vocab_size  # a prefix past the vocabulary is all of it
    with pytest.raises(ValueError):
        HeadRows(m, 0)


def test_one_forward_asks_one_vocabulary(tmp_path):
    m = load_model(write_tiny_model(tmp_path / "m.gguf", "qwen2", seed=3, quant="Q8_0"))
    items = [ForwardItem([1, 2], m.make_cache(), vocab=HeadRows(m, PREFIX)), ForwardItem([3], m.make_cache())]
    with pytest.raises(ValueError, match="different vocabularies"):
        m.forward_batch(items)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("head_rows")
    trunk = load_model(write_tiny_model(d / "trunk.gguf", "qwen2", seed=11, n_layers=3, quant="Q8_0"))
    drafter = load_drafter(write_tiny_model(d / "related.gguf", "qwen2", seed=11, n_layers=2, quant="Q8_0"), trunk)
    return trunk, drafter


PROMPTS = [[72, 101, 108, 108, 111], [260, 261, 32, 100, 101, 102, 290, 291], list(range(40, 110))]


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.95, seed=4)],
                         ids=["greedy", "seeded"])
@pytest.mark.parametrize("tree", [0, 8])
def test_a_cut_drafter_drafts_only_kept_ids_and_equals_plain(pair, params, tree, monkeypatch):
    trunk, drafter = pair
    monkeypatch.setattr(draft_model, "MISS_SHARE", 1.0)  # random weights use every id: never widen here
    spec = DraftModelSpeculator(drafter.model, vocab_size=drafter.trunk_vocab, max_draft_tokens=6, tree=tree,
                                head_prefix=PREFIX)
    written: set[int] = set()  # the prompt's ids and those the trunk wrote, this sequence
    drafted: list[int] = []
    begin, commit, propose = spec.begin, spec.commit, spec.propose

    def spy_begin(prompt, hidden):
        written.clear()
        written.update(prompt)
        return begin(prompt, hidden)

    def spy_commit(tokens, hidden, start_pos):
        written.update(tokens)
        return commit(tokens, hidden, start_pos)

    def spy_propose(ctx):
        d = propose(ctx)
        drafted.extend(d.tokens)
        assert all(t < PREFIX or t in written for t in d.tokens), (d.tokens, sorted(written))
        return d

    spec.begin, spec.commit, spec.propose = spy_begin, spy_commit, spy_propose
    st = SpecStats()
    for prompt in PROMPTS:
        plain = decode(trunk, Sampler(params), prompt, 40)
        assert decode(trunk, Sampler(params), prompt, 40, SpecPlan(spec, window=6), stats=st) == plain
    assert drafted and st.accepted > 0
    spec.reset()
    assert spec._head.size == PREFIX  # forgets the ids its sequences used


def test_a_sequence_that_uses_many_ids_past_the_cut_widens_the_head(pair):
    """The trunk's own tokens decide: a sequence whose written tokens were mostly outside the cut
    (another script's text) turns the head whole (output unchanged), one whose were inside keeps it,
    whatever its prompt held (a prompt's ids are kept from its catch-up on), and each sequence starts
    cut again."""
    trunk, drafter = pair
    cut = 260  # of 300: the random trunk writes ids past it often (about one in eight)
    spec = DraftModelSpeculator(drafter.model, vocab_size=drafter.trunk_vocab, max_draft_tokens=4, head_prefix=cut)
    prompt = list(range(40, 140)) + [270, 280]  # rare ids in the prompt count for nothing
    plain = decode(trunk, Sampler(), prompt, 48)
    lacked = sum(t >= cut and t not in prompt + plain[:i] for i, t in enumerate(plain))
    assert lacked > draft_model.MISS_SHARE * 48  # the trunk wrote enough new ids past the cut
    assert decode(trunk, Sampler(), prompt, 48, SpecPlan(spec, window=4)) == plain
    assert spec._head is None and spec.widened == 1 and "whole in 1 sequences" in spec.report()
    spec.begin(prompt, None)
    assert spec._head is not None and spec._head.size == cut + 2  # cut again, with the prompt's 270 and 280
    spec2 = DraftModelSpeculator(drafter.model, vocab_size=drafter.trunk_vocab, max_draft_tokens=4, head_prefix=cut)
    spec2.commit(list(range(200, 300)) * 2, None, 0)  # written, but each new id lacked once: 100 of 200
    assert spec2._head is None
    spec3 = DraftModelSpeculator(drafter.model, vocab_size=drafter.trunk_vocab, max_draft_tokens=4, head_prefix=cut)
    spec3.commit([5, 6, 7] * 20 + [270], None, 0)  # one of 61 lacked: under the share
    assert spec3._head is not None and spec3._head.keeps(270)


def test_the_cut_travels_from_the_run_settings_through_the_drafter(pair, tmp_path):
    """``TSSPEC_DRAFT_VOCAB`` is read once, into the run's settings, and reaches the speculator
    through ``DrafterOptions`` as the other drafter settings do; unset, the default cut (a
    vocabulary no larger than it is not cut: the tiny files)."""
    trunk, _ = pair
    path = write_tiny_model(tmp_path / "d.gguf", "qwen2", seed=11, n_layers=1, quant="Q8_0")
    for env, want in (({"TSSPEC_DRAFT_VOCAB": "123"}, 123), ({"TSSPEC_DRAFT_VOCAB": "0"}, 0), ({}, 0)):
        cfg = resolve_run(env=env)
        drafter = load_drafter(path, trunk, DrafterOptions(draft_vocab=cfg.draft_vocab))
        spec = REGISTRY.create("draft-model", trunk, SpecOptions(draft=4), drafter)
        assert spec.head_prefix == want and (spec._head is None) == (want == 0)
    assert resolve_run(env={}).draft_vocab is None
    with pytest.raises(BadInput, match="TSSPEC_DRAFT_VOCAB"):
        resolve_run(env={"TSSPEC_DRAFT_VOCAB": "-3"})  # refused at start, before anything loads


@pytest.mark.parametrize("raw, want", [(None, None), ("auto", None), (" 0 ", 0), ("32768", 32768)])
def test_draft_vocab_reads_the_environment(raw, want):
    assert draft_vocab({} if raw is None else {"TSSPEC_DRAFT_VOCAB": raw}) == want


@pytest.mark.parametrize("raw", ["-1", "lots", "1.5", " "])
def test_a_bad_draft_vocab_is_one_line(raw):
    with pytest.raises(BadInput, match="TSSPEC_DRAFT_VOCAB"):
        draft_vocab({"TSSPEC_DRAFT_VOCAB": raw})
