"""tsspec distill on a real trunk: a short run learns, the file loads, and speculation with it stays exact."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tsspec.spec.plan import SpecPlan
from tsspec.distill.train import DistillConfig, distill
from tsspec.drafters import load_drafter
from tsspec.models import load_model
from tsspec.sampling import Sampler, SamplingParams
from tsspec.spec.draft_head import DraftHeadSpeculator
from tsspec.spec.loop import decode
from tsspec.spec.stats import SpecStats
from tsspec.tokenizer import Tokenizer

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def trained(real_model_path, real_model_threads, tmp_path_factory):
    path = real_model_path("smollm2-135m")
    tmp = tmp_path_factory.mktemp("distill-real")
    mp = pytest.MonkeyPatch()
    mp.setenv("TSSPEC_CACHE", str(tmp / "cache" / "models"))  # features and answers: not the user's
    corpus = [Path(json.__file__).parent, Path(textwrap.__file__)]  # a few stdlib files
    try:
        r = distill(DistillConfig(model=str(path), out=str(tmp / "head.gguf"), corpus=tuple(map(str, corpus)),
                                  tokens=8192, heldout_tokens=1024, answers=300, answer_length=48, steps=60,
                                  batch=64, eval_every=30))
    finally:
        mp.undo()
    return path, r


def test_smollm2_head_learns(trained):
    _, r = trained
    assert r.curve[-1][2] > r.curve[0][2] + 0.05  # held-out first-token acceptance rose


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.7, top_p=0.9, seed=5)],
                         ids=["greedy", "seeded"])
def test_smollm2_head_loads_and_keeps_output_exact(trained, params):
    path, r = trained
    target = load_model(path)
    head = load_drafter(r.out, target).draft_head
    tok = Tokenizer.from_gguf(path)
    prompt = tok.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")
    plain = decode(target, Sampler(params), prompt, 48)
    stats = SpecStats()
    spec = DraftHeadSpeculator(head, target.n_layers, max_draft_tokens=4, min_draft_prob=0.0)
    assert decode(target, Sampler(params), prompt, 48, SpecPlan(spec, window=4), stats=stats) == plain
    assert stats.drafted > 0 and stats.accepted > 0
