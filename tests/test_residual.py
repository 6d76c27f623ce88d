"""The residual rule keeps the trunk's distribution exactly, and accepts more than ``match``.

The distribution test runs the real loop (``decode`` with the draft-model speculator) over many
seeds and compares the empirical distribution of the first three tokens (the first from the
prefill row, the next two from the first verify) with the exact one, computed from the trunk's
probabilities over the whole top-k tree. A chi-square test at alpha = 1e-3 accepts the real rule
and rejects two classic mistakes.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from tsspec.spec.plan import SpecPlan
import tsspec.spec.verify as verify_mod
from tiny import write_tiny_model
from tsspec.models import load_model
from tsspec.sampling import Sampler, SamplingParams, Stream, keyed_uniform
from tsspec.spec.draft_model import DraftModelSpeculator
from tsspec.spec.loop import decode
from tsspec.spec.stats import SpecStats
from tsspec.spec.verify import Verdict, verify_residual

PROMPT = [72, 101, 108, 108, 111]
TOP_K = 6  # keeps the exact tree small: 6 * 6 * 6 leaves
N_SEEDS = 2000


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("residual")
    trunk = load_model(write_tiny_model(d / "trunk.gguf", "qwen2", seed=11, n_layers=3))
    # same seed, fewer layers: overlapping but different distributions
    draft = load_model(write_tiny_model(d / "draft.gguf", "qwen2", seed=11, n_layers=2))
    return trunk, DraftModelSpeculator(draft, vocab_size=trunk.vocab_size, max_draft_tokens=2)


def exact_distribution(trunk, sampler: Sampler) -> dict[tuple[int, int, int], float]:
    """P(t0, t1, t2 | PROMPT) under plain sampling, from the trunk's rows."""
    out = {}
    cache = trunk.make_cache()
    p0 = sampler.probs(trunk.forward(PROMPT, cache).logits[-1], PROMPT)
    for a in torch.nonzero(p0).flatten().tolist():
        cache.trim(cache.length - len(PROMPT))
        h1 = PROMPT + [a]
        p1 = sampler.probs(trunk.forward([a], cache).logits[-1], h1)
        for b in torch.nonzero(p1).flatten().tolist():
            cache.trim(cache.length - len(h1))
            p2 = sampler.probs(trunk.forward([b], cache).logits[-1], h1 + [b])
            for c in torch.nonzero(p2).flatten().tolist():
                out[(a, b, c)] = float(p0[a]) * float(p1[b]) * float(p2[c])
    return out


def empirical(trunk, spec, rule: str, temperature: float) -> Counter:
    counts: Counter = Counter()
    for seed in range(N_SEEDS):
        s = Sampler(SamplingParams(temperature=temperature, top_k=TOP_K, seed=seed))
        counts[tuple(decode(trunk, s, PROMPT, 3, SpecPlan(spec, window=2, accept_rule=rule)))] += 1
    return counts


def chi_square(counts: Counter, exact: dict, n: int) -> tuple[float, float]:
    """(statistic, critical value at alpha=1e-3); cells expecting < 5 are pooled into one."""
    assert set(counts) <= set(exact), "a sequence plain sampling cannot produce"
    stat, pooled_o, pooled_e, cells = 0.0, 0, 0.0, 0
    for key, p in exact.items():
        e, o = n * p, counts.get(key, 0)
        if e < 5:
            pooled_o, pooled_e = pooled_o + o, pooled_e + e
            continue
        stat += (o - e) ** 2 / e
        cells += 1
    if pooled_e > 0:
        stat += (pooled_o - pooled_e) ** 2 / pooled_e
        cells += 1
    df = cells - 1
    z = 3.090  # one-sided 1e-3; Wilson-Hilferty approximation of the chi-square quantile
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, crit


# ----------------------------------------------------------------------------- wrong rules


def resample_from_p(logits, draft, draft_probs, sampler, position, history):
    """Wrong: accepts like the real rule but draws a rejected position from p, not the residual."""
    hist = list(history)
    for i, d in enumerate(draft):
        p = sampler.probs(logits[i], hist)
        px, qx = float(p[d]), float(draft_probs[i][d])
        if qx > 0 and keyed_uniform(sampler.params.seed, position + i, 1) * qx < px:
            hist.append(d)
            continue
        return Verdict(i, sampler.draw(p, position + i, 2))
    return Verdict(len(draft), sampler.sample(logits[len(draft)], position + len(draft), hist))


def accept_q_over_p(logits, draft, draft_probs, sampler, position, history):
    """Wrong: accepts with probability min(1, q/p) (the ratio upside down)."""
    hist = list(history)
    for i, d in enumerate(draft):
        p = sampler.probs(logits[i], hist)
        q = draft_probs[i]
        px, qx = float(p[d]), float(q[d])
        if px > 0 and keyed_uniform(sampler.params.seed, position + i, 1) * px < qx:
            hist.append(d)
            continue
        residual = torch.clamp(p - q, min=0.0)
        if float(residual.sum()) <= 0.0:
            residual = p
        return Verdict(i, sampler.draw(residual / residual.sum(), position + i, 2))
    return Verdict(len(draft), sampler.sample(logits[len(draft)], position + len(draft), hist))


