"""The three layers of speculative decoding, as small explicit protocols.

    target (trunk model)   !=   speculator (algorithm)   !=   draft weights (adapter)
    SpecTarget                  Speculator                    DraftHead

The shared loop (``tsspec.spec.loop``) talks to a ``SpecTarget`` and a ``Speculator`` and
nothing else; it never asks which model or which algorithm it drives.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, Sequence, runtime_checkable

import torch

if TYPE_CHECKING:
    from ..sampling import Sampler


# ----------------------------------------------------------------------------- layer 1: target


@dataclass
class ForwardOutput:
    """What one trunk forward returns."""

    logits: torch.Tensor  # [rows, vocab] float32; rows = all new tokens, or only the last
    hidden: torch.Tensor | None = None  # [rows, feature_size] float32 when taps were asked for


@runtime_checkable
class Cache(Protocol):
    """One sequence's state inside a trunk (or a drafter): created by its model, passed to ``forward``.

    ``trim`` is the whole rollback surface: a KV cache moves its length back; a hybrid trunk's cache
    returns its recurrent state to the kept row of the last verify (see ``models.cache``).
    """

    @property
    def length(self) -> int:
        """Positions held; the next forward's first row takes this position."""
        ...

    def reserve(self, n: int) -> None:
        """Room for ``n`` positions, or a ``BadInput`` naming the context limit."""
        ...

    def trim(self, n: int) -> None:
        """Forget the last ``n`` positions (for a hybrid: only back into the last multi-row forward)."""
        ...

    def reset(self) -> None: ...


@runtime_checkable
class SpecTarget(Protocol):
    """What the loop needs from the trunk, and nothing about drafting.

    The model holds weights only; ``make_cache()`` gives each sequence its own ``Cache``.
    ``forward`` appends ``tokens`` to ``cache`` at ``cache.length`` and returns per-row logits.
    ``taps`` names layers whose *entering* residual is returned per row, concatenated in the
    order given; tap ``n_layers`` is the residual after the last layer (before the final norm).
    A row's logits never depend on how many rows share the forward (batch invariance): that is
    what makes speculative output identical to plain output.
    """

    vocab_size: int
    n_layers: int
    hidden_size: int

    @property
    def max_context(self) -> int: ...

    def make_cache(self) -> Cache: ...

    def forward(
        self, tokens: Sequence[int], cache: Cache, *, all_logits: bool = False, taps: Sequence[int] | None = None
    ) -> ForwardOutput: ...


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


@dataclass
class Draft:
    """A proposal: tokens, and optionally the drafter's distribution each was drawn from."""

    tokens: list[int] = field(default_factory=list)
    # [len(tokens), vocab] probabilities after the sampler's transforms, for the residual rule
    probs: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.tokens)


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
    can_arm_after_prefix_reuse: bool
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


# ----------------------------------------------------------------------------- layer 3: draft weights


class DraftHeadKind(enum.Enum):
    NONE = "none"
    PER_TOKEN = "per-token"
    BLOCK = "block"


class DraftHead(Protocol):
    """A model-specific adapter over a trained drafter (NextN/MTP, EAGLE, DFlash): weights only.

    Its per-sequence state (the head's own KV, a block drafter's ring) comes from ``new_state()``
    and is held by the speculator, so one loaded head serves several sequences."""

    kind: DraftHeadKind
    block_size: int

    def new_state(self): ...

    def draft_step(
        self, token: int, hidden: torch.Tensor, position: int, state
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token: (logits [vocab], hidden_out [feature]) for the next position."""
        ...

    def draft_block(
        self, last_token: int, hidden: torch.Tensor, position: int, state
    ) -> tuple[list[int], torch.Tensor]:
        """A whole block: (draft tokens, per-token confidence)."""
        ...

    def catch_up(self, tokens: Sequence[int], hidden: torch.Tensor, start_pos: int, state) -> None: ...
