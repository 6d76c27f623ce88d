"""The cascade speculator: n-gram first, the model drafter where n-gram has nothing.

Shown on tiny random-weight files: output identical to plain decoding (greedy and seeded), with a
draft model and with a block drafter (whose taps the cascade hands on); each member's counts; the
model drafter kept in step with what landed while n-gram won; the registry's two spellings
(``cascade``, a comma list) and their refusals; the environment's spelling.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from tiny import write_tiny_model
from tiny_dflash import write_tiny_dflash
from tsspec.drafters import load_drafter
from tsspec.errors import BadInput
from tsspec.models import load_model
from tsspec.options import SpecOptions, resolve as resolve_spec_options
from tsspec.sampling import Sampler, SamplingParams
from tsspec.spec.cascade import CascadeSpeculator, bench_length, costs_more, gives_way, landed_share
from tsspec.spec.loop import decode
from tsspec.spec.plan import SpecPlan
from tsspec.spec.registry import REGISTRY, SpeculatorDeclined
from tsspec.spec.stats import SpecStats

# repeats itself (n-gram finds matches) and then goes on (where it finds none)
PROMPTS = [
    [40, 41, 42, 43, 44, 45, 40, 41, 42, 43, 44, 45, 40, 41],
    list(range(60, 90)) + list(range(60, 75)),
    [7, 8, 9],
]
N_TOKENS = 40
SAMPLERS = [SamplingParams(), SamplingParams(temperature=0.8, top_k=40, seed=5)]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cascade")
    trunk = write_tiny_model(d / "trunk.gguf", "qwen2", seed=11, n_layers=3)
    return {
        "trunk": trunk,
        "related": write_tiny_model(d / "related.gguf", "qwen2", seed=11, n_layers=2),
        "dflash": write_tiny_dflash(d / "dflash.gguf", trunk),
    }


@pytest.fixture(scope="module")
def trunk(files):
    return load_model(files["trunk"])


@pytest.mark.parametrize("params", SAMPLERS, ids=["greedy", "seeded"])
def test_ngram_then_draft_model_equals_plain_and_counts_each_member(files, trunk, params):
    drafter = load_drafter(files["related"], trunk)
    won = {"ngram": 0, "draft-model": 0}
    # one cascade for every prompt, as an engine keeps it: its counts are each sequence's own
    spec = REGISTRY.create("ngram,draft-model", trunk, SpecOptions(draft=6), drafter)
    for prompt in PROMPTS:
        assert isinstance(spec, CascadeSpeculator) and spec.names == ["ngram", "draft-model"]
        plain = decode(trunk, Sampler(params), prompt, N_TOKENS)
        st = SpecStats()
        out = decode(trunk, Sampler(params), prompt, N_TOKENS, SpecPlan(spec, window=6), stats=st)
        assert out == plain
        m = st.members
        assert list(m) == ["ngram", "draft-model"]
        assert sum(c["won"] for c in m.values()) == st.verify_calls
        assert sum(c["drafted"] for c in m.values()) == st.drafted
        assert sum(c["accepted"] for c in m.values()) == st.accepted
        # the model drafter is asked only where n-gram did not win, and not while benched
        dmc = m["draft-model"]
        assert dmc["proposals"] + dmc["benched"] == m["ngram"]["proposals"] - m["ngram"]["won"]
        assert m["ngram"]["benched"] == 0  # the first member is never benched
        for k in won:
            won[k] += m[k]["won"]
        # whoever proposed, the draft model holds only what the trunk kept
        dm = spec.members[1]
        assert dm._committed == (prompt + out)[: len(dm._committed)]
    assert won["ngram"] > 0 and won["draft-model"] > 0, won


def test_block_drafter_member_gets_its_taps(files, trunk):
    target = load_model(files["trunk"], fmt="bf16")
    drafter = load_drafter(files["dflash"], target)
    spec = REGISTRY.create("ngram,block", target, SpecOptions(draft=6, pmin=0.0), drafter)
    assert spec.needs_hidden_state and spec.taps == tuple(sorted(drafter.taps))
    assert spec.tap_horizon == spec.members[1].tap_horizon
    asked = 0
    for prompt in PROMPTS:
        plain = decode(target, Sampler(), prompt, N_TOKENS)
        st = SpecStats()
        assert decode(target, Sampler(), prompt, N_TOKENS, SpecPlan(spec, window=6), stats=st) == plain
        assert st.members["block"]["proposals"] + st.members["block"]["benched"] > 0
        asked += st.members["block"]["proposals"]
    assert asked > 0  # (a random-weight drafter loses, so its bench may carry over the later prompts)


def test_the_slices_are_each_members_own_columns():
    import torch

    class Reader:
        name, max_draft_tokens, min_draft_prob, default_min_draft_prob = "r", 4, 0.0, 0.0
        needs_hidden_state, can_arm_after_prefix_reuse = True, True

        def __init__(self, taps):
            self.taps, self.seen = taps, None

        def begin(self, prompt, hidden):
            self.seen = hidden

    a, b = Reader((5,)), Reader((2, 9))
    c = CascadeSpeculator([a, b])
    assert c.taps == (2, 5, 9)
    rows = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 12)  # 2 rows, taps 2, 5, 9 of d = 4
    c.begin([1, 2], rows)
    assert torch.equal(a.seen, rows[:, 4:8])
    assert torch.equal(b.seen, torch.cat([rows[:, 0:4], rows[:, 8:12]], dim=1))


def test_bench_length_doubles_and_caps():
    assert [bench_length(k) for k in range(6)] == [0, 4, 8, 16, 32, 64]
    assert bench_length(40) == 256 and bench_length(3, base=1, cap=3) == 3
    # a loss that paid a 1,200 ms catch-up, plain at 45 ms a token: 3% of the time sat out
    assert bench_length(1, setup_ms=1200.0, plain_ms_per_token=45.0) == 889
    assert bench_length(1, setup_ms=1e7, plain_ms_per_token=45.0) == 4096  # capped
    assert bench_length(1, setup_ms=1200.0) == 4  # no plain time measured: the plain rule
    assert bench_length(6, setup_ms=10.0, plain_ms_per_token=45.0) == 128  # the streak's rule is longer


class Scripted:
    """A member that proposes what its script says, with a setup cost, and counts what it is told."""

    max_draft_tokens, min_draft_prob, default_min_draft_prob = 4, 0.0, 0.0
    needs_hidden_state, can_arm_after_prefix_reuse, taps = False, True, ()

    def __init__(self, name, script, setup_ms=0.0):
        self.name, self.script, self.setup_ms = name, script, setup_ms
        self.asked = 0
        self.commits = 0

    def begin(self, prompt, hidden):
        pass

    def propose(self, ctx):
        from tsspec.spec.protocols import Draft

        self.asked += 1
        return Draft(list(self.script(self.asked)), setup_ms=self.setup_ms)

    def commit(self, tokens, hidden, start_pos):
        self.commits += 1

    def reset(self):
        pass


def test_a_model_member_is_benched_on_what_its_steps_cost_not_on_one_miss():
    """A model member's draft that lands nothing does not bench it alone; the cost per emitted token
    of the steps it won against the plain-like steps does (4, then 8 proposals), while the first
    member is asked every step and every member sees every commit; steps that pay end the streak,
    and one miss among them benches nothing. The model member's setup is not passed on to the
    governor, the first member's is."""
    from tsspec.spec.protocols import DraftContext

    clock = Clock()
    cheap = Scripted("cheap", lambda k: [1, 2] if k == 6 else [], setup_ms=0.5)
    model = Scripted("model", lambda k: [7, 8], setup_ms=1.0)
    c = CascadeSpeculator([cheap, model], clock=clock)
    c.begin([1, 2, 3], None)
    c._plain_steps.extend([(50.0, 1)] * 4)  # as the governor's probe leaves them
    lands = {17: 2, 18: 2}  # the model's drafts land nothing but at these asks

    def step():
        d = c.propose(DraftContext(last_token=3, position=3, max_tokens=4, history=[1, 2, 3]))
        won = c._winner
        landed = lands.get(c._asks, 0) if won == 1 else 2 if won == 0 else 0
        clock.t += (120.0 if won == 1 and not landed else 60.0 if won is not None else 50.0) / 1000.0
        c.commit([0] * (landed + 1), None, 3)
        return d

    d = step()  # ask 1: cheap has nothing, the model drafts and misses: no verdict on one step
    assert d.tokens == [7, 8] and d.setup_ms == 0.5  # the model's catch-up is its step's cost
    assert c._benched_until[1] == 0
    step()  # ask 2: asked again, misses: 120 ms a token against plain's 50, benched for 4 asks
    assert model.asked == 2 and c._benched_until[1] == 2 + 4
    for _ in range(3, 7):
        step()
    m = c.member_stats()
    # benched counts the asks it sat out where it would have been asked (not ask 6, the cheap one's)
    assert model.asked == 2 and m["model"]["benched"] == 3 and m["cheap"]["won"] == 1
    assert cheap.asked == 6 and cheap.commits == model.commits == 6
    step(), step()  # asks 7 and 8: two misses again, the second loss in a row: 8 asks benched
    assert model.asked == 4 and c._benched_until[1] == 8 + 8
    for _ in range(9, 17):
        step()
    assert model.asked == 4 and m["model"]["benched"] == 3 + 8
    step(), step()  # asks 17 and 18: its drafts land 2 tokens each in 60 ms: they pay, the streak ends
    assert model.asked == 6 and m["model"]["accepted"] == 4 and c._streak[1] == 0
    step()  # ask 19: a miss among paying steps (240 ms for 7 tokens against 50 a token): no bench
    assert c._benched_until[1] == 16 and model.asked == 7
    c._lost(1)  # a loss: benched to ask 19 + 4
    c.begin([1], None)  # a new sequence: its own counts, but the bench carries on (as a park does)
    assert c.member_stats()["model"]["benched"] == 0 and c._benched_until[1] == 19 + 4
    step()
    assert model.asked == 7 and c.member_stats()["model"]["benched"] == 1
    c.reset()  # forget everything
    assert c._benched_until == [0, 0] and c._streak == [0, 0]


