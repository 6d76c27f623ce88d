"""NextN/MTP draft-head speculation on a tiny qwen35 trunk with a random MTP block.

Shown: output identical to plain decoding (greedy and seeded, fast rollback and snapshots off);
the confidence gate (pmin 1 never drafts, pmin 0 always drafts a full window); catch-up is folded
into the first draft step (one head forward per proposal plus one per extra draft token) and keeps
the head's exact length equal to the trunk's committed length, with head-cache rows matching a
from-scratch catch-up over the final sequence (atol 1e-3: the reference takes its trunk rows from
one long forward); the speculator refuses to arm after prefix reuse; a separate draft-head GGUF
attaches through ``load_drafter``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiny_hybrid import write_hybrid, write_nextn_only
from tsspec.spec.plan import SpecPlan
from tsspec.drafters import load_drafter
from tsspec.drafters.nextn import NextNHead, builtin_head
from tsspec.models import load_model
from tsspec.options import SpecOptions
from tsspec.sampling import Sampler, SamplingParams
from tsspec.spec.draft_head import DraftHeadSpeculator, gate_confidence
from tsspec.spec.loop import decode
from tsspec.spec.protocols import DraftHeadKind
from tsspec.spec.registry import REGISTRY
from tsspec.spec.stats import SpecStats

pytestmark = pytest.mark.filterwarnings("ignore")

PROMPT = [int(x) for x in np.random.default_rng(3).integers(0, 256, 20)]
SAMPLERS = {"greedy": SamplingParams(), "seeded": SamplingParams(temperature=0.8, top_k=40, seed=7)}


@pytest.fixture(scope="module")
def mtp_file(tmp_path_factory):
    path, hf = write_hybrid(tmp_path_factory.mktemp("mtp") / "q35mtp.gguf", "qwen35", mtp=True)
    return path, hf


def _spec(model, pmin=0.0, draft=3):
    spec = DraftHeadSpeculator.build(model, builtin_head(model), SpecOptions(draft=draft, pmin=pmin))
    assert isinstance(spec, DraftHeadSpeculator), spec
    return spec


def _run(model, params, spec=None, n=32, window=3):
    stats = SpecStats()
    out = decode(model, Sampler(params), PROMPT, n, SpecPlan(spec, window=window), stats=stats)
    return out, stats


def test_trunk_carries_head(mtp_file):
    m = load_model(mtp_file[0])
    head = builtin_head(m)
    assert isinstance(head, NextNHead) and builtin_head(m) is head  # loaded once per trunk
    assert head.kind is DraftHeadKind.PER_TOKEN
    assert m.n_layers == 4  # the MTP block is not part of the main stack
    spec = _spec(m)
    assert spec.taps == (m.n_layers,) and spec.needs_hidden_state
    assert spec.can_arm_after_prefix_reuse is False
    assert DraftHeadSpeculator.default_min_draft_prob == 0.75


@pytest.mark.parametrize("fast", [True, False], ids=["fast-rollback", "snapshots-off"])
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_draft_head_equals_plain(mtp_file, sampling, fast):
    m = load_model(mtp_file[0], verify_snapshots=fast)
    plain, _ = _run(m, SAMPLERS[sampling])
    spec = _spec(m, pmin=0.0)
    out, st = _run(m, SAMPLERS[sampling], spec)
    assert out == plain
    assert st.verify_calls > 0 and st.drafted > 0


def test_gate(mtp_file):
    m = load_model(mtp_file[0])
    params = SAMPLERS["greedy"]
    never = _spec(m, pmin=1.0)
    _, st = _run(m, params, never)
    assert st.verify_calls == 0 and never.gated == never.proposals
    always = _spec(m, pmin=0.0, draft=3)
    _, st = _run(m, params, always)
    assert st.plain_steps <= 1 and always.gated == 0  # the last token has no room for a draft
    assert gate_confidence(torch.tensor([5.0, 0.0, 0.0])) > 0.98
    assert gate_confidence(torch.zeros(50)) == pytest.approx(0.1)


class Oracle:
    """Runs the real head (so its cache rows are written) but replaces its logits with the plain
    continuation, wrong at every third position: accepts of 0..3 tokens, so catch-ups fold 1..4 rows."""

    kind = DraftHeadKind.PER_TOKEN
    block_size = 1

    def __init__(self, head, seq):
        self.head, self.seq = head, seq
        self.from_trunk, self.new_state = head.from_trunk, head.new_state
        self.fold_rows = []

    def _logits(self, position):
        out = torch.zeros(300)
        tok = self.seq[position] if position < len(self.seq) else 0
        out[tok if position % 3 else (tok + 1) % 300] = 10.0
        return out

    def catch_up_and_step(self, tokens, hidden, start_pos, state):
        self.fold_rows.append(len(tokens))
        _, h = self.head.catch_up_and_step(tokens, hidden, start_pos, state)
        return self._logits(start_pos + len(tokens)), h

    def draft_step(self, token, hidden, position, state):
        _, h = self.head.draft_step(token, hidden, position, state)
        return self._logits(position + 1), h


def test_catch_up_is_folded_and_in_sync(mtp_file):
    m = load_model(mtp_file[0], fmt="f32")
    plain, _ = _run(m, SAMPLERS["greedy"], n=30)
    oracle = Oracle(builtin_head(m), PROMPT + plain)
    spec = DraftHeadSpeculator(oracle, m.n_layers, max_draft_tokens=3, min_draft_prob=0.0)
    lens = []
    real = spec.propose

    def propose(ctx):
        d = real(ctx)
        lens.append((len(d.tokens), spec.head_len, ctx.position))
        return d

    spec.propose = propose
    out, st = _run(m, SAMPLERS["greedy"], spec, n=30)
    assert out == plain and 0 < st.accepted < st.drafted
    assert max(oracle.fold_rows[1:]) > 1  # accepted tokens were caught up inside the first step
    assert all(hl == pos for _, hl, pos in lens)  # exact head rows == committed trunk length
    # one head forward per proposal (catch-up + first draft) plus one per further draft token
    assert spec.head_calls == len(lens) + sum(max(n - 1, 0) for n, _, _ in lens)
    # head-cache rows equal a from-scratch catch-up over the final sequence
    seq = PROMPT + out
    hid = m.forward(seq, m.make_cache(), taps=(m.n_layers,)).hidden
    head = builtin_head(m)
    ref = head.new_state()
    n = spec.head_len
    head.catch_up(seq[1 : n + 1], head.from_trunk(hid[:n]), 1, ref)
    assert torch.allclose(spec.state.k[0, :, :n], ref.k[0, :, :n], atol=1e-3)
    assert torch.allclose(spec.state.v[0, :, :n], ref.v[0, :, :n], atol=1e-3)


def test_no_drafting_across_a_gap(mtp_file):
    m = load_model(mtp_file[0])
    spec = _spec(m)
    spec.begin(PROMPT, None)  # a prefix the head never saw
    from tsspec.spec.protocols import DraftContext

    assert spec.propose(DraftContext(1, len(PROMPT), 3, PROMPT + [1])).tokens == []


@pytest.mark.parametrize("arch", ["nextn", "qwen35"])
def test_separate_head_file_attaches(mtp_file, tmp_path, arch):
    path, hf = mtp_file
    trunk = load_model(write_hybrid(tmp_path / "trunk.gguf", "qwen35", model=hf)[0])
    assert builtin_head(trunk) is None
    head_path = write_nextn_only(tmp_path / "head.gguf", hf, arch=arch)
    opts = SpecOptions(draft=3, pmin=0.0)
    drafter = load_drafter(head_path, trunk)
    assert drafter.speculator_name == "draft-head"
    spec = REGISTRY.create("draft-head", trunk, opts, drafter)
    plain, _ = _run(trunk, SAMPLERS["greedy"])
    out, st = _run(trunk, SAMPLERS["greedy"], spec)
    assert out == plain and st.drafted > 0
    # the same head weights as the trunk-carried one: same drafts
    full = load_model(path)
    head = builtin_head(full)
    a = head.forward_rows([5, 6], torch.ones(2, full.hidden_size), 1, head.new_state())[0]
    b = drafter.draft_head.forward_rows([5, 6], torch.ones(2, trunk.hidden_size), 1, drafter.draft_head.new_state())[0]
    assert torch.equal(a, b)


def test_pick_top_is_argmax_and_the_gate_in_one_pass():
    from tsspec.spec.draft_head import pick_top

    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        x = torch.randn(300, generator=g)
        tok, p = pick_top(x)
        assert tok == int(torch.argmax(x)) and p == gate_confidence(x)
    tied = torch.zeros(40)
    tied[[7, 3, 20]] = 2.0  # ties: the lowest index, as argmax
    assert pick_top(tied)[0] == 3 == int(torch.argmax(tied))


class Calibrated:
    """A stub per-token head whose every draft is token 7 at confidence 0.4."""

    kind = DraftHeadKind.PER_TOKEN
    block_size = 1
    default_min_draft_prob = 0.5

    def __init__(self, calibrated=True):
        self.cumulative_gate = calibrated  # a cumulative gate reads confidences as chances of landing

    def new_state(self):
        class NoState:
            def reset(self):
                pass

        return NoState()

    def pick(self, logits):
        return 7, 0.4

    def catch_up_and_step(self, tokens, hidden, start_pos, state):
        return torch.zeros(4), hidden[-1]

    def draft_step(self, token, h, position, state):
        return torch.zeros(4), h


@pytest.mark.parametrize(
    "calibrated, pmin, min_prob, drafted",
    [
        (True, None, None, 0),  # no measured gate yet: the head's default, 0.5 > 0.4
        (True, None, 0.1, 2),  # the cost gate: 0.4, 0.16 pass, 0.064 does not
        (True, None, 0.5, 0),  # ... and it may be higher than the default too
        (True, 0.3, 0.1, 1),  # --spec-pmin holds against the cost gate: 0.4 passes, 0.16 does not
        (False, None, 0.1, 0),  # a head whose confidences are not chances (no cumulative gate) keeps its default
    ],
)
def test_calibrated_head_gates_at_the_cost_governors_gate(calibrated, pmin, min_prob, drafted):
    from tsspec.spec.protocols import DraftContext

    spec = DraftHeadSpeculator(Calibrated(calibrated), n_layers=2, max_draft_tokens=8, min_draft_prob=pmin)
    prompt = [1, 2, 3]
    spec.begin(prompt, torch.zeros(len(prompt), 4))
    draft = spec.propose(DraftContext(3, len(prompt), 8, prompt, None, None, min_prob))
    assert draft.tokens == [7] * drafted
