"""A trained per-token draft head (``general.architecture = tsspec-eagle``), as ``tsspec distill
--kind head`` writes it: EAGLE-shaped, without the attention layer.

One head step, for the token t at position p and a row h in the trunk's final-normed hidden space
(the trunk's own row of position p - 1, or the head's previous output when chaining):

    x  = fc([enorm(embed(t)), hnorm(h)])             # embed: the trunk's, borrowed
    x += down(silu(gate(ffn_norm(x))) * up(ffn_norm(x)))
    h' = out_norm(x)                                  # chains into the next step
    logits = lm_head[d2t] @ h'                        # the trunk's head, rows of the draft vocabulary

Nothing is trained twice: the embedding and the output head are the trunk's (read from the trunk's
own file), and the head scores only a *draft vocabulary* ``d2t`` (the trunk token ids the trunk
predicts most often), which makes a head step a few percent of a trunk step. Drafts outside the
draft vocabulary are never proposed; that costs acceptance only, never exactness.

With no attention the head keeps no per-sequence cache: a step depends on (t, h) alone, so the
folded catch-up is one step on the last committed row. ``head_step`` is the definition of the
math: ``tsspec.distill`` trains through it with autograd, and this adapter runs it on loaded weights,
as one native call (``tsq_eagle_step`` in ``tsspec/kernels/eagle.c``) where every matrix is on the
native kernels; a test holds the native step to ``head_step``.

The file binds to one trunk: its architecture, hidden size, layer count, vocabulary size and the
sha256 of its token list are stored as ``tsspec-eagle.trunk.*`` and checked on load.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import BadInput, ModelFileError
from ..gguf_file import GGUFFile
from ..weights import GGUFWeight, Linear, to_tensor
from ..models.base import load_weight, rms_norm
from ..sampling import argmax
from . import drafter_format
from .protocols import DraftHeadKind

ARCH = "tsspec-eagle"
MATRICES = ("fc", "ffn_gate", "ffn_up", "ffn_down")
NORMS = ("enorm", "hnorm", "ffn_norm", "out_norm")
TRUNK_KEYS = ("architecture", "embedding_length", "block_count", "vocab_size", "vocab_sha256")


# ----------------------------------------------------------------------------- the math (pure)


def head_step(w: Mapping[str, Callable | torch.Tensor], e: torch.Tensor, h: torch.Tensor, eps: float) -> torch.Tensor:
    """Embedding rows e [n, d] and hidden rows h [n, d] -> the head's output rows h' [n, d].

    ``w`` maps each name of ``MATRICES`` to a callable x -> x @ W.T and each of ``NORMS`` to a
    weight vector. Training passes parameter products, the adapter ``Linear``s."""
    x = w["fc"](torch.cat([rms_norm(e, w["enorm"], eps), rms_norm(h, w["hnorm"], eps)], dim=-1))
    y = rms_norm(x, w["ffn_norm"], eps)
    x = x + w["ffn_down"](F.silu(w["ffn_gate"](y)) * w["ffn_up"](y))
    return rms_norm(x, w["out_norm"], eps)


# ----------------------------------------------------------------------------- trunk binding


def vocab_sha256(tokens: Sequence[str]) -> str:
    """A fingerprint of a token list: two trunks share a drafter only if their lists are equal."""
    h = hashlib.sha256()
    for t in tokens:
        h.update(str(t).encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return h.hexdigest()


def trunk_identity(g: GGUFFile, target) -> dict[str, object]:
    """What a head trained on ``target`` (opened as ``g``) records and checks on load."""
    tokens = g.get("tokenizer.ggml.tokens") or []
    return {
        "architecture": g.arch,
        "embedding_length": int(target.hidden_size),
        "block_count": int(target.n_layers),
        "vocab_size": int(target.vocab_size),
        "vocab_sha256": vocab_sha256(tokens),
    }


def head_tensor_name(g: GGUFFile) -> str:
    """The trunk's output head tensor (the embedding when they are tied)."""
    return "output.weight" if g.has_tensor("output.weight") else "token_embd.weight"


def stored_head_rows(trunk: GGUFFile, d2t: np.ndarray) -> GGUFWeight:
    """The trunk's output-head rows ``d2t`` in their stored blocks (only those rows are copied)."""
    name = head_tensor_name(trunk)
    info = trunk.tensor_info(name)
    kind, flat = trunk.tensor_raw(name)
    rows = flat.reshape(info.shape[0], -1)[np.asarray(d2t, dtype=np.int64)]
    return GGUFWeight(kind, np.ascontiguousarray(rows), (len(d2t), info.shape[1]))