def test_costs_more_compares_ms_per_emitted_token():
    plain = [(50.0, 1), (52.0, 1), (48.0, 1)]
    assert costs_more([(120.0, 3)], plain) is None  # one won step is no evidence yet
    assert costs_more([(120.0, 3), (100.0, 2)], plain) is False  # 44 ms a token against 50
    assert costs_more([(200.0, 3), (160.0, 2)], plain) is True  # 72 against 50
    assert costs_more([(104.0, 2), (104.0, 2)], plain, margin=0.05) is False  # 4% over: within the margin
    assert costs_more([(200.0, 3), (160.0, 2)], plain[:1]) is None


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def run_steps(c, clock, model_ms, plain_ms, landed, steps):
    """``steps`` loop steps on a fake clock: the first member's draft lands 2 tokens, the model's
    ``landed`` in ``model_ms``; a step with no draft takes ``plain_ms``."""
    from tsspec.spec.protocols import DraftContext

    for _ in range(steps):
        d = c.propose(DraftContext(last_token=3, position=3, max_tokens=4, history=[1, 2, 3]))
        won = c._winner
        clock.t += (model_ms if won == 1 else plain_ms if not d.tokens else plain_ms * 1.5) / 1000.0
        c.commit([0] * ((landed if won == 1 else 2 if won == 0 else 0) + 1), None, 3)


