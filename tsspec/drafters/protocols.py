"""Layer 3, the draft weights: the protocol of a model-specific adapter over a trained drafter.

Defined here, beside the adapters that implement it, so imports point one way (spec -> drafters).
``tsspec.spec.protocols`` re-exports these beside the speculator's protocol.
"""

from __future__ import annotations

import enum
from typing import Protocol, Sequence

import torch


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
        """One token: (logits, hidden_out [feature]) for the next position. The logits are over the
        trunk's vocabulary, or over the head's own reduced one when the head has ``pick(logits) ->
        (token, confidence)`` to read them."""
        ...

    def draft_block(
        self, last_token: int, hidden: torch.Tensor, position: int, state
    ) -> tuple[list[int], torch.Tensor]:
        """A whole block: (draft tokens, per-token confidence)."""
        ...

    def catch_up(self, tokens: Sequence[int], hidden: torch.Tensor, start_pos: int, state) -> None: ...
