"""Sampling: greedy by default, with temperature, top-k/p, min-p and repetition penalties.

Every draw depends only on (seed, position, logits, history): the random number for position p
comes from a counter-based hash of (seed, p, stream), not from a generator's running state. A
speculative loop draws verify rows out of wall-clock order and throws some away; keyed draws make
its output identical to plain sampling with the same seed.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Sequence

import torch

from .sampling_params import SamplingParams  # noqa: F401 - re-exported: the sampler's settings

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


_NUMPY_ARGMAX = (torch.float32, torch.float64, torch.float16)


def argmax(x: torch.Tensor) -> int:
    """``int(torch.argmax(x))`` over all of x: the lowest index among tied maxima, a NaN counting as
    the maximum. A CPU float tensor goes through numpy, which gives the same index: torch's CPU
    argmax took ~130 us over a 49k vocabulary on an Intel Xeon (2% of a decode step), numpy's 5."""
    if x.device.type == "cpu" and x.dtype in _NUMPY_ARGMAX:
        return int(x.detach().reshape(-1).numpy().argmax())
    return int(torch.argmax(x))


def argmax_rows(x: torch.Tensor) -> list[int]:
    """``x.argmax(dim=-1).tolist()`` for a [rows, vocab] tensor, through numpy as ``argmax``."""
    if x.device.type == "cpu" and x.dtype in _NUMPY_ARGMAX:
        return x.detach().numpy().argmax(axis=-1).tolist()
    return x.argmax(dim=-1).tolist()


class Stream(IntEnum):
    """The keyed random streams, one per kind of draw, numbered in one place so that no two kinds
    ever decide on the same number."""

    PLAIN = 0  # a position's plain draw; the per-token drafters draw on it too (common random
    #            numbers with the trunk: under ``match`` they then pick its token where they agree)
    ACCEPT = 1  # the residual rule's accept test
    RESIDUAL = 2  # the residual rule's correction draw
    BLOCK_DRAFT = 3  # a block drafter's sampled drafts, apart from the trunk's own stream
    TREE_DRAFT = 4  # a model drafter's sampled tree nodes under the residual rule: apart from the plain
    #                 stream, which a leaf's bonus draws on at a position another branch may hold
    SIBLING_ACCEPT = 5  # the residual rule's accept test of a tree node's later children
    #                     (``spec.tree.accept_stream``: 5, 21, 37, ... one per sibling)


def keyed_uniform(seed: int, position: int, stream: int = 0) -> float:
    """A uniform number in [0, 1) that is a pure function of (seed, position, stream)."""
    h = _splitmix64(_splitmix64(_splitmix64(seed & _MASK64) ^ position) ^ stream)
    return (h >> 11) * (1.0 / (1 << 53))


class Sampler:
    """Turns one row of trunk logits into a token, the same way wherever the row came from."""

    def __init__(self, params: SamplingParams | None = None):
        self.params = (params or SamplingParams()).validate()

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    def penalize(self, logits: torch.Tensor, history: Sequence[int]) -> torch.Tensor:
        """logits [vocab] -> logits with repetition/presence/frequency penalties applied."""
        p = self.params
        if not p.has_penalties or p.repeat_last_n == 0 or not history:
            return logits
        recent = torch.as_tensor(list(history[-p.repeat_last_n :]), dtype=torch.long)
        ids, counts = torch.unique(recent, return_counts=True)
        out = logits.clone()
        sel = out[ids]
        if p.repeat_penalty != 1.0:
            sel = torch.where(sel > 0, sel / p.repeat_penalty, sel * p.repeat_penalty)
        sel = sel - counts.float() * p.frequency_penalty - p.presence_penalty
        out[ids] = sel
        return out

    def draft_history(self, history: Sequence[int]) -> list[int]:
        """What a drafter's own draws must see as history, to extend with each draft token: the
        last ``repeat_last_n`` tokens when penalties are in force, else nothing (no transform reads
        it), instead of a copy of the whole sequence per proposal."""
        p = self.params
        if not p.has_penalties or p.repeat_last_n == 0:
            return []
        return list(history[-p.repeat_last_n :])

    def probs(self, logits: torch.Tensor, history: Sequence[int]) -> torch.Tensor:
        """The distribution a draw uses: [vocab] probabilities after every transform.

        Greedy is the one-hot of the argmax, so rejection-style verification works unchanged.
        """
        x = self.penalize(logits.float(), history)
        p = self.params
        if p.greedy:
            out = torch.zeros_like(x)
            out[argmax(x)] = 1.0
            return out
        x = x / p.temperature
        if p.top_k and p.top_k < x.numel():
            keep = torch.topk(x, p.top_k).indices  # exactly k, even where logits tie
            x = torch.full_like(x, float("-inf")).scatter_(0, keep, x[keep])
        probs = torch.softmax(x, dim=-1)
        if p.min_p > 0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        if p.top_p < 1.0:
            sp, si = torch.sort(probs, descending=True)
            cum = torch.cumsum(sp, 0)
            drop = (cum - sp) > p.top_p * cum[-1]  # keep the smallest prefix reaching top_p
            sp = sp.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, si, sp)
        return probs / probs.sum()

    def draw(self, probs: torch.Tensor, position: int, stream: int = 0) -> int:
        """Inverse-CDF draw from ``probs`` keyed by (seed, position, stream)."""
        u = keyed_uniform(self.params.seed, position, stream)
        cum = torch.cumsum(probs.double(), 0)
        idx = min(int(torch.searchsorted(cum, torch.tensor([u * float(cum[-1])], dtype=torch.float64), right=True)),
                  probs.numel() - 1)
        if probs[idx] <= 0:  # rounding at the top of the CDF: step back onto the support
            idx = int(torch.nonzero(probs > 0).flatten()[-1])
        return idx

    def sample(self, logits: torch.Tensor, position: int, history: Sequence[int]) -> int:
        """The token at sequence position ``position`` given the trunk row's logits [vocab]."""
        if self.params.greedy:
            return argmax(self.penalize(logits, history))
        return self.draw(self.probs(logits, history), position)


def best_other(q: torch.Tensor, tok: int) -> tuple[float, float, int]:
    """``(q[tok], the best other token's probability, that token)`` of a distribution [vocab]: a
    drafter's second guess beside the token it drafted (``spec.tree.sibling_leaves``)."""
    top = torch.topk(q, 2)
    i = 1 if int(top.indices[0]) == tok else 0
    return float(q[tok]), float(top.values[i]), int(top.indices[i])
