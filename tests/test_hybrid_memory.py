"""A hybrid trunk holds per-row rollback states for a verify's rows only, and reports what it holds
(issue 50).

On the tiny qwen35 and qwen3next files: after prompts of 4, 40, 64 and 300 tokens and a run of
verifies (window 3; a scripted speculator drafts the plain continuation, corrupted so that every
accepted length occurs), the slot buffers hold at most window + 1 rows each (two buffers), the
figure the run reports (``SpecStats.rollback_bytes``: --json, the live panel) equals the bytes the
cache has allocated, and it is within ``rollback_state_bytes(window)``. Before, every forward of 2
to 65 rows went through the slots, so a 40-token prompt left 2 x 40 per-row states held for the
rest of the sequence. Plain decoding holds none. Speculative output equals plain, greedy and seeded.
"""

from __future__ import annotations

import numpy as np
import pytest

from scripted import ScriptedSpeculator, keep_first
from tiny_hybrid import VOCAB, write_hybrid
from tsspec.spec.plan import SpecPlan
from tsspec.models import load_model
from tsspec.sampling import Sampler, SamplingParams
from tsspec.spec.loop import decode
from tsspec.spec.ngram import NGramSpeculator
from tsspec.spec.stats import SpecStats

pytestmark = pytest.mark.filterwarnings("ignore")
WINDOW = 3


@pytest.fixture(scope="module", params=["qwen35", "qwen3next"])
def model(request, tmp_path_factory):
    path, _ = write_hybrid(tmp_path_factory.mktemp("hymem") / f"{request.param}.gguf", request.param)
    return load_model(path)


def prompt_of(n: int, seed: int = 0) -> list[int]:
    base = [int(x) for x in np.random.default_rng(seed).integers(0, 256, 8)]
    return (base * (n // 8 + 1))[:n]  # repetitive: n-gram drafting finds matches


def allocated(cache) -> int:
    slots = sum(t.numel() * t.element_size() for buf in cache.slots.ssm for t in buf)
    conv = sum(t.numel() * t.element_size() for t in cache.pending.conv_cat) if cache.pending else 0
    return slots + conv


@pytest.mark.parametrize("n", [4, 40, 64, 300])
@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_a_prompt_holds_no_per_row_states_and_what_is_held_is_reported(model, n, seeded):
    params = SamplingParams(temperature=0.8, seed=5) if seeded else SamplingParams()
    prompt = prompt_of(n)
    plain_cache = model.make_cache()
    ref = decode(model, Sampler(params), prompt, 12, cache=plain_cache)
    assert plain_cache.slots.rows == 0 and plain_cache.rollback_bytes() == 0  # plain decoding: none
    cache, stats = model.make_cache(), SpecStats()
    spec = ScriptedSpeculator(prompt + ref, keep_first(-1, WINDOW), VOCAB, max_draft_tokens=WINDOW)
    got = decode(model, Sampler(params), prompt, 12, SpecPlan(spec, window=WINDOW), cache=cache, stats=stats)
    assert got == ref
    assert stats.verify_calls > 0 and max(spec.drafts) == WINDOW
    assert 0 < cache.slots.rows <= WINDOW + 1
    assert stats.rollback_bytes == cache.rollback_bytes() == allocated(cache)
    assert cache.slots.nbytes <= 2 * (WINDOW + 1) * model.per_row_state_bytes()
    assert stats.rollback_bytes <= model.rollback_state_bytes(WINDOW)


def test_a_kept_cache_shrinks_to_the_next_runs_window(model):
    """A cache reused by a run with a smaller window releases the larger slots (the live state is
    moved out of them first), and the run still equals plain decoding."""
    prompt = prompt_of(40, seed=2)
    cache = model.make_cache()
    ref = decode(model, Sampler(), prompt, 10)
    spec = ScriptedSpeculator(prompt + ref, keep_first(-1, 8), VOCAB, max_draft_tokens=8)
    first = decode(model, Sampler(), prompt, 10, SpecPlan(spec, window=8), cache=cache)
    assert first == ref and 2 < cache.slots.rows <= 9
    held_before = cache.rollback_bytes()
    follow = prompt + first + prompt_of(12, seed=3)
    got = decode(model, Sampler(), follow, 10, SpecPlan(NGramSpeculator(max_draft_tokens=1), window=1), cache=cache)
    assert got == decode(model, Sampler(), follow, 10)
    assert cache.slots.rows <= 2
    assert cache.rollback_bytes() < held_before or held_before == 0


def test_serve_metrics_report_what_the_caches_hold(model, tmp_path):
    """serve's /metrics: tsspec_rollback_bytes is the sum of what its kept caches hold, as allocated,
    and stays within one window's buffers per kept cache."""
    from starlette.testclient import TestClient

    from tsspec.generate import Engine
    from tsspec.server import Server, create_app
    from tsspec.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(model.path)

    def spec():
        return NGramSpeculator(max_draft_tokens=WINDOW)

    engine = Engine(model, tok, SpecPlan(spec(), window=WINDOW), new_plan=lambda: SpecPlan(spec(), window=WINDOW))
    server = Server(engine, model_id="m", slots=2, default_max_tokens=6, parallel=2)
    client = TestClient(create_app(server))
    for text in ("abc", "xyz"):  # prompts of at most window + 1 tokens: their forwards hold per-row states
        r = client.post("/v1/completions", json={"prompt": text, "temperature": 0, "max_tokens": 6})
        assert r.status_code == 200, r.text
    line = next(x for x in client.get("/metrics").text.splitlines() if x.startswith("tsspec_rollback_bytes "))
    held = int(line.split()[1])
    kept = [c for _, c in server.prefix.entries.values()]
    assert held == sum(allocated(c) for c in kept) > 0
    assert held <= len(kept) * model.rollback_state_bytes(WINDOW)
