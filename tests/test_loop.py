"""The core guarantee: speculative decoding emits exactly what plain decoding emits.

Every test runs ``decode`` twice on tiny random models, once plain (no speculator) and once with a
speculator, and compares token for token: n-gram drafting over repetitive and random prompts,
scripted drafters that force every rejection pattern (accept none, some, all), random drafts,
seeded sampling, the cost governor, and a target whose verify does not persist its state.
"""

from __future__ import annotations

import random

import pytest

from scripted import ScriptedSpeculator
from tiny import write_tiny_model
from tsspec.spec.plan import SpecPlan
from tsspec.models import load_model
from tsspec.models.cache import KVCache
from tsspec.sampling import Sampler, SamplingParams
from tsspec.spec.governor import FIRST_DRAFT, GovernorConfig, SpeculationCostGovernor
from tsspec.spec.loop import PREFILL_CHUNK, Run, DecodeState, decode, decode_batched, decode_interleaved, step_together
from tsspec.spec.ngram import NGramSpeculator
from tsspec.spec.protocols import Draft, DraftContext, Speculator
from tsspec.spec.stats import SpecStats

N_NEW = 48
WINDOWS = (1, 3, 8)
MODEL_ARCHS = ("llama", "qwen2", "gemma3")


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("loop_models")
    return {a: load_model(write_tiny_model(d / f"{a}.gguf", a, seed=7, ctx=512)) for a in MODEL_ARCHS}


def _prompts() -> dict[str, list[int]]:
    rng = random.Random(0)
    return {
        "random": [rng.randrange(300) for _ in range(20)],
        "periodic": [5, 6, 7, 8] * 6,
        "one-token-run": [42] * 12,
        "phrase": [100, 101, 102, 103, 104, 50, 100, 101, 102, 103, 104, 60, 100, 101],
        "short": [3],
        "long-random": [rng.randrange(300) for _ in range(90)],  # crosses a 64-position span
    }


PROMPTS = _prompts()
GREEDY = Sampler()


def sampled(seed: int) -> Sampler:
    return Sampler(SamplingParams(temperature=0.8, top_k=20, top_p=0.9, repeat_penalty=1.1, seed=seed))


def plain(model, prompt, sampler=GREEDY, n=N_NEW) -> list[int]:
    return decode(model, sampler, prompt, n)


def check_stats(stats: SpecStats, out: list[int], drafts: list[int] | None = None) -> None:
    """The counters add up: each verify emits accepted + 1, each plain step 1, prefill the first."""
    assert sum(stats.accept_hist) == stats.verify_calls
    assert sum(i * c for i, c in enumerate(stats.accept_hist)) == stats.accepted
    assert stats.accepted <= stats.drafted
    assert stats.verify_emitted == stats.accepted + stats.verify_calls
    assert len(out) == stats.generated == stats.accepted + stats.verify_calls + stats.plain_steps + 1
    if drafts is not None:
        assert stats.drafted == sum(drafts) and stats.verify_calls == len(drafts)


# ----------------------------------------------------------------------------- test speculators


class RandomSpeculator(ScriptedSpeculator):
    """Drafts uniformly random tokens: almost everything is rejected."""

    name = "random"

    def __init__(self, vocab: int, seed: int, max_draft_tokens: int = 8):
        super().__init__([], None, vocab, max_draft_tokens)
        self.rng = random.Random(seed)

    def propose(self, ctx: DraftContext) -> Draft:
        k = min(ctx.max_tokens, self.max_draft_tokens)
        self.drafts.append(k)
        self._pending = True
        return Draft([self.rng.randrange(self.vocab) for _ in range(k)])


def test_test_speculators_follow_the_protocol():
    assert isinstance(ScriptedSpeculator([], lambda s, i: False, 10), Speculator)
    assert isinstance(NGramSpeculator(), Speculator)


# ----------------------------------------------------------------------------- n-gram == plain