# ----------------------------------------------------------------------------- tests


def test_residual_preserves_the_trunk_distribution_and_wrong_rules_fail(pair, monkeypatch):
    trunk, spec = pair
    temperature = 1.0
    exact = exact_distribution(trunk, Sampler(SamplingParams(temperature=temperature, top_k=TOP_K)))
    assert abs(sum(exact.values()) - 1.0) < 1e-4

    counts = empirical(trunk, spec, "residual", temperature)
    stat, crit = chi_square(counts, exact, N_SEEDS)
    assert stat < crit, f"residual: chi2 {stat:.1f} >= {crit:.1f}"

    for wrong in (resample_from_p, accept_q_over_p):
        monkeypatch.setattr(verify_mod, "verify_residual", wrong)
        bad = empirical(trunk, spec, "residual", temperature)
        stat_bad, _ = chi_square(bad, exact, N_SEEDS)
        assert stat_bad > crit, f"{wrong.__name__} passed: chi2 {stat_bad:.1f} < {crit:.1f}"
        monkeypatch.undo()


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_residual_accepts_more_than_match(pair, temperature):
    trunk, _ = pair
    spec = DraftModelSpeculator(pair[1].model, vocab_size=trunk.vocab_size, max_draft_tokens=4)
    rates = {}
    for rule in ("match", "residual"):
        st = SpecStats()
        for seed in range(30):
            s = Sampler(SamplingParams(temperature=temperature, seed=seed))
            decode(trunk, s, PROMPT, 24, SpecPlan(spec, window=4, accept_rule=rule), stats=st)
        rates[rule] = st.acceptance_rate
    assert rates["residual"] > rates["match"], rates


def _hand_logits(p: list[float]) -> torch.Tensor:
    return torch.tensor([math.log(x) if x > 0 else -1e9 for x in p])


def test_verify_residual_on_hand_made_distributions():
    p = [0.5, 0.3, 0.2, 0.0]  # trunk, after the sampler (temperature 1: softmax(log p) == p)
    q = torch.tensor([[0.1, 0.6, 0.1, 0.2]])  # drafter
    logits = torch.stack([_hand_logits(p), _hand_logits([0.25] * 4)])  # [K + 1, vocab]
    n = 4000

    def run(d):
        verdicts = [verify_residual(logits, [d], q, Sampler(SamplingParams(temperature=1.0, seed=s)), 10, [1, 2])
                    for s in range(n)]
        return verdicts

    # p(d) >= q(d): always accepted, then the bonus row is drawn
    assert all(v.accepted == 1 for v in run(0))
    # p(d) = 0: never accepted; recovered from the residual max(0, p - q) = [0.4, 0, 0.1, 0]
    v3 = run(3)
    assert all(v.accepted == 0 for v in v3)
    # q(d) = 0.6 > p(d) = 0.3: accepted with probability 0.5; rejections drawn from the residual
    v1 = run(1)
    acc = sum(v.accepted for v in v1) / n
    assert abs(acc - 0.5) < 4 * math.sqrt(0.25 / n), acc
    rec = Counter(v.token for v in v1 if v.accepted == 0)
    assert set(rec) <= {0, 2}  # the residual is zero on tokens 1 and 3
    frac0 = rec[0] / sum(rec.values())
    assert abs(frac0 - 0.8) < 4 * math.sqrt(0.16 / sum(rec.values())), frac0
    # with the draft drawn from q (its own stream), the first emitted token is distributed as p
    first: Counter = Counter()
    for s in range(n):
        sampler = Sampler(SamplingParams(temperature=1.0, seed=s))
        d = sampler.draw(q[0], 10, 7)
        v = verify_residual(logits, [d], q, sampler, 10, [1, 2])
        first[d if v.accepted else v.token] += 1
    for tok, want in enumerate(p):
        assert abs(first[tok] / n - want) < 4 * math.sqrt(max(want * (1 - want), 1e-9) / n) + 1e-9, (tok, first)
    # p == q: every draft accepted
    same = torch.tensor([p])
    for s in range(200):
        v = verify_residual(logits, [2], same, Sampler(SamplingParams(temperature=1.0, seed=s)), 10, [1, 2])
        assert v.accepted == 1


# ----------------------------------------------------------------------------- token trees


def test_walk_residual_on_a_chain_is_verify_residual():
    """A tree of one child a node, each with its drafter distribution, is a chain: the recursive
    rule accepts what ``verify_residual`` accepts and draws the same token, seed by seed."""
    from tsspec.spec.tree import walk_residual

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 12, generator=gen) * 2
    q = torch.softmax(torch.randn(3, 12, generator=gen) * 2, dim=-1)
    for seed in range(300):
        sampler = Sampler(SamplingParams(temperature=1.0, seed=seed))
        draft = [sampler.draw(q[i], 20 + i, 9) for i in range(3)]
        v = verify_residual(logits, draft, q, sampler, 20, [1, 2])
        path, tok = walk_residual(logits, draft, [-1, 0, 1], q, sampler, 20, [1, 2])
        assert (len(path), tok) == (v.accepted, v.token) and path == list(range(v.accepted)), seed


