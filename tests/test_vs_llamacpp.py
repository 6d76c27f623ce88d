"""Plain greedy text against llama.cpp's, on the same GGUF files and the same prompt ids.

Fixtures in ``tests/fixtures/llamacpp/<model>.json`` were recorded by
``scripts/record_llamacpp_reference.py`` from llama-server (b11434, ``-t 2``, greedy sampler chain,
no speculation, prompt cache off): per prompt, the prompt ids, llama.cpp's 32-token greedy
continuation and, per generated position, its top-2 token ids and their logprobs from a plain
softmax of the raw logits (so ``gaps[i]`` = top-1 minus top-2 logprob = the raw top-2 logit gap,
in nats). 16-17 prompts per model: the four of ``tests/fixtures/reference`` (their transformers
ids) plus code (Python, C, JavaScript, SQL), prose, lists, questions and, where the file has a chat
template, one chat turn, encoded by tsspec's tokenizer. No llama.cpp is needed at test time.

We run ``decode(model, Sampler(), prompt_ids, n)`` with a ``Sampler`` that also keeps the logits
it sees, and compare tokens. The two engines are not bit-identical (different kernels and
accumulation orders; llama.cpp keeps its KV cache in f16), so the requirement is: both agree on
every position up to the first difference, and a first difference happens only at a near-tie.

Stated tolerances, derived from the recorded data (``pytest -rP`` prints the per-model figures):

* delta: at every position where both engines agree so far and llama.cpp's top-2 gap is below 1
  nat, ``delta = |(ours[A] - ours[B]) - (llama[A] - llama[B])|`` for llama.cpp's top-2 pair (A, B):
  how much the engines disagree about a near-tie. Measured (b11434, 87-114 positions per model):
  median 0.05-0.12, p95 0.18-0.43, max 0.29-1.38 nats; gemma3-270m is the noisiest, and its 1.38
  outlier is llama.cpp's (gap 0.77 there, ours 2.15, transformers' f32 1.77). On the four reference
  prompts both engines' top-2 gaps are about equally far from transformers' f32 logits (median
  |error| tsspec vs llama.cpp: smollm2 0.09 vs 0.07, gemma3 0.08 vs 0.14, qwen 0.5B 0.04 vs 0.05,
  qwen 1.5B 0.03 vs 0.06 nats). Asserted: p95 of delta < 2 * NEAR_TIE = 0.5 per model.
* NEAR_TIE = 0.25 nats. Where tsspec picks B and llama.cpp picks A the engines disagree on the
  sign of ``logit[A] - logit[B]``, so delta there is >= gap_llama + gap_tsspec >= 2 * the smaller
  gap. delta < 0.5 at >= 95% of near-tie positions on every model, so a flip caused by rounding has
  ``min(gap_llama, gap_tsspec) < 0.25``. Asserted: every first difference satisfies that. Measured
  over 25 first differences: the smaller gap is <= 0.17 (qwen 0.5B "Dear Sam": 0.253 / 0.170);
  llama.cpp's gap alone reaches 0.62 (gemma3 JavaScript prompt, where ours is 0.0008), hence
  "either engine's gap". A first difference with both gaps >= 0.25 is a real disagreement.
* At least 60% of a model's prompts agree for >= 16 tokens (an engine that diverges "at near-ties"
  everywhere is broken). Measured: 13/17, 12/16, 15/17, 13/17 (75-88%); all 32 tokens agree on
  9/17, 8/16, 13/17, 12/17.

Runtime: ~95 s for the four models on one thread (qwen2.5-coder-1.5b is about half of it).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from tsspec.models import load_model
from tsspec.sampling import Sampler
from tsspec.spec.loop import decode

pytestmark = [pytest.mark.real_model, pytest.mark.usefixtures("real_model_threads")]

FIXTURES = Path(__file__).parent / "fixtures" / "llamacpp"
ALL_MODELS = ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]
MODELS = [m for m in ALL_MODELS if (FIXTURES / f"{m}.json").exists()]
N_CTX = 512
NEAR_TIE = 0.25  # nats; see the module docstring
TIE_REGION = 1.0  # nats: llama.cpp top-2 gaps below this count as "near-tie positions" for delta
DELTA_P95_MAX = 2 * NEAR_TIE
MIN_PREFIX = 16
MIN_SHARE = 0.6


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


class RecordingSampler(Sampler):
    """Greedy ``Sampler`` that also keeps, per generated position, its top-2 (ids, logits) and its
    logits at llama.cpp's top-2 ids for that position."""

    def __init__(self, llama_top2: list[list[int]]):
        super().__init__()
        self.llama_top2 = llama_top2
        self.top2: list[tuple[list[int], list[float]]] = []
        self.at_llama: list[list[float] | None] = []

    def sample(self, logits, position, history):
        i = len(self.top2)
        x = logits.float()
        v, ix = torch.topk(x, 2)
        self.top2.append((ix.tolist(), v.tolist()))
        ids = self.llama_top2[i] if i < len(self.llama_top2) else None
        self.at_llama.append([float(x[j]) for j in ids] if ids else None)
        return super().sample(logits, position, history)