def test_landed_share_and_giving_way():
    assert landed_share([(1, 4)] * 3) is None  # too few steps to judge
    assert landed_share([(1, 4), (3, 4), (0, 4), (4, 4)]) == 0.5
    assert landed_share([(0, 0)] * 5) is None  # nothing drafted
    assert gives_way(0.4, [0.6]) and not gives_way(0.55, [0.6])  # within the margin: the earlier keeps it
    assert not gives_way(None, [0.9]) and not gives_way(0.2, [None])  # unjudged on either side
    assert gives_way(0.2, [None, 0.5])


class Ordered(Scripted):
    """A Scripted member with an n-gram's match order for each proposal (``last_order``)."""

    def __init__(self, name, script, order):
        super().__init__(name, script)
        self.order = order
        self.last_order = 0

    def propose(self, ctx):
        d = super().propose(ctx)
        self.last_order = self.order(self.asked)
        return d


def test_an_earlier_members_weak_proposals_give_way_to_a_later_member_that_lands_more():
    """The cheap member's order-2 drafts land nothing, its order-6 drafts all their tokens, the model's
    3 of 4: once each is judged, order-2 proposals give way to the model (asked, and its draft is the
    step's) while order-6 ones keep winning; where the model then has nothing, the cheap draft
    stands, and while the model is benched nothing is set aside for it."""
    from tsspec.spec.protocols import DraftContext

    cheap = Ordered("cheap", lambda k: [] if k % 3 == 0 else [1, 2, 3, 4], lambda k: 2 if k % 3 == 1 else 6)
    empty = set()
    model = Scripted("model", lambda k: [] if k in empty else [7, 8, 9, 10])
    c = CascadeSpeculator([cheap, model], clock=Clock())  # a clock that stands still: no step costs more
    c.begin([1, 2, 3], None)

    def step():
        d = c.propose(DraftContext(last_token=3, position=3, max_tokens=4, history=[1, 2, 3]))
        landed = {None: 0, 0: 0 if cheap.last_order == 2 else 4, 1: 3}[c._winner]
        c.commit([0] * (landed + 1), None, 3)
        return cheap.last_order, list(d.tokens)

    seen = [step() for _ in range(60)]
    m = c.member_stats()
    late = seen[30:]
    assert [t for o, t in late if o == 2] and all(t == [7, 8, 9, 10] for o, t in late if o == 2)  # gave way
    assert [t for o, t in late if o == 6 and t == [1, 2, 3, 4]]  # order 6: kept
    assert all(t in ([1, 2, 3, 4], [7, 8, 9, 10]) for o, t in late if o == 6)
    assert m["cheap"]["deferred"] >= 10 and m["model"]["won"] > 20 and m["cheap"]["won"] > 20
    empty.update(range(model.asked + 1, model.asked + 100))  # from now on the model has nothing
    while cheap.asked % 3 != 0:  # the next ask is an order-2 draft
        step()
    asked = model.asked
    assert step() == (2, [1, 2, 3, 4]) and model.asked == asked + 1  # asked, had nothing: the draft stood
    assert c._asks < c._benched_until[1]  # and it is benched for that
    before = m["cheap"]["deferred"]
    for _ in range(3):
        assert step()[1] in ([], [1, 2, 3, 4])
    assert m["cheap"]["deferred"] == before and model.asked == asked + 1


