"""Logits for part of the vocabulary: the LM head's rows for the first ``prefix`` ids and a few more.

A draft model's LM head is a large share of its step: qwen2.5-coder-0.5b's Q8_0 head (151,936 x 896)
is 145 MB of the 391 MB a one-row step streams, about 4.5 ms of its 17.6 (AMX Xeon, 2 threads). Its
drafts are only guesses that the trunk verifies, so a drafter may choose among fewer tokens: byte-pair
vocabularies number their tokens in merge order, so the first ids are the common ones, and the ids a
sequence has already used (an identifier of the prompt, a rare word it repeats) are the likely
others. ``HeadRows`` computes those logits only, and every other id gets -inf: a drafter whose
vocabulary is cut can never propose a token outside it, and nothing it proposes reaches the output
without the trunk's own row.

Contract:

* ``logits(x)`` -> [m, vocab] float32 for the rows ``x`` [m, d] (after the blocks, before the
  final norm): each kept id's value has the bits the whole head gives it (a head row's product does
  not depend on which other rows are computed; ``tests/test_head_rows.py`` holds them equal), soft-
  capped as the model's ``_output`` caps, and -inf for every other id.
* On the native head (``kernels.FusedOutput``) it computes only the kept rows: the prefix as a view of
  the head's first rows (no copy) and the extra ids as a gathered copy of their rows, refreshed when
  ``add`` brings new ids. Elsewhere (a torch or GPU head) it computes the whole head and masks it:
  the same values, no saving.
* ``add(ids)`` keeps ids at or past ``prefix`` (below it they are kept already); out-of-range ids
  are ignored.
"""

from __future__ import annotations

import ctypes
from typing import Iterable

import numpy as np
import torch


class HeadRows:
    def __init__(self, model, prefix: int) -> None:
        if prefix < 1:
            raise ValueError(f"a vocabulary prefix needs >= 1 id, got {prefix}")
        self.vocab = model.cfg.vocab_size
        self.prefix = min(prefix, self.vocab)
        self._model = model
        self._extra: list[int] = []  # kept ids past the prefix, in the order added
        self._seen: set[int] = set()
        self._native = self._native_head(model)
        self._prefix_out = self._view(self.prefix) if self._native is not None else None
        self._extra_out = None  # a FusedOutput over the gathered rows of ``_extra``
        self._extra_ids: torch.Tensor | None = None

    @property
    def size(self) -> int:
        """How many ids the drafter chooses among."""
        return self.prefix + len(self._extra)

    @staticmethod
    def _native_head(model):
        fused = getattr(getattr(model, "runner", None), "fused", None)
        out = getattr(fused, "output", None)
        lm = getattr(model, "lm_head", None)
        if out is None or lm is None or getattr(lm, "fmt", None) != "gguf" or len(lm.parts) != 1 or lm.bias is not None:
            return None
        return out

    def _view(self, n: int):
        """A FusedOutput over the head's first ``n`` rows (the same memory)."""
        from .. import kernels

        full = self._native
        c = kernels.CLinear()
        ctypes.pointer(c)[0] = full.head  # a copy of the structure, not of the weights
        c.n[0] = n
        c.n_total = n
        return kernels.FusedOutput(c, full.norm, full.eps, [full])

    def keeps(self, token: int) -> bool:
        """Whether ``token`` has a logit here."""
        return 0 <= token < self.prefix or token in self._seen

    def add(self, ids: Iterable[int]) -> None:
        new = [i for i in dict.fromkeys(int(t) for t in ids)
               if self.prefix <= i < self.vocab and i not in self._seen]
        if not new:
            return
        self._seen.update(new)
        self._extra.extend(new)
        self._extra_ids = torch.tensor(self._extra, dtype=torch.long)
        if self._native is not None:
            self._extra_out = self._gather(self._extra)

    def _gather(self, ids: list[int]):
        """A FusedOutput over a copy of the head rows ``ids``, in that order."""
        from .. import kernels

        part = self._model.lm_head.parts[0]
        rows = np.ascontiguousarray(part.raw[np.asarray(ids)])  # whole rows (a repacked row stays one row)
        c = kernels.CLinear()
        ctypes.pointer(c)[0] = self._native.head
        c.w[0] = rows.ctypes.data
        c.n[0] = len(ids)
        c.n_total = len(ids)
        return kernels.FusedOutput(c, self._native.norm, self._native.eps, [self._native, rows])

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        model = self._model
        cap = model.cfg.final_softcap
        out = torch.full((x.shape[0], self.vocab), float("-inf"), dtype=torch.float32, device=x.device)
        if self._native is None:  # the whole head, masked
            full = model.runner.head(model, x)
            if cap:
                full = torch.tanh(full / cap) * cap
            out[:, : self.prefix] = full[:, : self.prefix]
            if self._extra_ids is not None:
                ids = self._extra_ids.to(full.device)
                out[:, ids] = full[:, ids]
            return out
        parts = [(self._prefix_out, slice(0, self.prefix))]
        if self._extra_out is not None:
            parts.append((self._extra_out, self._extra_ids))
        for head, where in parts:
            y = head(x)
            if cap:
                y = torch.tanh(y / cap) * cap
            out[:, where] = y
        return out