@pytest.mark.parametrize("arch", MODEL_ARCHS)
@pytest.mark.parametrize("window", WINDOWS)
def test_ngram_greedy_equals_plain(models, arch, window):
    m = models[arch]
    total_drafted = total_accepted = total_rejected_verifies = 0
    for name, prompt in PROMPTS.items():
        want = plain(m, prompt)
        stats = SpecStats()
        spec = NGramSpeculator(max_draft_tokens=8)
        got = decode(m, GREEDY, prompt, N_NEW, SpecPlan(spec, window=window), stats=stats)
        assert got == want, f"prompt {name!r}"
        check_stats(stats, got)
        assert max(len(stats.accept_hist) - 1, 0) <= window
        total_drafted += stats.drafted
        total_accepted += stats.accepted
        total_rejected_verifies += stats.verify_calls - (stats.accept_hist[window] if len(stats.accept_hist) > window else 0)
    # the prompts make n-gram draft a lot, and be both right and wrong
    assert total_drafted > 50 and 0 < total_accepted < total_drafted and total_rejected_verifies > 0


@pytest.mark.parametrize("arch", MODEL_ARCHS)
def test_ngram_stops_early_like_plain(models, arch):
    m = models[arch]
    prompt = PROMPTS["periodic"]
    want = plain(m, prompt)
    stop_tok = want[20]  # stop at the first occurrence of a token that appears in the output
    cut = want[: want.index(stop_tok) + 1]
    stats = SpecStats()
    got = decode(m, GREEDY, prompt, N_NEW, SpecPlan(NGramSpeculator(), window=8), stats=stats, on_token=lambda t: t == stop_tok)
    assert got == cut
    assert plain_stop(m, prompt, stop_tok) == cut


def plain_stop(m, prompt, stop_tok):
    return decode(m, GREEDY, prompt, N_NEW, on_token=lambda t: t == stop_tok)


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 9, 10])
def test_token_budget_is_exact(models, max_tokens):
    m = models["llama"]
    prompt = PROMPTS["one-token-run"]
    want = plain(m, prompt, n=max_tokens)
    assert len(want) == max_tokens
    stats = SpecStats()
    got = decode(m, GREEDY, prompt, max_tokens, SpecPlan(NGramSpeculator(), window=8), stats=stats)
    assert got == want
    check_stats(stats, got)


# ----------------------------------------------------------------------------- forced rejection patterns


PATTERNS = {
    "accept-all": lambda step, i: False,
    "accept-none": lambda step, i: i == 0,
    "accept-some": lambda step, i: i == step % 5,  # 0, 1, 2, 3, 4 accepted in turn (or all if shorter)
    "accept-last-only-wrong": lambda step, i: i == 7,
    "every-other": lambda step, i: step % 2 == 1 and i == 2,
}


@pytest.mark.parametrize("arch", MODEL_ARCHS)
@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("window", WINDOWS)
def test_scripted_rejections_equal_plain(models, arch, pattern, window):
    m = models[arch]
    for prompt in (PROMPTS["random"], PROMPTS["long-random"]):
        want = plain(m, prompt)
        spec = ScriptedSpeculator(prompt + want, PATTERNS[pattern], m.vocab_size)
        stats = SpecStats()
        got = decode(m, GREEDY, prompt, N_NEW, SpecPlan(spec, window=window), stats=stats)
        assert got == want
        check_stats(stats, got, spec.drafts)
        # each verify accepted exactly up to the first corrupted draft token
        expect = [k if w is None else w for k, w in zip(spec.drafts, spec.wrong_at)]
        assert spec.accepted == expect
        if pattern == "accept-all":
            # only a last step with a one-token budget left runs plain (nothing to draft into)
            assert stats.accepted == stats.drafted and stats.plain_steps <= 1
        if pattern == "accept-none":
            assert stats.accepted == 0 and stats.accept_hist == [stats.verify_calls]


