"""Verification's fast path (all greedy rows argmaxed at once) against the plain row-by-row rule."""

from __future__ import annotations

import pytest
import torch

from tsspec.sampling import Sampler
from tsspec.spec.verify import verify, verify_match


def row_by_row(logits, draft, sampler, position, history):
    """The definition: draw each row as a plain step would, accept while it equals the draft."""
    hist = list(history)
    for i, d in enumerate(draft):
        tok = sampler.sample(logits[i], position + i, hist)
        if tok != d:
            return i, tok
        hist.append(d)
    return len(draft), sampler.sample(logits[len(draft)], position + len(draft), hist)


@pytest.mark.parametrize("seed", range(20))
def test_greedy_fast_path_equals_row_by_row(seed):
    g = torch.Generator().manual_seed(seed)
    k = 1 + seed % 8
    logits = torch.randn(k + 1, 40, generator=g)
    truth = logits.argmax(-1).tolist()
    wrong_at = seed % (k + 1)  # k + 1: every draft right
    draft = [t if i != wrong_at else (t + 1) % 40 for i, t in enumerate(truth[:k])]
    v = verify_match(logits, draft, Sampler(), 10, [1, 2, 3])
    assert (v.accepted, v.token) == row_by_row(logits, draft, Sampler(), 10, [1, 2, 3])
    assert v.accepted == min(wrong_at, k)


def test_residual_under_greedy_is_match():
    logits = torch.randn(4, 30)
    draft = logits.argmax(-1).tolist()[:2] + [0]
    q = torch.softmax(torch.randn(3, 30), -1)
    a = verify("residual", logits, draft, q, Sampler(), 5, [])
    b = verify("match", logits, draft, None, Sampler(), 5, [])
    assert (a.accepted, a.token) == (b.accepted, b.token)
