"""The trunk's behaviour over a corpus, teacher-forced: what a drafter learns to predict.

For every position of every chunk: the token, the trunk's final-normed hidden row (the space a
per-token head reads and writes) or the rows entering a few layers (what a block drafter reads) and the trunk's top-k next-token probabilities (the soft target,
so that agreement with the trunk, not corpus accuracy, is what training optimises).
"""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..models.base import rms_norm


@dataclass
class Features:
    tokens: torch.Tensor  # [C, L] int64
    hidden: torch.Tensor  # [C, L, d] bfloat16: the trunk's final-normed row at each position
    top_ids: torch.Tensor  # [C, L, k] int64: the trunk's k likeliest next tokens at each position
    top_p: torch.Tensor  # [C, L, k] float32 holding float16 values (what the cache stores): their probabilities

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.numel())

    def argmax(self) -> torch.Tensor:
        """The trunk's greedy next token at each position [C, L]."""
        return self.top_ids[..., 0]

    @classmethod
    def concat(cls, parts: Sequence["Features"]) -> "Features":
        if len(parts) == 1:
            return parts[0]
        return cls(*(torch.cat([getattr(p, f) for p in parts]) for f in ("tokens", "hidden", "top_ids", "top_p")))

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".part")
        torch.save({"tokens": self.tokens, "hidden": self.hidden, "top_ids": self.top_ids.int(),
                    "top_p": self.top_p.half()}, tmp)
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> "Features | None":
        """The features saved at ``path``; None when the file is not a whole set of them (a cache
        damaged on disk is computed again, not a traceback). Tensors only: nothing is unpickled."""
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                d = torch.load(path, map_location="cpu", weights_only=True)
            t = [d[k] for k in ("tokens", "hidden", "top_ids", "top_p")]
        except Exception:  # noqa: BLE001 - torch raises many kinds on a damaged file
            return None
        if not all(isinstance(x, torch.Tensor) for x in t) or t[0].dim() != 2 or any(
                x.dim() != 3 or tuple(x.shape[:2]) != tuple(t[0].shape) for x in t[1:]):
            return None
        return cls(t[0], t[1], t[2].long(), t[3].float())


def features_key(model_id: str, chunks: Sequence[Sequence[int]], k: int, taps: Sequence[int] | None = None) -> str:
    what = "" if taps is None else "|taps=" + ",".join(str(int(t)) for t in taps)
    h = hashlib.sha256(f"{model_id}|{k}|{len(chunks)}{what}".encode())
    for c in chunks:
        h.update(torch.as_tensor(c, dtype=torch.int32).numpy().tobytes())
    return h.hexdigest()[:20]


@torch.inference_mode()
def collect(model, chunks: Sequence[Sequence[int]], k: int,
            progress: Callable[[int], None] | None = None, taps: Sequence[int] | None = None) -> Features:
    """Run the trunk over each chunk from an empty cache (one forward per chunk, every row's
    logits and the residual after the last layer) and keep what a drafter trains on.

    ``taps=None``: ``hidden`` is the final-normed row (a draft head's space). Otherwise it is the
    residual rows entering each of ``taps``, concatenated in that order: exactly the rows the
    decode loop hands a block drafter."""
    if not chunks:
        raise ValueError("no chunks to collect features from")
    cache = model.make_cache()
    eps = model.cfg.rms_eps
    C, L = len(chunks), len(chunks[0])
    tokens = torch.tensor([list(c) for c in chunks], dtype=torch.long)
    width = model.hidden_size * (1 if taps is None else len(taps))
    hidden = torch.empty(C, L, width, dtype=torch.bfloat16)
    top_ids = torch.empty(C, L, k, dtype=torch.long)
    top_p = torch.empty(C, L, k, dtype=torch.float32)
    for i, c in enumerate(chunks):
        cache.reset()
        if taps is None:
            out = model.forward(list(c), cache, all_logits=True, taps=(model.n_layers,))
            hidden[i] = rms_norm(out.hidden.float(), model.out_norm, eps).to(torch.bfloat16)
        else:
            out = model.forward(list(c), cache, all_logits=True, taps=tuple(taps))
            hidden[i] = out.hidden.to(torch.bfloat16)
        probs = torch.softmax(out.logits.float(), dim=-1)
        p, ids = torch.topk(probs, k, dim=-1)
        # rounded as the cache stores them: a run trains on the same numbers cached or not
        top_ids[i], top_p[i] = ids, p.half().float()
        if progress:
            progress(len(c))
    return Features(tokens, hidden, top_ids, top_p)