@pytest.mark.parametrize("arch", MODEL_ARCHS)
def test_random_drafts_equal_plain(models, arch):
    m = models[arch]
    for seed, prompt in enumerate(PROMPTS.values()):
        want = plain(m, prompt)
        spec = RandomSpeculator(m.vocab_size, seed)
        stats = SpecStats()
        got = decode(m, GREEDY, prompt, N_NEW, SpecPlan(spec, window=8), stats=stats)
        assert got == want
        check_stats(stats, got, spec.drafts)
        assert stats.plain_steps <= 1


# ----------------------------------------------------------------------------- seeded sampling


@pytest.mark.parametrize("arch", MODEL_ARCHS)
@pytest.mark.parametrize("window", WINDOWS)
def test_seeded_sampling_equals_plain(models, arch, window):
    m = models[arch]
    for seed, (name, prompt) in enumerate(PROMPTS.items()):
        want = plain(m, prompt, sampled(seed))
        if window == 1 and name == "random":
            assert want != plain(m, prompt, sampled(seed + 100))  # the seed matters
        stats = SpecStats()
        got = decode(m, sampled(seed), prompt, N_NEW, SpecPlan(NGramSpeculator(), window=window, accept_rule="match"), stats=stats)
        assert got == want, f"prompt {name!r}"
        check_stats(stats, got)
        spec = ScriptedSpeculator(prompt + want, PATTERNS["accept-some"], m.vocab_size)
        got = decode(m, sampled(seed), prompt, N_NEW, SpecPlan(spec, window=window, accept_rule="match"))
        assert got == want
        assert spec.accepted == [k if w is None else w for k, w in zip(spec.drafts, spec.wrong_at)]


# ----------------------------------------------------------------------------- governor


@pytest.mark.parametrize("arch", MODEL_ARCHS)
def test_governor_keeps_output_identical(models, arch):
    m = models[arch]
    # a short park so one run sees probing, parking and re-probing
    cfg = GovernorConfig(window=4, recent=2, probe_spec=1, probe_plain=1, warmup=0, hold_steps=4,
                         park_base=2, park_cap=4)
    for name in ("random", "periodic", "phrase"):
        prompt = PROMPTS[name]
        want = plain(m, prompt)
        for spec in (NGramSpeculator(), RandomSpeculator(m.vocab_size, 1)):
            for gov in (SpeculationCostGovernor(), SpeculationCostGovernor(cfg)):
                stats = SpecStats()
                got = decode(m, GREEDY, prompt, N_NEW, SpecPlan(spec, governor=gov, window=8), stats=stats)
                assert got == want
                check_stats(stats, got)
                assert gov.steps == stats.verify_calls + stats.plain_steps


# ----------------------------------------------------------------------------- rollback is the cache's


class PoisonedTrim(KVCache):
    """A KV cache whose ``trim`` overwrites the forgotten rows with garbage, so a loop that trimmed
    too little, or read a row it had trimmed, would change the output. (Finite garbage: attention
    multiplies masked rows by an exact 0, and 0 * NaN would poison every run.)"""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.trims: list[int] = []

    def trim(self, n):
        self.trims.append(n)
        self.k[:, :, self.length - n : self.length] = 1e3
        self.v[:, :, self.length - n : self.length] = -1e3
        super().trim(n)


@pytest.mark.parametrize("pattern", ["accept-some", "accept-none", "accept-all"])
def test_loop_trims_exactly_the_rejected_rows(models, pattern):
    m = models["qwen2"]
    prompt = PROMPTS["random"]
    want = plain(m, prompt)
    cfg = m.cfg
    cache = PoisonedTrim(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, m.max_context)
    spec = ScriptedSpeculator(prompt + want, PATTERNS[pattern], m.vocab_size)
    stats = SpecStats()
    got = decode(m, GREEDY, prompt, N_NEW, SpecPlan(spec, window=8), cache=cache, stats=stats)
    assert got == want
    check_stats(stats, got, spec.drafts)
    # one trim per verify, of exactly its rejected drafts
    assert cache.trims == [k - a for k, a in zip(spec.drafts, spec.accepted)]
    if pattern == "accept-all":
        assert set(cache.trims) == {0}
    else:
        assert max(cache.trims) > 0