def draft_head_rows(trunk: GGUFFile, d2t: np.ndarray, fmt: str) -> Linear:
    """The trunk's output head restricted to the draft vocabulary, in the trunk's own format:
    quantized rows are copied block for block (the same values the trunk multiplies)."""
    rows = stored_head_rows(trunk, d2t)
    return Linear(rows if fmt == "auto" else rows.dense(), None, fmt)


def dense_head_rows(trunk: GGUFFile, d2t: np.ndarray) -> torch.Tensor:
    """The same rows as exact float32 values [V, d] (for training)."""
    return torch.from_numpy(np.ascontiguousarray(stored_head_rows(trunk, d2t).dense(), dtype=np.float32))


# ----------------------------------------------------------------------------- the adapter


class _NoState:
    """The head keeps no per-sequence cache; the speculator still resets one."""

    def reset(self) -> None:
        pass


class EagleHead:
    """DraftHead (PER_TOKEN) over a trained ``tsspec-eagle`` file bound to one trunk."""

    kind = DraftHeadKind.PER_TOKEN
    block_size = 1
    # a step reads its token and its parent's hidden row only (no cache, no position): a tree's
    # nodes step together, several rows in one ``step_rows``
    independent_rows = True
    # trained on the trunk's soft targets, its own softmax is calibrated (measured on held-out text:
    # drafts given 0.7-0.8 land ~71%, 0.9+ ~94%), so the gate reads it, cumulatively
    cumulative_gate = True
    default_min_draft_prob = 0.5

    def __init__(self, target, weights: Mapping[str, object], d2t: np.ndarray, lm_head: Linear):
        self.target = target
        self.cfg = target.cfg
        self.w = dict(weights)
        self.d2t = torch.as_tensor(np.asarray(d2t, np.int64))
        self.lm_head = lm_head
        self.eps = float(target.cfg.rms_eps)
        # the same step as one native call where every matrix is on the gguf backend; None: the
        # torch reference (head_step), which the tests compare it with
        from .. import kernels

        self.native = kernels.FusedEagle.build(*(self.w[n] for n in MATRICES), lm_head,
                                               norms={n: self.w[n] for n in NORMS}, eps=self.eps)

    def pick(self, logits: torch.Tensor) -> tuple[int, float]:
        """Draft-vocabulary logits [V] -> (the trunk id of the head's top draft, its probability)."""
        p = torch.softmax(logits.float(), dim=-1)
        i = argmax(p)
        return int(self.d2t[i]), float(p[i])

    def trunk_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [V] -> logits over the trunk's vocabulary (-inf outside the draft
        vocabulary): what a sampled draft is drawn from, and its q for the residual rule."""
        full = torch.full((self.target.vocab_size,), float("-inf"), dtype=torch.float32)
        full[self.d2t] = logits.float()
        return full

    def new_state(self) -> _NoState:
        return _NoState()

    def from_trunk(self, rows: torch.Tensor) -> torch.Tensor:
        """Trunk tap rows (residual after the last layer) -> the head's input space (final-normed)."""
        return rms_norm(rows.float(), self.target.out_norm, self.eps)

    @torch.inference_mode()
    def step_rows(self, tokens: Sequence[int], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits over the draft vocabulary [n, V] (column i is trunk token ``d2t[i]``; ``pick``
        maps them), h' [n, d])."""
        e = self.target.embed[list(tokens)].float()
        hidden = hidden.float().reshape(len(tokens), -1)
        if self.native is not None:
            return self.native(e, hidden)
        h = head_step(self.w, e, hidden, self.eps)
        return self.lm_head(h), h

    def draft_step(self, token: int, hidden: torch.Tensor, position: int, state) -> tuple[torch.Tensor, torch.Tensor]:
        logits, h = self.step_rows([token], hidden.reshape(1, -1))
        return logits[0], h[0]

    def catch_up(self, tokens: Sequence[int], hidden: torch.Tensor, start_pos: int, state) -> None:
        pass  # no cache: nothing to rewrite

    def catch_up_and_step(self, tokens: Sequence[int], hidden: torch.Tensor, start_pos: int, state
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """Only the last row counts (no attention): one step on the last committed token."""
        return self.draft_step(int(tokens[-1]), hidden[-1], start_pos + len(tokens) - 1, state)

    def draft_block(self, last_token, hidden, position, state):
        raise NotImplementedError("a per-token head drafts one token per pass")


class EagleDrafter:
    """What ``load_drafter`` returns for a tsspec-eagle file (the registry's ``draft-head`` entry)."""

    speculator_name = "draft-head"
    preferred_window = None

    def __init__(self, head: EagleHead, path=None, notes: list[str] | None = None):
        self.draft_head = head
        self.path = path
        self.notes = notes or []
        self.warnings: list[str] = []


def check_trunk(name: str, meta: Mapping[str, object], have: Mapping[str, object], *, arch: str = ARCH,
                noun: str = "head") -> None:
    """Refuse a drafter trained on another trunk, naming the first key that disagrees (``meta``: the
    file's ``ARCH.trunk.*`` values by short key, ``have``: ``trunk_identity`` of the trunk)."""
    for key, value in have.items():
        got = meta.get(key)
        if got is None:
            raise ModelFileError(f"{name}: missing {arch}.trunk.{key}; not a file `tsspec distill` wrote")
        if (str(got) if key in ("architecture", "vocab_sha256") else int(got)) != value:
            what = "token list" if key == "vocab_sha256" else key.replace("_", " ")
            raise BadInput(
                f"{name}: this {noun} was trained for a trunk with {what} {got!s:.16}, but this model has "
                f"{value!s:.16}; train one for this model with `tsspec distill`"
            )


def load(g: GGUFFile, target, options=None) -> EagleDrafter:
    """Bind a tsspec-eagle file to ``target`` (refused on any other trunk)."""
    trunk_path = getattr(target, "path", None)
    if trunk_path is None or not hasattr(target, "out_norm"):
        raise ModelFileError(f"{g.path.name}: a trained head binds to a transformer trunk loaded from a file")
    trunk = GGUFFile(trunk_path)
    check_trunk(g.path.name, {k: g.get(f"{ARCH}.trunk.{k}") for k in TRUNK_KEYS}, trunk_identity(trunk, target))
    d = int(target.hidden_size)
    if not g.has_tensor("d2t"):
        raise ModelFileError(f"{g.path.name}: missing tensor 'd2t' (the draft vocabulary)")
    kind, raw = g.tensor_raw("d2t")
    if kind != "I32":
        raise ModelFileError(f"{g.path.name}: d2t has type {kind}; expected I32 token ids")
    d2t = raw.view(np.int32).astype(np.int64)
    if d2t.size == 0 or d2t.min() < 0 or d2t.max() >= target.vocab_size or len(np.unique(d2t)) != d2t.size:
        raise ModelFileError(f"{g.path.name}: d2t is not a set of distinct token ids below {target.vocab_size}")
    ffn = g.tensor_info("ffn_gate.weight").shape[0] if g.has_tensor("ffn_gate.weight") else None
    want = {"fc.weight": (d, 2 * d), "ffn_gate.weight": (ffn, d), "ffn_up.weight": (ffn, d),
            "ffn_down.weight": (d, ffn), **{f"{n}.weight": (d,) for n in NORMS}}
    for tname, shape in want.items():
        if not g.has_tensor(tname):
            raise ModelFileError(f"{g.path.name}: missing tensor {tname!r}")
        got = tuple(g.tensor_info(tname).shape)
        if got != shape:
            raise BadInput(f"{g.path.name}: {tname} is {got}, but this trunk (hidden {d}) needs {shape}")
    fmt = drafter_format(options, target)
    w: dict[str, object] = {n: Linear(load_weight(g, [f"{n}.weight"], fmt)[0], None, fmt) for n in MATRICES}
    w.update({n: to_tensor(g.tensor(f"{n}.weight"), torch.float32) for n in NORMS})
    head = EagleHead(target, w, d2t, draft_head_rows(trunk, d2t, fmt))
    note = (f"{Path(str(g.path)).name}: trained draft head (fc + MLP, ffn {ffn}), draft vocabulary "
            f"{d2t.size} of {target.vocab_size}")
    acc = g.get(f"{ARCH}.training.heldout_accept")
    if acc is not None:
        note += f", held-out first-token acceptance {float(acc):.0%}"
    return EagleDrafter(head, path=g.path, notes=[note])