@pytest.mark.parametrize("model_ms, benched", [(60.0, False), (250.0, True)])
def test_a_model_member_whose_steps_cost_more_than_plain_is_benched(model_ms, benched):
    """Every model draft lands 2 tokens (3 emitted); plain-like steps take 50 ms. At 60 ms a step (20
    ms a token) it pays and is asked whenever n-gram has nothing; at 250 ms (83 ms a token) it is
    benched on its cost, ever longer, and n-gram drafts on alone."""
    clock = Clock()
    cheap = Scripted("cheap", lambda k: [1, 2] if k % 3 == 0 else [])
    model = Scripted("model", lambda k: [7, 8])
    c = CascadeSpeculator([cheap, model], clock=clock)
    c.begin([1, 2, 3], None)
    c._plain_steps.extend([(50.0, 1)] * 4)  # as the governor's probe leaves them
    run_steps(c, clock, model_ms, 50.0, landed=2, steps=120)
    m = c.member_stats()
    assert m["cheap"]["proposals"] == 120 and m["cheap"]["benched"] == 0
    if benched:
        assert m["model"]["benched"] > 60 and c._streak[1] >= 3
    else:
        assert m["model"]["benched"] == 0 and m["model"]["won"] == 80


class CatchingUp(Scripted):
    """A Scripted member whose proposals at the given asks pay a catch-up (``setup_ms``, ms)."""

    def __init__(self, name, script, catch_ups):
        super().__init__(name, script)
        self.catch_ups = catch_ups

    def propose(self, ctx):
        d = super().propose(ctx)
        return replace(d, setup_ms=self.catch_ups.get(self.asked, 0.0))