@dataclass
class Outcome:
    kind: str
    prompt: str
    n: int  # tokens compared (llama.cpp's continuation length)
    agree: int  # positions agreeing before the first difference (== n if none)
    llama_gap: float | None = None  # at the first difference
    tsspec_gap: float | None = None
    tsspec_pick: int | None = None
    llama_top2: list[int] | None = None
    deltas: list[float] = field(default_factory=list)  # |delta| at agreeing near-tie positions

    def describe(self) -> str:
        if self.agree == self.n:
            return f"{self.kind} {self.prompt[:30]!r}: all {self.n} agree"
        return (f"{self.kind} {self.prompt[:30]!r}: first difference at {self.agree}/{self.n}: tsspec {self.tsspec_pick}, "
                f"llama.cpp top-2 {self.llama_top2}; top-2 gap llama.cpp {self.llama_gap:.4f}, tsspec {self.tsspec_gap:.4f}")


def compare(model, case: dict) -> Outcome:
    want = case["continuation_ids"]
    rec = RecordingSampler(case["top2_ids"])
    got = decode(model, rec, case["prompt_ids"], len(want))
    agree = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
    out = Outcome(case["kind"], case["prompt"], len(want), agree)
    for i in range(agree):  # same history on both sides up to here
        if case["gaps"][i] < TIE_REGION:
            a, b = rec.at_llama[i]
            out.deltas.append(abs((a - b) - case["gaps"][i]))
    if agree < len(want):
        ids, v = rec.top2[agree]
        out.llama_gap, out.tsspec_gap = case["gaps"][agree], v[0] - v[1]
        out.tsspec_pick, out.llama_top2 = got[agree], case["top2_ids"][agree]
    return out


@pytest.fixture(scope="module", params=MODELS)
def outcomes(request, real_model_path) -> tuple[str, list[Outcome]]:
    """(name, per-prompt outcomes): the model is loaded once and every prompt decoded once."""
    name = request.param
    model = load_model(real_model_path(name), n_ctx=N_CTX)
    res = [compare(model, c) for c in fixture(name)["cases"]]
    del model
    return name, res


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


@pytest.mark.parametrize("name", MODELS)
def test_fixture_was_recorded_on_the_known_file(name):
    from tsspec.hub import KNOWN_MODELS

    data = fixture(name)
    assert data["provenance"]["model_sha256"] == KNOWN_MODELS[name].sha256
    assert data["provenance"]["request"]["post_sampling_probs"] is False  # raw-logit top-2
    for c in data["cases"]:
        assert len(c["continuation_ids"]) == len(c["gaps"]) == len(c["top2_ids"])
        assert all(g >= 0 for g in c["gaps"])


def test_greedy_agrees_with_llamacpp_up_to_a_near_tie(outcomes):
    name, res = outcomes
    for o in res:
        print(f"{name}: {o.describe()}")
    bad = [o for o in res if o.agree < o.n and min(o.llama_gap, o.tsspec_gap) >= NEAR_TIE]
    assert not bad, f"{name}: first difference not at a near-tie (< {NEAR_TIE} nats):\n" + "\n".join(
        o.describe() for o in bad)


def test_logit_gap_discrepancy_near_ties_is_small(outcomes):
    name, res = outcomes
    deltas = [d for o in res for d in o.deltas]
    assert len(deltas) >= 20, f"{name}: only {len(deltas)} near-tie positions to measure"
    p50, p95, p99 = (percentile(deltas, q) for q in (0.5, 0.95, 0.99))
    print(f"{name}: |delta| of the top-2 gap at {len(deltas)} agreeing positions with llama.cpp gap < {TIE_REGION}: "
          f"median {p50:.3f}, p95 {p95:.3f}, p99 {p99:.3f}, max {max(deltas):.3f} nats")
    assert p95 < DELTA_P95_MAX, f"{name}: p95 of |delta| {p95:.3f} >= {DELTA_P95_MAX} nats"


def test_most_prompts_agree_for_16_tokens(outcomes):
    name, res = outcomes
    long = [o for o in res if o.agree >= min(MIN_PREFIX, o.n)]
    full = sum(o.agree == o.n for o in res)
    firsts = [o.agree for o in res if o.agree < o.n]
    print(f"{name}: {full}/{len(res)} prompts agree on all tokens, {len(long)}/{len(res)} for >= {MIN_PREFIX}; "
          f"first differences at {sorted(firsts)}; median agreeing prefix {statistics.median(o.agree for o in res)}")
    assert len(long) >= MIN_SHARE * len(res), (
        f"{name}: only {len(long)}/{len(res)} prompts agree for >= {MIN_PREFIX} tokens:\n"
        + "\n".join(o.describe() for o in res))