def test_governed_draft_length_shrinks_on_rejection_and_grows_back(models):
    """With the governor on, the drafts follow the recent verifies: after a short first draft, a
    speculator whose guesses are always wrong is held to 1-token drafts, one whose guesses are right
    drafts the whole window (on these tiny models a verify row costs a small part of a step); the
    output is plain's either way."""
    m = models["llama"]
    prompt = PROMPTS["periodic"]
    want = plain(m, prompt)
    never_park = GovernorConfig(margin=1e9, recent_margin=1e9)  # isolate the sizing from parking
    bad = ScriptedSpeculator(prompt + want, lambda s, i: i == 0, m.vocab_size)
    got = decode(m, GREEDY, prompt, N_NEW, SpecPlan(bad, governor=SpeculationCostGovernor(never_park), window=8))
    assert got == want
    # held to 1-token drafts (sizing reads measured times: one noisy step on a shared machine may
    # let a 2 through, so the last five are read by their majority)
    assert bad.drafts[0] == FIRST_DRAFT and bad.drafts[-5:].count(1) >= 4 and max(bad.drafts[-5:]) <= 2
    good = ScriptedSpeculator(prompt + want, lambda s, i: False, m.vocab_size)
    got = decode(m, GREEDY, prompt, N_NEW, SpecPlan(good, governor=SpeculationCostGovernor(never_park), window=8))
    assert got == want
    assert good.drafts[0] == FIRST_DRAFT
    # the second draft has no plain time to weigh rows against yet; the last may be cut by the budget
    assert all(d == 8 for d in good.drafts[2:-1]) and len(good.drafts) > 4
    ungoverned = ScriptedSpeculator(prompt + want, lambda s, i: i == 0, m.vocab_size)
    decode(m, GREEDY, prompt, N_NEW, SpecPlan(ungoverned, window=8))
    assert set(ungoverned.drafts[:-8]) == {8}  # without a governor the window is what it says (the
    # last drafts run into the end of the known continuation)


class EmptyDrafts:
    """A speculator that is asked every time and never drafts (a head whose gate cuts every draft)."""

    name = "empty"
    needs_hidden_state = False
    can_arm_after_prefix_reuse = True
    default_accept_rule = "match"

    def __init__(self):
        self.asked = 0

    def begin(self, prompt, hidden):
        pass

    def propose(self, ctx):
        self.asked += 1
        return Draft()

    def commit(self, tokens, hidden, start_pos):
        pass


class AlternatingGovernor:
    """Says draft on every other step and keeps what the loop reports."""

    state, parks = "probing", 0

    def __init__(self):
        self.asks, self.records = 0, []

    def should_draft(self):
        self.asks += 1
        return self.asks % 2 == 1

    def draft_length(self, window):
        return window

    def min_draft_prob(self):
        return None

    def begin_sequence(self):
        pass

    def record(self, speculative, ms, tokens, drafted=None, setup_ms=0.0, shared=1):
        self.records.append((speculative, tokens, drafted))


def test_a_proposal_that_drafts_nothing_is_reported_as_speculation(models):
    """Its proposal cost time (a head's step), so the governor gets it as a speculative step that
    drafted 0 tokens; reported as plain, it made the plain baseline slower than plain decoding is."""
    m = models["llama"]
    prompt = PROMPTS["periodic"]
    spec, gov = EmptyDrafts(), AlternatingGovernor()
    assert decode(m, GREEDY, prompt, 10, SpecPlan(spec, governor=gov)) == plain(m, prompt, n=10)
    steps = gov.records  # 9 steps after the prefill's token
    assert len(steps) == 9 and spec.asked == 4
    assert steps[0:8:2] == [(True, 1, 0)] * 4  # asked: speculative, drafted 0
    assert steps[1:8:2] == [(False, 1, 0)] * 4  # not asked: plain
    # the last step had the governor's yes but a budget of one token, so no room for a draft: the
    # speculator was not asked, and the step is plain
    assert steps[8] == (False, 1, 0)