def test_a_catch_up_inside_a_won_step_neither_makes_a_loss_nor_sizes_a_later_bench():
    """The model member pays a 600 ms catch-up over each new prompt inside its first step (the step's
    wall time holds it) and then wins its steps at 20 ms a token against plain's 50: judged on its
    steps without the catch-ups (as the governor judges its samples), it is never benched. When it
    then loses, its bench is sized by the catch-ups since its last favourable verdict, not by every
    catch-up of the run."""
    from tsspec.spec.protocols import DraftContext

    clock = Clock()
    cheap = Scripted("cheap", lambda k: [])
    catch_ups = {1: 600.0, 9: 600.0, 17: 600.0}
    model = CatchingUp("model", lambda k: [7, 8], catch_ups)
    c = CascadeSpeculator([cheap, model], clock=clock)
    c._plain_steps.extend([(50.0, 1)] * 4)  # as the governor's probe leaves them

    def step(ms):
        c.propose(DraftContext(last_token=3, position=3, max_tokens=4, history=[1, 2, 3]))
        clock.t += (ms + catch_ups.get(model.asked, 0.0)) / 1000.0
        c.commit([0] * 3, None, 3)

    for prompt in range(3):
        c.begin([1, 2, 3], None)
        for _ in range(8):
            step(60.0)
    assert model.asked == 24 and c.member_stats()["model"]["benched"] == 0 and c._streak[1] == 0
    assert c._won_setup[1] == 0.0  # its verdicts so far paid for the catch-ups
    c.begin([1, 2, 3], None)
    step(1000.0)  # a slow step: 333 ms a token, and the last eight together cost more than plain's
    assert c._streak[1] == 1 and c._benched_until[1] == c._asks + 4  # the plain rule's bench, no catch-up in it


def test_cascade_name_takes_the_attached_drafter_and_declines_without_one(files, trunk):
    drafter = load_drafter(files["related"], trunk)
    spec = REGISTRY.create("cascade", trunk, SpecOptions(), drafter)
    assert spec.names == ["ngram", "draft-model"]
    with pytest.raises(SpeculatorDeclined, match="needs a model drafter after n-gram"):
        REGISTRY.create("cascade", trunk, SpecOptions(), None)
    with pytest.raises(SpeculatorDeclined, match="member draft-model"):
        REGISTRY.create("ngram,draft-model", trunk, SpecOptions(), None)
    for bad, why in [("ngram,ngram", "once"), ("ngram,auto", "cannot be a cascade member"),
                     ("ngram,bogus", "unknown")]:
        with pytest.raises(BadInput, match=why):
            REGISTRY.create(bad, trunk, SpecOptions(), drafter)


def test_the_environment_spells_a_cascade_too():
    opts, _ = resolve_spec_options({}, {"TS_SPEC_TYPE": "ngram, draft-model"}, speculators=REGISTRY.names())
    assert opts.type == "ngram,draft-model"
    for bad in ("ngram,ngram", "ngram,cascade", "ngram,nope"):
        with pytest.raises(BadInput, match="TS_SPEC_TYPE"):
            resolve_spec_options({}, {"TS_SPEC_TYPE": bad}, speculators=REGISTRY.names())


