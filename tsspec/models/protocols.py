"""Layer 1, the target: what the decoding loop needs from a trunk model, and nothing about drafting.

Defined here, below the models that implement it, so imports point one way (spec -> models).
``tsspec.spec.protocols`` re-exports these beside the speculator's protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol, Sequence, runtime_checkable

import torch

if TYPE_CHECKING:
    from .head_rows import HeadRows


# ----------------------------------------------------------------------------- layer 1: target


@dataclass
class ForwardOutput:
    """What one trunk forward returns."""

    logits: torch.Tensor  # [rows, vocab] float32; rows = all new tokens, or only the last
    hidden: torch.Tensor | None = None  # [rows, feature_size] float32 when taps were asked for


class ForwardItem(NamedTuple):
    """One sequence's part of a forward shared by several (``BatchedTarget.forward_batch``)."""

    tokens: Sequence[int]
    cache: "Cache"
    all_logits: bool = False
    taps: Sequence[int] | None = None
    # a token tree (None: the tokens are a chain): each token's parent as an index among these
    # tokens, -1 for one that follows the cache directly, parents before children. Token i sits at
    # the cache's length + its depth and attends to the cache and its own ancestors only; its row
    # is written to slot length + i (``KVCache.keep`` moves an accepted path into place).
    parents: Sequence[int] | None = None
    # a tree grown over several forwards (a drafter expanding its best nodes depth by depth): the
    # cache position where the tree's nodes begin, node j at slot base + j. The nodes between base
    # and the cache's length came from earlier forwards, and ``parents`` then names the parents of
    # every node, those first (``runners.tree_layout``). None: the tree begins with these tokens.
    base: int | None = None
    # the tokens are prompt tokens: every run forwards them alike (plain or speculative, in any
    # chunking), so a trunk may give their rows another arithmetic than generated rows' (the native
    # blocks' super-block route, kernels/prompt_tiles.c). Never a tree.
    prompt: bool = False
    # logits for part of the vocabulary only (``head_rows.HeadRows``: every other id -inf), for a
    # drafter that chooses among fewer tokens; None: the whole head. Every item of one forward asks
    # for the same.
    vocab: "HeadRows | None" = None


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

    def set_rollback_window(self, window: int) -> None:
        """The verify window the decoding loop runs (0: plain decoding): what a trim may undo."""
        ...

    def rollback_bytes(self) -> int:
        """Memory held now to undo a verify, as allocated (0 for a KV cache: its trim is arithmetic)."""
        ...


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


@runtime_checkable
class BatchedTarget(SpecTarget, Protocol):
    """A ``SpecTarget`` that can give several sequences' rows one forward.

    ``batches_sequences``: True when ``forward_batch`` really shares the forward (the products run
    once over every item's rows, attention stays per sequence); False when it runs the items one
    after another (a trunk whose per-sequence state cannot share a pass, such as a hybrid's). Either
    way item i's output is bitwise ``forward(*items[i])``'s, so the choice changes cost, never
    tokens. A target without the attribute is driven one ``forward`` per sequence (``spec.loop.forward_each``).
    """

    batches_sequences: bool

    def forward_batch(self, items: Sequence[ForwardItem]) -> list[ForwardOutput]: ...