# ----------------------------------------------------------------------------- many sequences, one model


def run_interleaved(model, jobs, n=N_NEW) -> list[list[int]]:
    """Decode several sequences on one loaded model, one step of each in turn: ``jobs`` is a list
    of (prompt, sampler, speculator or None, window)."""
    seqs = [DecodeState(model, sampler, SpecPlan(spec, window=window)) for _, sampler, spec, window in jobs]
    return decode_interleaved(seqs, [prompt for prompt, *_ in jobs], n)


def interleaving_jobs(model):
    """Four sequences that differ in prompt, sampler, speculator and window."""
    jobs = [
        (PROMPTS["periodic"], GREEDY, NGramSpeculator(max_draft_tokens=8), 8),
        (PROMPTS["random"], sampled(3), None, 8),
        (PROMPTS["phrase"], sampled(5), NGramSpeculator(max_draft_tokens=3), 3),
        (PROMPTS["long-random"], GREEDY, NGramSpeculator(max_draft_tokens=4), 4),
    ]
    alone = [decode(model, sampler, prompt, N_NEW, SpecPlan(spec, window=window))
             for prompt, sampler, spec, window in jobs]
    return jobs, alone


@pytest.mark.parametrize("arch", MODEL_ARCHS)
def test_sequences_interleaved_on_one_model_equal_each_alone(models, arch):
    m = models[arch]
    jobs, alone = interleaving_jobs(m)
    for (prompt, sampler, *_), out in zip(jobs, alone):
        assert out == plain(m, prompt, sampler)  # each alone is plain decoding
    assert run_interleaved(m, jobs) == alone


@pytest.mark.parametrize("arch", MODEL_ARCHS)
def test_extending_a_kept_cache_equals_a_fresh_run(models, arch):
    """A conversation's second turn: the cache kept from the first run holds the prompt and the
    generated tokens but the last; the next prompt extends that, and only the new tokens are
    forwarded. The result equals a fresh run over the whole concatenated prompt."""
    m = models[arch]
    first = PROMPTS["random"]
    cache = m.make_cache()
    out1 = decode(m, GREEDY, first, 20, SpecPlan(NGramSpeculator()), cache=cache)
    assert cache.length == len(first) + len(out1) - 1
    turn2 = first + out1 + PROMPTS["phrase"]
    stats = SpecStats()
    got = decode(m, GREEDY, turn2, N_NEW, SpecPlan(NGramSpeculator()), cache=cache, stats=stats)
    assert got == plain(m, turn2)
    assert cache.length == len(turn2) + len(got) - 1
    # a speculator that cannot arm after a reused prefix is left out, never wrong
    class NoReuse(ScriptedSpeculator):
        can_arm_after_prefix_reuse = False

    cache = m.make_cache()
    decode(m, GREEDY, first, 20, cache=cache)
    stats = SpecStats()
    spec = NoReuse(turn2 + got, lambda s, i: False, m.vocab_size)
    assert decode(m, GREEDY, turn2, N_NEW, SpecPlan(spec), cache=cache, stats=stats) == got
    assert stats.speculator is None and spec.drafts == []
    with pytest.raises(ValueError):  # a prompt that does not extend the cache
        decode(m, GREEDY, first[:3], 4, cache=cache)


# ----------------------------------------------------------------------------- many sequences, one forward


class CountingForwards:
    """Wraps a model and counts its forwards and shared forwards (and the rows of each)."""

    def __init__(self, model):
        self.model = model
        self.lone, self.shared = 0, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward(self, *a, **kw):
        self.lone += 1
        return self.model.forward(*a, **kw)

    def forward_batch(self, items):
        self.shared.append([len(it.tokens) for it in items])
        return self.model.forward_batch(items)


