"""Per-sequence state of a trunk: caches as objects, created by the model and passed to ``forward``.

A loaded model holds weights only. Each sequence it serves has its own cache, so one model runs
many sequences, and a cache that is kept can be extended later (the basis of prefix reuse).

Every cache has the same small surface the decoding loop uses:

* ``length``: positions it holds; the next forward's first row takes position ``length``;
* ``reserve(n)``: make room for ``n`` positions (or refuse, naming the context limit);
* ``trim(n)``: forget the last ``n`` positions (a rejected draft tail);
* ``reset()``: forget everything.

``KVCache`` (attention-only trunks): preallocated K/V for every layer; trimming is arithmetic.

``HybridCache`` (GatedDeltaNet + attention trunks): the attention layers' ``KVCache`` plus each
recurrent layer's state. A recurrent state cannot be trimmed by arithmetic, so the cache keeps what
a trim needs, in one of two ways:

* per-row slots (the default): a multi-row forward of at most ``ROW_FORM_MAX`` rows, and at most
  the verify window + 1 where the decoding loop has said its window (``set_rollback_window``: a
  prompt longer than that is never rolled back and updates the state in place), leaves the live
  state alone and writes the state after *every* row into ``RollbackSlots`` (two buffers used in
  turn, never more than window + 1 rows each); the conv window after row m is a slice of the input the forward concatenated anyway. The
  forward is *pending* until the next forward (all rows kept) or a ``trim`` (some kept), which
  points the live state at the kept row's slot: no copy, no re-forward;
* copies (``snapshots=False``, ``TS_Q35_VERIFY_SNAPSHOTS=0``): a multi-row forward first copies the
  live state and updates it in place; a ``trim`` puts the copy back and queues the kept tokens for
  *replay*, which the model's next forward runs ahead of its own rows (their K/V are rewritten with
  the same values, their outputs dropped).

How a hybrid keeps n rows is therefore the cache's business; the loop only ever calls ``trim``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from .config import INITIAL_CAPACITY, SPAN_BLOCK, CacheRoom, round_span  # noqa: F401 - re-exported
from .gated_delta import RecurrentState

# hybrid forwards of at most this many rows use the batch-invariant row form (>= the largest verify)
ROW_FORM_MAX = 65


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):  # the usual case (a kept cache the next prompt extends): one compare
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


class KVCache(CacheRoom):
    """Preallocated K/V for ``n_layers`` attention layers, grown on demand up to ``max_positions``
    (``config.CacheRoom``: ``capacity``, ``reserve``)."""

    def __init__(self, n_layers: int, n_kv: int, head_dim: int, max_positions: int,
                 capacity: int = INITIAL_CAPACITY, device=None):
        self.max_positions = max_positions
        capacity = self.first_capacity(max_positions, capacity)
        self.k = torch.zeros(n_layers, n_kv, capacity, head_dim, device=device)  # the model's device
        self.v = torch.zeros(n_layers, n_kv, capacity, head_dim, device=device)
        self.length = 0

    def _grown(self, a: torch.Tensor, capacity: int) -> torch.Tensor:
        new = a.new_zeros(a.shape[0], a.shape[1], capacity, a.shape[3])
        new[:, :, : a.shape[2]] = a
        return new

    def set_rollback_window(self, window: int) -> None:
        """Nothing to size: a KV cache's trim is arithmetic."""

    def rollback_bytes(self) -> int:
        return 0

    def trim(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot trim {n} positions from a cache of {self.length}")
        self.length -= n

    def reset(self) -> None:
        self.length = 0

    def keep(self, n: int) -> int:
        """Keep at most the first ``n`` positions; -> how many are kept."""
        if n < self.length:
            self.length = max(n, 0)
        return self.length

    def keep_path(self, start: int, rows: Sequence[int]) -> None:
        """After a token tree's forward from ``start``: keep the tree rows ``rows`` (indices among
        its tokens, increasing: an accepted path, root first) as positions start, start + 1, ...
        and drop the rest. Each row's K/V moves from its slot ``start + rows[j]`` to ``start + j``."""
        if any(b <= a for a, b in zip(rows, rows[1:])) or (rows and (rows[0] < 0 or start + rows[-1] >= self.length)):
            raise ValueError(f"keep_path: rows {list(rows)} are not increasing tree rows after {start}")
        for j, r in enumerate(rows):
            if r != j:
                self.k[:, :, start + j] = self.k[:, :, start + r]
                self.v[:, :, start + j] = self.v[:, :, start + r]
        self.length = start + len(rows)

    def nbytes(self) -> int:
        return self.k.numel() * 4 + self.v.numel() * 4


class RollbackSlots:
    """Per-row recurrent states of one multi-row forward: what a trim commits from.

    ``ssm[b]`` [layers][rows, H, dk, dv] are two buffers used in turn, so the one the live state
    points into is never the one the next forward writes. Conv windows are slices of ``conv_cat``.
    """

    def __init__(self) -> None:
        self.ssm: list[list[torch.Tensor]] = [[], []]
        self.rows = 0
        self.nbytes = 0  # what the two buffers hold, as allocated (set when they are)

    def ensure(self, rows: int, shapes: list[tuple[int, ...]]) -> bool:
        """Grow to ``rows`` rows; True when the buffers were reallocated."""
        if rows <= self.rows:
            return False
        self.ssm = [[torch.empty(rows, *s) for s in shapes] for _ in range(2)]
        self.rows = rows
        self.nbytes = sum(t.numel() * t.element_size() for buf in self.ssm for t in buf)
        return True


@dataclass
class Pending:
    """A multi-row forward whose rows' states sit in slots until the next forward or trim."""

    start: int  # position of the forward's first row
    n: int
    buf: int  # which RollbackSlots buffer holds its rows
    conv_cat: list[torch.Tensor] = field(default_factory=list)  # per recurrent layer [K-1+n, C]


@dataclass
class Saved:
    """Copy mode: the live state before the last multi-row forward, and that forward's tokens."""

    start: int
    states: list[RecurrentState]
    tokens: list[int]


class HybridCache:
    """KV for the attention layers plus the recurrent state of every GatedDeltaNet layer."""

    def __init__(self, kv: KVCache, conv_shape: tuple[int, int], ssm_shape: tuple[int, int, int], n_recurrent: int,
                 *, snapshots: bool = True):
        self.kv = kv
        self.conv_shape, self.ssm_shape, self.n_recurrent = conv_shape, ssm_shape, n_recurrent
        self.snapshots = snapshots
        self.slots = RollbackSlots()
        # the most rows a forward that may be rolled back has (a verify: the window + 1); a longer
        # multi-row forward (a prompt, a chunk of one) updates the state in place and holds no
        # per-row states. None: any multi-row forward may be rolled back (a direct caller's).
        self.rollback_rows: int | None = None
        self.reset()

    # -- the loop's surface ----------------------------------------------------------------------
    @property
    def length(self) -> int:
        return self.kv.length

    def reserve(self, n: int) -> None:
        self.kv.reserve(n)

    def reset(self) -> None:
        self.kv.reset()
        self.states = [RecurrentState(torch.zeros(self.conv_shape), torch.zeros(self.ssm_shape))
                       for _ in range(self.n_recurrent)]
        self.state_len = 0  # positions the live recurrent state has absorbed
        self.live_buf: int | None = None  # slot buffer the live state points into
        self.pending: Pending | None = None
        self.saved: Saved | None = None
        self.replay: list[int] = []  # copy mode: kept tokens the next forward runs first

    def trim(self, n: int) -> None:
        if n == 0:
            return
        keep = self.length - n
        if not 0 <= keep < self.length:
            raise ValueError(f"cannot trim {n} positions from a cache of {self.length}")
        if keep == 0:
            self.reset()
            return
        if not self._can_return_to(keep):
            raise ValueError(f"the recurrent state cannot return to position {keep}: only a trim inside "
                             "the last multi-row forward can be undone")
        p, s = self.pending, self.saved
        if p is not None and p.start < keep <= p.start + p.n:
            self.kv.trim(n)
            self._commit(keep)
        elif p is not None and keep == p.start:  # none of its rows kept: the live state never moved
            self.kv.trim(n)
            self.pending = None
        elif s is not None and not self.replay and s.start <= keep < s.start + len(s.tokens):
            self.kv.trim(n)
            self.states, self.state_len = s.states, s.start
            self.replay = s.tokens[: keep - s.start]
            self.saved = None
            self.live_buf = None

    def _can_return_to(self, keep: int) -> bool:
        p, s = self.pending, self.saved
        return ((p is not None and p.start <= keep <= p.start + p.n)
                or (s is not None and not self.replay and s.start <= keep < s.start + len(s.tokens)))

    def keep(self, n: int) -> int:
        """Keep at most the first ``n`` positions; a recurrent state that cannot return that far
        starts over (0 kept); -> how many are kept."""
        n = max(n, 0)
        if n >= self.length:
            return self.length
        if n and self._can_return_to(n):
            self.trim(self.length - n)
        else:
            self.reset()
        return self.length

    def snapshot(self) -> tuple[int, list[RecurrentState]]:
        """A copy of the state at ``length``, for ``restore``: how a caller that goes on in one-row
        forwards past a point it may have to return to (a recurrent draft model drafting) gets back."""
        return self.length, [s.clone() for s in self.live_states()]

    def restore(self, snap: tuple[int, list[RecurrentState]]) -> None:
        """Return to a ``snapshot`` taken at a length this cache has not gone below since. The
        snapshot's states become the live ones (not copied again): it is used up."""
        length, states = snap
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot restore a state at {length} in a cache of {self.length}")
        self.kv.trim(self.kv.length - length)
        self.states = states
        self.state_len = length
        self.pending, self.saved, self.replay, self.live_buf = None, None, [], None

    # -- what the model's forward uses -----------------------------------------------------------
    def settle(self) -> None:
        """Every row of a pending forward was kept: the live state moves to its last slot."""
        if self.pending is not None:
            self._commit(self.length)

    def live_states(self) -> list[RecurrentState]:
        """The live state of every recurrent layer at ``length`` (settles a pending forward)."""
        if self.replay:
            raise ValueError("the state is behind by the tokens queued for replay")
        self.settle()
        return self.states

    def set_rollback_window(self, window: int) -> None:
        """The verify window the decoding loop runs (0: plain decoding, nothing is ever rolled back):
        the slot buffers hold at most window + 1 rows from now on, larger ones left by an earlier
        run are released (the live state moved out of them first)."""
        rows = max(0, window) + 1
        self.rollback_rows = rows
        if self.slots.rows > rows:
            self.settle()
            if self.live_buf is not None:  # the live state is a view into a slot: copy it out
                for st in self.states:
                    st.ssm = st.ssm.clone()
                    st.conv = st.conv.clone()
                self.live_buf = None
            self.slots = RollbackSlots()

    def rollback_bytes(self) -> int:
        """The memory held to undo a verify: the per-row slot buffers as allocated and the conv
        windows of a forward still pending; in copy mode the one copy of the state a verify takes
        (none where nothing is ever rolled back). Arithmetic only: the loop asks after every step."""
        if not self.snapshots:
            if self.rollback_rows is not None and self.rollback_rows <= 1:
                return 0
            (k1, c), ssm = self.conv_shape, self.ssm_shape
            return self.n_recurrent * (k1 * c + ssm[0] * ssm[1] * ssm[2]) * 4
        if self.pending is None:
            return self.slots.nbytes
        k1, c = self.conv_shape
        return self.slots.nbytes + self.n_recurrent * (k1 + self.pending.n) * c * 4

    def plan(self, tokens: Sequence[int]) -> str:
        """Called at the start of a forward over ``tokens`` (replay included): how it treats the state.

        "inplace": the live state is updated row by row (one row; more rows than ``rollback_rows``,
        a prompt; or copy mode, after copying);
        "slots": every row's state goes to a slot buffer, the live state is untouched;
        "chunked": a prompt chunk longer than ``ROW_FORM_MAX`` (the parallel form, in place).
        """
        self.settle()
        if self.length - len(self.replay) != self.state_len:
            raise ValueError(f"KV length {self.length} and recurrent state length {self.state_len} disagree")
        n = len(tokens)
        self.saved = None
        if n > ROW_FORM_MAX:
            return "chunked"
        if n == 1 or (self.rollback_rows is not None and n - len(self.replay) > self.rollback_rows):
            return "inplace"  # a prompt or a chunk of one: never rolled back, no per-row states
        if not self.snapshots:
            self.saved = Saved(self.state_len, [s.clone() for s in self.states], list(tokens))
            return "inplace"
        shapes = [self.ssm_shape] * self.n_recurrent
        if self.slots.ensure(n, shapes):
            self.live_buf = None
        self.pending = Pending(self.state_len, n, 1 if self.live_buf == 0 else 0)
        return "slots"

    def slot_rows(self, layer: int) -> torch.Tensor:
        return self.slots.ssm[self.pending.buf][layer]

    def finish(self, n: int, mode: str) -> None:
        """After a forward of ``n`` rows (replay included) that started at ``state_len``."""
        self.replay = []
        self.kv.length = self.state_len + n
        if mode != "slots":
            self.state_len += n

    def _commit(self, length: int) -> None:
        p = self.pending
        slot = length - p.start - 1
        k1 = self.conv_shape[0]
        for j, st in enumerate(self.states):
            st.ssm = self.slots.ssm[p.buf][j][slot]
            st.conv = p.conv_cat[j][slot + 1 : slot + 1 + k1]
        self.live_buf = p.buf
        self.state_len = length
        self.pending = None
