"""The three layers of speculative decoding, as small explicit protocols.

    target (trunk model)   !=   speculator (algorithm)   !=   draft weights (adapter)
    SpecTarget, Cache           Speculator                    DraftHead
    (tsspec.models.protocols)   (here)                        (tsspec.drafters.protocols)

The shared loop (``tsspec.spec.loop``) talks to a ``SpecTarget`` and a ``Speculator`` and
nothing else; it never asks which model or which algorithm it drives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, Sequence, runtime_checkable

import torch

if TYPE_CHECKING:
    from ..sampling import Sampler


# ----------------------------------------------------------------------------- layers 1 and 3

# the target's and the draft weights' protocols live beside their implementations (imports point
# one way: spec -> models, drafters); the loop and the speculators read them from here
from ..drafters.protocols import DraftHead, DraftHeadKind  # noqa: E402,F401
from ..models.protocols import BatchedTarget, Cache, ForwardItem, ForwardOutput, SpecTarget  # noqa: E402,F401

__all__ = ["BatchedTarget", "Cache", "ForwardItem", "Draft", "DraftContext", "DraftHead", "DraftHeadKind", "ForwardOutput", "MinDraftProb",
           "SpecTarget", "Speculator"]


from .tree import depths  # noqa: E402 (spec.tree imports no protocol)


# ----------------------------------------------------------------------------- layer 2: speculator


@dataclass
class DraftContext:
    """Everything a speculator may read when proposing; one value so new signals are new fields."""

    last_token: int  # sampled but not yet in the trunk's KV
    position: int  # committed cache length == position last_token will take
    max_tokens: int  # bounded by the window, the token budget and the context headroom
    history: Sequence[int]  # prompt + emitted tokens, last_token included
    hidden: torch.Tensor | None = None  # [feature] trunk hidden row that produced last_token
    # the caller's sampler, so a drafter can replay its transforms on its own logits
    # (``sampler.probs(logits, history)``: temperature, penalties, top-k/p) and make keyed draws
    sampler: "Sampler | None" = None
    # the cost governor's confidence gate: the least chance of landing for which a drafted token pays
    # at the measured costs (None: not measured yet, or no governor); a speculator whose drafter has
    # calibrated confidences uses it unless --spec-pmin was given
    min_prob: float | None = None


@dataclass
class Draft:
    """A proposal: tokens, and optionally the drafter's distribution each was drawn from."""

    tokens: list[int] = field(default_factory=list)
    # [len(tokens), vocab] probabilities after the sampler's transforms, for the residual rule; in a
    # tree, row i is the distribution token i was proposed from (a one-hot where it was picked, not
    # drawn: ``tree.walk_residual``)
    probs: torch.Tensor | None = None
    # ms of one-off work inside this proposal, not part of what a draft costs step after step: a
    # drafter catching up on the tokens it missed while parked, or restarting its cache. The
    # governor judges a draft's cost without it and bounds how often such work is paid for.
    setup_ms: float = 0.0
    # a token tree (None: a chain): each token's parent as an index among ``tokens``, -1 for one
    # that follows the last emitted token; parents first, distinct siblings (``spec/tree.py``).
    # Only a trunk that shares one forward among rows verifies trees (not a recurrent one).
    parents: list[int] | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depth(self) -> int:
        """How far the draft reaches past the last emitted token: a chain's length, a tree's
        deepest node's depth (what a verify can accept at most)."""
        if self.parents is None:
            return len(self.tokens)
        return max(depths(self.parents), default=0)


class MinDraftProb:
    """The ``--spec-pmin`` attribute every speculator carries: validated on every assignment, and
    ``None`` means the class's own ``default_min_draft_prob`` (each algorithm gates differently)."""

    def __set_name__(self, owner, name: str) -> None:
        self.attr = "_" + name

    def __get__(self, obj, owner=None):
        return self if obj is None else getattr(obj, self.attr)

    def __set__(self, obj, value: float | None) -> None:
        v = type(obj).default_min_draft_prob if value is None else float(value)
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"--spec-pmin for {obj.name} must be in [0, 1], got {v}")
        setattr(obj, self.attr, v)


@runtime_checkable
class Speculator(Protocol):
    name: str
    max_draft_tokens: int
    min_draft_prob: float
    default_min_draft_prob: float
    needs_hidden_state: bool  # wants trunk hidden rows (taps) with every verify
    # optional, read through ``tap_horizon()`` (absent: every row is tapped): ``tap_horizon``, how
    # many of the newest committed rows it needs tapped before a proposal
    can_arm_after_prefix_reuse: bool  # optional: absent means False (see ``arms_after_prefix_reuse``)
    default_accept_rule: str  # "match" or "residual"

    @property
    def taps(self) -> tuple[int, ...]:
        """Trunk layers whose entering residuals this speculator reads (empty: none)."""
        ...

    def begin(self, prompt: Sequence[int], hidden: torch.Tensor | None) -> None:
        """A new sequence: the prompt went through the trunk (``hidden``: its tap rows, if asked)."""
        ...

    def propose(self, ctx: DraftContext) -> Draft: ...

    def commit(self, tokens: Sequence[int], hidden: torch.Tensor | None, start_pos: int) -> None:
        """Tokens that actually landed in the trunk at ``start_pos``.., with their exact tap rows."""
        ...

    def reset(self) -> None: ...


@runtime_checkable
class Governor(Protocol):
    """What the loop asks of a cost governor (``governor.SpeculationCostGovernor`` is the one
    tsspec has): whether to draft, how long, how sure a drafted token must be, and what each step
    cost; ``state`` and ``parks`` for the statistics."""

    parks: int

    @property
    def state(self) -> str: ...

    def begin_sequence(self) -> None: ...

    def should_draft(self) -> bool: ...

    def draft_length(self, window: int) -> int: ...

    def min_draft_prob(self) -> float | None: ...

    def record(self, speculative: bool, ms: float, tokens: int, drafted: int | None = None,
               setup_ms: float = 0.0, shared: int = 1) -> None:
        """``shared``: the decoding sequences whose rows the step's forward carried, this one included."""
        ...


def tap_horizon(speculator) -> int | None:
    """How many of the newest committed rows ``speculator`` needs tapped before it proposes, or
    None: every row. A speculator that tolerates gaps in its tap rows (a block drafter's ring records
    which position each row holds) says how many it wants; then a step that cannot be followed by a
    proposal within that many steps (the governor has it parked for longer) forwards no taps, and a
    parked stretch costs neither the tap copies nor the refill of rows the drafter would not read."""
    h = getattr(speculator, "tap_horizon", None)
    return None if h is None else max(1, int(h))


def drafts_within(governor, steps: int) -> bool:
    """Whether ``governor`` may ask for a draft within the next ``steps`` steps (a governor that does
    not say: yes)."""
    ask = getattr(governor, "drafts_within", None)
    return True if ask is None else bool(ask(steps))


def arms_after_prefix_reuse(speculator) -> bool:
    """Whether ``speculator`` may draft for a sequence that begins from a KV prefix it never saw.

    The design's default is False: a speculator that does not say otherwise is assumed to chain
    per-position state (as a NextN/MTP head does) that a gap would make garbage, so it is left out
    of that sequence rather than asked. Only one that opts in (n-gram, a block drafter, a draft
    model) arms after a reused prefix."""
    return bool(getattr(speculator, "can_arm_after_prefix_reuse", False))