def batched_jobs(model):
    """Six sequences: plain and n-gram, greedy and seeded, different windows, prompts and budgets."""
    return [
        (PROMPTS["periodic"], GREEDY, NGramSpeculator(max_draft_tokens=8), 8, N_NEW),
        (PROMPTS["random"], sampled(3), None, 8, N_NEW),
        (PROMPTS["phrase"], sampled(5), NGramSpeculator(max_draft_tokens=3), 3, 30),
        (PROMPTS["long-random"], GREEDY, NGramSpeculator(max_draft_tokens=4), 4, N_NEW),
        (PROMPTS["short"], GREEDY, None, 8, 7),
        (PROMPTS["one-token-run"], sampled(9), NGramSpeculator(max_draft_tokens=5), 5, N_NEW),
    ]


@pytest.mark.parametrize("arch", MODEL_ARCHS)
@pytest.mark.parametrize("fmt", ["auto", "f32"])
def test_sequences_batched_in_one_forward_equal_each_alone(models, tmp_path, arch, fmt):
    """decode_batched: each step's rows of every live sequence (plain rows and verifies) go through
    one shared forward, and every sequence emits exactly what it emits decoded alone."""
    m = models[arch] if fmt == "auto" else load_model(models[arch].path, fmt=fmt)
    jobs = batched_jobs(m)
    alone = [decode(m, sampler, prompt, n, SpecPlan(spec, window=window)) for prompt, sampler, spec, window, n in jobs]
    counting = CountingForwards(m)
    fresh = batched_jobs(m)  # new speculator instances: each sequence owns its own
    seqs = [DecodeState(counting, sampler, SpecPlan(spec, window=window)) for _, sampler, spec, window, _ in fresh]
    got = decode_batched(seqs, [job[0] for job in fresh], [job[4] for job in fresh])
    assert got == alone
    # the steps really were shared, mixing 1-row and multi-row items (lone forwards: the prefills,
    # and the steps of the last sequence left)
    assert counting.shared and max(len(x) for x in counting.shared) == len(jobs)
    assert any(1 in x and max(x) > 1 for x in counting.shared)
    assert counting.shared[0] == [len(job[0]) for job in jobs]  # every prompt's prefill in one forward
    for seq, out in zip(seqs, got):
        check_stats(seq.stats, out)


def test_batched_on_a_target_without_shared_forwards(models):
    """A target that has no forward_batch (or says batches_sequences False) is stepped one forward
    per sequence, with the same tokens."""
    m = models["qwen2"]

    class Plain:  # only the SpecTarget surface
        def __init__(self, inner):
            self.inner = inner
            self.vocab_size, self.n_layers, self.hidden_size = inner.vocab_size, inner.n_layers, inner.hidden_size
            self.max_context = inner.max_context

        def make_cache(self):
            return self.inner.make_cache()

        def forward(self, *a, **kw):
            return self.inner.forward(*a, **kw)

    jobs = batched_jobs(m)
    alone = [decode(m, sampler, prompt, n, SpecPlan(spec, window=window)) for prompt, sampler, spec, window, n in jobs]
    fresh = batched_jobs(m)
    seqs = [DecodeState(Plain(m), sampler, SpecPlan(spec, window=window)) for _, sampler, spec, window, _ in fresh]
    assert decode_batched(seqs, [job[0] for job in fresh], [job[4] for job in fresh]) == alone


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_sequence_joining_mid_flight_prefills_beside_the_others_steps(models, arch):
    """What a server does: runs that are decoding keep stepping while a newcomer's long prompt goes
    through in chunks inside the same shared forwards; then all step together. Everyone's tokens
    are their lone ones."""
    m = models[arch]
    rng = random.Random(12)
    long_prompt = [rng.randrange(300) for _ in range(PREFILL_CHUNK + 60)]  # two chunks
    jobs = [(PROMPTS["periodic"], GREEDY, NGramSpeculator(max_draft_tokens=4), 30),
            (PROMPTS["random"], sampled(4), None, 30),
            (long_prompt, sampled(8), NGramSpeculator(max_draft_tokens=6), 30)]
    alone = [decode(m, sampler, prompt, n, SpecPlan(spec, window=6)) for prompt, sampler, spec, n in jobs]
    counting = CountingForwards(m)
    runs = [Run(DecodeState(counting, sampler, SpecPlan(type(spec)(max_draft_tokens=spec.max_draft_tokens)
                    if spec else None, window=6)), prompt, n) for prompt, sampler, spec, n in jobs]
    runs[0].begin()
    runs[1].begin()
    for _ in range(5):
        step_together([r for r in runs[:2] if not r.done])
    runs[2].begin()
    while any(not r.done for r in runs):
        step_together([r for r in runs if not r.done])
    assert [r.finish() for r in runs] == alone
    # the newcomer's two chunks rode in forwards with the others' steps
    assert any(x[-1] == PREFILL_CHUNK and len(x) == 3 for x in counting.shared)
    assert any(x[-1] == 60 and len(x) == 3 for x in counting.shared)


