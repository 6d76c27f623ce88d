"""Sampling is pure: each draw is a function of (seed, position, logits, history)."""

from __future__ import annotations

import pytest
import torch

from tsspec.errors import BadInput
from tsspec.sampling import Sampler, SamplingParams, argmax, argmax_rows, keyed_uniform


def test_keyed_uniform_is_a_pure_function_and_spread():
    assert keyed_uniform(7, 100, 0) == keyed_uniform(7, 100, 0)
    us = [keyed_uniform(7, p, 0) for p in range(4000)]
    assert all(0.0 <= u < 1.0 for u in us)
    assert abs(sum(us) / len(us) - 0.5) < 0.02
    assert keyed_uniform(7, 100, 0) != keyed_uniform(8, 100, 0) != keyed_uniform(7, 100, 1)


def test_draw_depends_only_on_seed_position_and_distribution():
    s = Sampler(SamplingParams(temperature=1.0, seed=3))
    probs = torch.softmax(torch.randn(50), 0)
    order = [s.draw(probs, p) for p in range(200)]
    again = [s.draw(probs, p) for p in reversed(range(200))][::-1]  # out of order: same draws
    assert order == again


def test_draw_never_leaves_the_support():
    s = Sampler(SamplingParams(temperature=1.0))
    probs = torch.zeros(10)
    probs[[1, 4]] = torch.tensor([0.3, 0.7])
    drawn = {s.draw(probs, p) for p in range(2000)}
    assert drawn == {1, 4}


def test_greedy_probs_are_one_hot_at_the_argmax():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    p = Sampler().probs(logits, [])
    assert p.tolist() == [0.0, 1.0, 0.0, 0.0]
    assert Sampler().sample(logits, 5, []) == 1


def test_top_k_keeps_exactly_k_even_with_ties():
    s = Sampler(SamplingParams(temperature=1.0, top_k=2))
    p = s.probs(torch.tensor([1.0, 1.0, 1.0, 0.0]), [])
    assert int((p > 0).sum()) == 2


def test_penalties_change_recent_tokens_only():
    s = Sampler(SamplingParams(repeat_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25))
    out = s.penalize(torch.tensor([4.0, -4.0, 4.0]), [0, 1, 1])
    assert out.tolist() == [4.0 / 2 - 0.5 - 0.25, -4.0 * 2 - 1.0 - 0.25, 4.0]


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(top_p=0), dict(min_p=1), dict(repeat_penalty=0)])
def test_bad_parameters_are_one_line(kw):
    with pytest.raises(BadInput):
        Sampler(SamplingParams(**kw))


def test_draft_history_is_all_the_transforms_read():
    """A drafter extends ``draft_history`` with its drafts instead of copying the whole sequence:
    the distribution it then draws from is the one the full history gives, with and without
    penalties."""
    import torch

    from tsspec.sampling import Sampler, SamplingParams

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, generator=g)
    history = torch.randint(0, 50, (300,), generator=g).tolist()
    drafts = [3, 3, 7]
    for params in (SamplingParams(temperature=0.8, seed=1),
                   SamplingParams(temperature=0.8, seed=1, repeat_penalty=1.3, repeat_last_n=16,
                                  frequency_penalty=0.2, presence_penalty=0.1)):
        s = Sampler(params)
        short = s.draft_history(history)
        assert len(short) <= 16
        assert torch.equal(s.probs(logits, short + drafts), s.probs(logits, history + drafts))


def _argmax_cases():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 1000, generator=g)
    ties = torch.zeros(3, 50)
    ties[:, [7, 9, 40]] = 2.0  # tied maxima: the lowest index
    nan = torch.randn(2, 30, generator=g)
    nan[0, 11] = float("nan")
    nan[1, [4, 20]] = float("nan")  # NaN counts as the maximum, the first one wins
    ninf = torch.full((2, 9), float("-inf"))
    return [x, ties, nan, ninf, x.to(torch.float64), x.to(torch.float16), x.to(torch.bfloat16), x[:, ::3]]


@pytest.mark.parametrize("i", range(8))
def test_argmax_helpers_equal_torch(i):
    x = _argmax_cases()[i]
    assert argmax_rows(x) == x.argmax(dim=-1).tolist()
    for row in x:
        assert argmax(row) == int(torch.argmax(row))
    assert argmax(x[:1]) == int(torch.argmax(x[:1]))
    with torch.inference_mode():
        y = x.clone()
        assert argmax_rows(y) == x.argmax(dim=-1).tolist()
