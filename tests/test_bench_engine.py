"""tsspec.bench.engine: the bench's runs on tsspec's own engine, here ``--keep-cache`` (each
configuration keeps its last prompt's rows): what a run may reuse, and that the text is the same
as from an empty cache, plain and speculative, on a tiny random-weight model."""

from __future__ import annotations

import pytest

from tiny import write_tiny_model
from tsspec.bench.configs import BenchConfig
from tsspec.bench.engine import KeptPrompt, make_run_one
from tsspec.bench.workloads import Prompt
from tsspec.sampling import Sampler, SamplingParams
from tsspec.session import Session
from tsspec.settings import resolve_run


class FakeCache:
    def __init__(self):
        self.length = 0

    def keep(self, n: int) -> int:
        self.length = min(self.length, max(n, 0))
        return self.length

    def reset(self) -> None:
        self.length = 0


def test_a_kept_prompt_reuses_the_shared_prefix_and_a_prompt_run_again_what_its_first_run_did():
    k = KeptPrompt(FakeCache)
    a, b = [1, 2, 3, 4, 5], [1, 2, 3, 9, 9, 9]

    def run(ids, generated=(7, 7)):
        cache = k.take(ids)
        reused = cache.length
        cache.length = len(ids) + len(generated)  # the run wrote its prompt and its reply
        k.give(ids, list(generated), cache)
        return reused

    assert run(a) == 0  # nothing held yet
    assert run(a) == 0  # a again (the baseline's second slot): as its first run, nothing
    assert run(b) == 3  # the prefix it shares with a
    assert run(b) == 3  # b again: not its own earlier run's whole prompt
    assert run(a) == 3 and run(b) == 3
    assert run(b + [8]) == 6  # a prompt that extends the last one reuses all of it
    cache = k.take([5])
    k.drop(cache)  # a failed run: nothing kept
    assert run(b) == 0


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("bench_engine") / "t.gguf", "qwen2", seed=7, n_layers=2)
    return Session.open(resolve_run(model=str(path), env={}))


SYSTEM = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
PROMPTS = [Prompt(f"p{i}", str(i)) for i in range(4)]
IDS = {p.text: SYSTEM + [40 + i, 41 + i, 30] for i, p in enumerate(PROMPTS)}


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, top_k=40, seed=3)],
                         ids=["greedy", "seeded"])
def test_kept_caches_give_the_text_of_empty_ones(session, params):
    configs = [BenchConfig("plain", "plain"), BenchConfig("ngram", "ngram"), BenchConfig("suffix", "suffix")]

    def runs(keep: bool):
        run_one = make_run_one(session, sampler=Sampler(params), max_tokens=12, encode=IDS.__getitem__,
                               ignore_eos=True, keep_cache=keep)
        out = {}
        for p in PROMPTS + PROMPTS[:1]:  # the first again: it reuses only what the prompt before left
            for c in configs + configs[:1]:  # the baseline twice, as the bench's self-pair
                out.setdefault((c.name, p.id), []).append(run_one(c, p).token_ids)
        return out

    fresh, kept = runs(False), runs(True)
    assert kept == fresh
    plain = {p.id: fresh[("plain", p.id)][0] for p in PROMPTS}
    assert all(ids == plain[pid] for (_, pid), v in kept.items() for ids in v)  # speculation changes nothing


def test_keep_cache_refuses_a_speculator_that_cannot_arm_after_a_reused_prefix(session, monkeypatch):
    """A draft head needs every position's trunk row, so it decodes plainly after a reused prefix: a
    bench that kept caches would time it as plain. One line naming the configuration, before any run
    (the guard reads the speculator's own flag, here turned off on n-gram)."""
    from tsspec.errors import BadInput
    from tsspec.spec.ngram import NGramSpeculator

    monkeypatch.setattr(NGramSpeculator, "can_arm_after_prefix_reuse", False)
    run_one = make_run_one(session, sampler=Sampler(SamplingParams()), max_tokens=4, encode=IDS.__getitem__,
                           keep_cache=True)
    with pytest.raises(BadInput, match=r"--keep-cache: lookup \(ngram\) cannot draft after a reused prefix"):
        run_one(BenchConfig("lookup", "ngram"), PROMPTS[0])
    plain = make_run_one(session, sampler=Sampler(SamplingParams()), max_tokens=4, encode=IDS.__getitem__,
                         keep_cache=False)
    assert len(plain(BenchConfig("lookup", "ngram"), PROMPTS[0]).token_ids) == 4  # without it, it runs