@pytest.mark.real_model
def test_real_model_batched_equals_each_alone(real_model_path, real_model_threads):
    """smollm2-135m on its own weights (native fused path): four sequences, n-gram and plain,
    greedy and seeded, decoded with shared forwards, each equal to its lone run."""
    m = load_model(real_model_path("smollm2-135m"), n_ctx=512)
    base = [1, 504, 3458, 282, 4649, 314, 7042, 30, 378, 3458, 282, 4649, 314]
    prompts = [base, base[:5] * 3, list(range(200, 240)), base[::-1]]
    samplers = [GREEDY, sampled(1), GREEDY, sampled(2)]
    specs = lambda: [NGramSpeculator(max_draft_tokens=6), None, NGramSpeculator(max_draft_tokens=4), None]  # noqa: E731
    alone = [decode(m, s, p, 40, SpecPlan(sp, window=6)) for p, s, sp in zip(prompts, samplers, specs())]
    seqs = [DecodeState(m, s, SpecPlan(sp, window=6)) for s, sp in zip(samplers, specs())]
    assert decode_batched(seqs, prompts, 40) == alone


class SharedSpy(SpeculationCostGovernor):
    """A governor that keeps the ``shared`` count of every step reported to it."""

    def __init__(self):
        super().__init__()
        self.shared: list[int] = []

    def record(self, *a, shared: int = 1, **kw):
        self.shared.append(shared)
        super().record(*a, shared=shared, **kw)


def test_steps_taken_together_tell_each_governor_how_many_sequences_shared_them(models):
    """A draft's rows delay every sequence stepping beside it, so ``step_together`` reports to each
    governor how many runs were decoding in the step (prompt chunks riding along are not counting);
    a run decoding alone reports 1."""
    m = models["llama"]
    rng = random.Random(3)
    long_prompt = [rng.randrange(300) for _ in range(PREFILL_CHUNK + 10)]
    jobs = [(PROMPTS["periodic"], 24), (PROMPTS["phrase"], 24), (long_prompt, 12)]
    spies = [SharedSpy() for _ in jobs]
    runs = [Run(DecodeState(m, GREEDY, SpecPlan(NGramSpeculator(max_draft_tokens=4), spy, window=4)), p, n)
            for (p, n), spy in zip(jobs, spies)]
    expected: list[list[int]] = [[] for _ in jobs]
    runs[0].begin()
    runs[1].begin()
    for _ in range(3):
        step_together([r for r in runs[:2] if not r.done])
    runs[2].begin()
    while any(not r.done for r in runs):
        live = [r for r in runs if not r.done]
        decoding = sum(1 for r in live if not r.seq.prefilling)
        for r in live:
            if not r.seq.prefilling:
                expected[runs.index(r)].append(decoding)
        step_together(live)
    for spy, want in zip(spies, expected):
        assert spy.shared[-len(want):] == want
    assert {2, 3} <= set(expected[0])  # beside one run, then beside two
    alone = SharedSpy()
    decode(m, GREEDY, PROMPTS["periodic"], 16, SpecPlan(NGramSpeculator(max_draft_tokens=4), alone, window=4))
    assert alone.shared and set(alone.shared) == {1}
