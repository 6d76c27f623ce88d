"""Verification: which drafted tokens the trunk accepts, and the token it emits after them.

Words, as used throughout: a draft token is *accepted* when the trunk agrees with it; at the first
disagreement the trunk's own token is the *recovered* (corrected) token; when every draft is
accepted, the extra row's token is the *bonus* token. Either way one verify emits accepted + 1
tokens, all drawn from trunk rows.

Two rules:

* ``match`` draws each trunk row with the caller's sampler exactly as plain decoding would, and
  accepts while the draw equals the draft. Output is identical to plain decoding token for token,
  greedy or seeded.
* ``residual`` (standard speculative sampling) accepts draft x with probability min(1, p(x)/q(x))
  where p is the trunk's and q the drafter's distribution, after the same sampler transforms, and on
  rejection draws from the normalised residual max(0, p - q). It preserves the trunk's
  distribution exactly and accepts more under sampling, but a seeded run differs from a plain one.
  Under greedy decoding it reduces to ``match``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..sampling import Sampler, Stream, argmax_rows, keyed_uniform
from .plan import RULES  # noqa: F401 - the acceptance rules, named once (re-exported)


@dataclass
class Verdict:
    accepted: int  # number of draft tokens accepted
    token: int  # the recovered (accepted < len(draft)) or bonus token

    def emitted(self, draft: Sequence[int]) -> list[int]:
        return list(draft[: self.accepted]) + [self.token]


def verify_match(
    logits: torch.Tensor,  # [len(draft) + 1, vocab] trunk rows for [last, d1..dK]
    draft: Sequence[int],
    sampler: Sampler,
    position: int,  # sequence position of d1
    history: Sequence[int],  # tokens before d1 (prompt + emitted, last included)
) -> Verdict:
    if sampler.greedy and not sampler.params.has_penalties:
        drawn = argmax_rows(logits)  # all rows at once: same argmax as a plain step
        for i, d in enumerate(draft):
            if drawn[i] != d:
                return Verdict(i, drawn[i])
        return Verdict(len(draft), drawn[len(draft)])
    hist = list(history)
    for i, d in enumerate(draft):
        tok = sampler.sample(logits[i], position + i, hist)
        if tok != d:
            return Verdict(i, tok)
        hist.append(d)
    return Verdict(len(draft), sampler.sample(logits[len(draft)], position + len(draft), hist))


def verify_residual(
    logits: torch.Tensor,  # [K + 1, vocab]
    draft: Sequence[int],
    draft_probs: torch.Tensor,  # [K, vocab] drafter distribution q, after the sampler transforms
    sampler: Sampler,
    position: int,
    history: Sequence[int],
) -> Verdict:
    seed = sampler.params.seed
    hist = list(history)
    for i, d in enumerate(draft):
        p = sampler.probs(logits[i], hist)  # trunk distribution at this row
        q = draft_probs[i]
        px, qx = float(p[d]), float(q[d])
        if qx > 0 and keyed_uniform(seed, position + i, Stream.ACCEPT) * qx < px:
            hist.append(d)
            continue
        residual = torch.clamp(p - q, min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: any draw from p is exact
            residual = p
        return Verdict(i, sampler.draw(residual / residual.sum(), position + i, Stream.RESIDUAL))
    return Verdict(len(draft), sampler.sample(logits[len(draft)], position + len(draft), hist))


def verify(
    rule: str,
    logits: torch.Tensor,
    draft: Sequence[int],
    draft_probs: torch.Tensor | None,
    sampler: Sampler,
    position: int,
    history: Sequence[int],
) -> Verdict:
    """Apply ``rule``; ``residual`` without a drafter distribution (or under greedy) is ``match``."""
    if rule == "residual" and draft_probs is not None and not sampler.greedy:
        return verify_residual(logits, draft, draft_probs, sampler, position, history)
    return verify_match(logits, draft, sampler, position, history)