def _first_token(walk, p, q, picked, n=6000):
    """How often each token comes first, when a node's children are the drafter's own draw from q
    (on its own stream) and then ``picked`` (point masses, the draw left out)."""
    logits = torch.stack([_hand_logits(p)] + [_hand_logits([1.0 / len(p)] * len(p))] * (1 + len(picked)))
    seen: Counter = Counter()
    for s in range(n):
        sampler = Sampler(SamplingParams(temperature=1.0, seed=s))
        d = sampler.draw(q, 10, int(Stream.TREE_DRAFT))
        kids = [d, *(t for t in picked if t != d)]
        rows = torch.zeros(len(kids), len(p))
        rows[0] = q
        for j, t in enumerate(kids[1:], 1):
            rows[j, t] = 1.0
        path, tok = walk(logits, kids, [-1] * len(kids), rows, sampler, 10, [1, 2])
        seen[kids[path[0]] if path else tok] += 1
    return seen


def _close(seen: Counter, p: list[float], n: int) -> bool:
    return all(abs(seen[t] / n - want) < 4.5 * math.sqrt(max(want * (1 - want), 1e-9) / n) + 1e-9
               for t, want in enumerate(p))


def test_recursive_rejection_over_siblings_keeps_the_distribution_and_wrong_rules_fail():
    """One node, its drafter's draw and two picked siblings: the first token is distributed as the
    trunk's p. Testing the siblings against p instead of what the rejections left of it, or not
    taking a rejected sibling out of it, skews it."""
    from tsspec.spec import tree

    p = [0.35, 0.25, 0.2, 0.12, 0.08]
    q = torch.tensor([0.1, 0.5, 0.05, 0.3, 0.05])
    n = 6000
    assert _close(_first_token(tree.walk_residual, p, q, [3, 0]), p, n)

    def against_p(logits, tokens, parents, probs, sampler, position, history):
        """Wrong: every child tested against the trunk's p, the draw from the residual."""
        r0 = sampler.probs(logits[0], history)
        r = r0.clone()
        for j, (x, qq) in enumerate(zip(tokens, probs)):
            if float(qq[x]) > 0 and keyed_uniform(sampler.params.seed, position, tree.accept_stream(j)) * float(qq[x]) < float(r0[x]):
                return [j], -1
            r = torch.clamp(r - qq, min=0.0)
            r = r / r.sum()
        return [], sampler.draw(r, position, Stream.RESIDUAL)

    def keeps_rejected(logits, tokens, parents, probs, sampler, position, history):
        """Wrong: a rejected picked sibling stays in the residual."""
        r = sampler.probs(logits[0], history)
        for j, (x, qq) in enumerate(zip(tokens, probs)):
            if float(qq[x]) > 0 and keyed_uniform(sampler.params.seed, position, tree.accept_stream(j)) * float(qq[x]) < float(r[x]):
                return [j], -1
            if j == 0:
                r = torch.clamp(r - qq, min=0.0)
                r = r / r.sum()
        return [], sampler.draw(r, position, Stream.RESIDUAL)

    for wrong in (against_p, keeps_rejected):
        assert not _close(_first_token(wrong, p, q, [3, 0]), p, n), wrong.__name__


def test_residual_trees_preserve_the_trunk_distribution(pair, monkeypatch):
    """The real loop with the draft model growing trees under ``residual``: the first three tokens
    are distributed as plain sampling's, and siblings past a node's first child were accepted."""
    from tsspec.spec import tree

    trunk, chain_spec = pair
    spec = DraftModelSpeculator(chain_spec.model, vocab_size=trunk.vocab_size, max_draft_tokens=2, tree=6,
                                sibling_min=0.0, residual=True)
    taken = Counter()
    real = tree.walk_residual

    def counting(logits, tokens, parents, probs, *a):
        path, tok = real(logits, tokens, parents, probs, *a)
        taken["sibling"] += sum(1 for i in path if any(parents[j] == parents[i] for j in range(i)))
        taken["walks"] += 1
        return path, tok

    monkeypatch.setattr(tree, "walk_residual", counting)
    exact = exact_distribution(trunk, Sampler(SamplingParams(temperature=1.0, top_k=TOP_K)))
    counts = empirical(trunk, spec, "residual", 1.0)
    stat, crit = chi_square(counts, exact, N_SEEDS)
    assert stat < crit, f"residual trees: chi2 {stat:.1f} >= {crit:.1f}"
    assert taken["walks"] > N_SEEDS // 2 and taken["sibling"] > 0, taken