def test_the_live_table_and_the_report_print_each_member_alike():
    from rich.console import Console

    from tsspec.display import stats_table
    from tsspec.spec.stats import SpecStats, member_line

    c = dict(proposals=5, won=3, drafted=6, accepted=4, benched=0, deferred=2)
    assert member_line(c) == "won 3 of 5 asked, accepted 4 of 6 drafted, gave way 2"
    s = SpecStats(speculator="cascade", members={"ngram": c})
    console = Console(record=True, width=200)
    console.print(stats_table(s))
    text = console.export_text()
    assert "ngram" in text and member_line(c) in text
    cascade = CascadeSpeculator([Scripted("a", lambda k: []), Scripted("b", lambda k: [])])
    assert cascade.report() == "cascade: a " + member_line(cascade.member_stats()["a"]) + "; b " + member_line(
        cascade.member_stats()["b"])


def test_the_drafters_preferred_window_bounds_its_own_member_only(files, trunk):
    """A draft model's preferred window (4, measured for it alone) bounds the draft-model member;
    n-gram keeps the run's window, as it has alone; a window the user chose holds for both."""
    from tsspec.session import Session
    from tsspec.settings import resolve_run

    drafter = load_drafter(files["related"], trunk)
    assert drafter.preferred_window == 4
    spec = REGISTRY.create("cascade", trunk, SpecOptions(), drafter)
    assert [m.max_draft_tokens for m in spec.members] == [8, 4] and spec.max_draft_tokens == 8
    mine = REGISTRY.create("ngram,draft-model", trunk, SpecOptions(draft=6, draft_explicit=True), drafter)
    assert [m.max_draft_tokens for m in mine.members] == [6, 6]
    # the session's plan: the cascade's window is n-gram's, the draft model alone keeps its own
    session = Session.open(resolve_run(model=str(files["trunk"])), progress=False)
    for kind, window in (("cascade", 8), ("ngram,draft-model", 8), ("draft-model", 4), ("ngram", 8)):
        s = session.speculation(SpecOptions(enabled=True, type=kind, draft_model=str(files["related"])))
        assert (s.plan.window, s.options.draft) == (window, window), kind
    # every token a cascade emits is still the trunk's
    prompt = PROMPTS[1]
    plain = decode(trunk, Sampler(), prompt, N_TOKENS)
    assert decode(trunk, Sampler(), prompt, N_TOKENS, SpecPlan(spec, window=8)) == plain


ARCH_FILES = ["llama", "qwen2", "qwen3", "gemma3", "qwen35"]


@pytest.mark.parametrize("arch", ARCH_FILES)
def test_cascade_and_suffix_equal_plain_on_every_architecture(tmp_path, arch):
    """Issue 48's exactness on the tiny file of every architecture (a hybrid trunk included): the
    cascade (n-gram, then a draft model of the same family) and suffix (its store carried from one
    request to the next), greedy and seeded, give plain decoding's tokens."""
    from tiny import ARCHS
    from tiny_hybrid import write_hybrid
    from tsspec.spec.suffix import SuffixSpeculator, SuffixStore

    if arch in ARCHS:
        trunk_path = write_tiny_model(tmp_path / "t.gguf", arch, seed=11, n_layers=3)
        drafter_path = write_tiny_model(tmp_path / "d.gguf", arch, seed=11, n_layers=2)
    else:
        trunk_path, _ = write_hybrid(tmp_path / "t.gguf", arch, seed=0)
        drafter_path, _ = write_hybrid(tmp_path / "d.gguf", arch, seed=0, num_hidden_layers=2)
    model = load_model(trunk_path)
    drafter = load_drafter(drafter_path, model)
    drafted = 0
    for params in SAMPLERS:
        cascade = REGISTRY.create("cascade", model, SpecOptions(), drafter)
        suffix = SuffixSpeculator(SuffixStore(), max_draft_tokens=6)
        for prompt in (PROMPTS[0], PROMPTS[2], PROMPTS[0]):
            plain = decode(model, Sampler(params), prompt, 24)
            for spec, window in ((cascade, 8), (suffix, 6)):
                st = SpecStats()
                got = decode(model, Sampler(params), prompt, 24, SpecPlan(spec, window=window), stats=st)
                assert got == plain, f"{arch} {spec.name} {params}"
                drafted += st.drafted
    assert drafted > 0
