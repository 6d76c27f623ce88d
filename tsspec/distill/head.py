"""Training a per-token draft head (``tsspec-eagle``) on a frozen trunk's features.

The head's math is ``tsspec.drafters.eagle.head_step``, the function the adapter runs at decode
time; here it runs on parameters with autograd. The trunk's embedding and output-head rows (the
draft vocabulary) are frozen inputs, never trained.

Training unrolls the head ``unroll`` steps as it is used (step 1 reads the trunk's row, step j > 1
its own output of step j - 1) and scores each step against the trunk's soft next-token
distribution at that position (cross-entropy over the draft vocabulary), plus a small pull of the
head's output row toward the trunk's own row there, which keeps chained rows in the trunk's space.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np
import torch
import torch.nn.functional as F

from ..drafters.eagle import ARCH, MATRICES, NORMS, head_step
from .features import Features


def choose_draft_vocab(feats: Features, size: int, vocab: int) -> np.ndarray:
    """The ``size`` trunk tokens the trunk predicts most often on the training set (its greedy
    choice counts most, then its runners-up and the corpus tokens), ascending."""
    size = min(size, vocab)
    counts = torch.zeros(vocab, dtype=torch.float64)
    counts.index_add_(0, feats.top_ids[..., 0].reshape(-1), torch.full((feats.top_ids[..., 0].numel(),), 4.0, dtype=torch.float64))
    counts.index_add_(0, feats.top_ids.reshape(-1), feats.top_p.reshape(-1).double())
    counts.index_add_(0, feats.tokens.reshape(-1), torch.ones(feats.tokens.numel(), dtype=torch.float64))
    order = torch.argsort(-counts, stable=True)  # ties: lower id first, deterministic
    return np.sort(order[:size].numpy()).astype(np.int64)


def coverage(feats: Features, d2t: np.ndarray) -> float:
    """Share of the trunk's greedy next tokens that lie in the draft vocabulary."""
    inside = torch.zeros(int(max(feats.top_ids.max().item(), d2t.max())) + 1, dtype=torch.bool)
    inside[torch.as_tensor(d2t)] = True
    return float(inside[feats.top_ids[..., 0]].float().mean())


class HeadModule(torch.nn.Module):
    def __init__(self, d: int, ffn: int, eps: float, out_norm: torch.Tensor, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        std = 0.02
        fc = torch.randn(d, 2 * d, generator=g) * std
        fc[:, d:] += torch.eye(d)  # start as "the row passes through": the trunk's row is the best first guess
        self.fc = torch.nn.Parameter(fc)
        self.ffn_gate = torch.nn.Parameter(torch.randn(ffn, d, generator=g) * std)
        self.ffn_up = torch.nn.Parameter(torch.randn(ffn, d, generator=g) * std)
        self.ffn_down = torch.nn.Parameter(torch.zeros(d, ffn))  # the block starts as the identity
        for n in ("enorm", "hnorm", "ffn_norm"):
            setattr(self, n, torch.nn.Parameter(torch.ones(d)))
        self.out_norm = torch.nn.Parameter(out_norm.detach().float().clone())
        self.eps = eps

    def weights(self) -> dict[str, object]:
        w: dict[str, object] = {n: (lambda x, p=getattr(self, n): x @ p.T) for n in MATRICES}
        w.update({n: getattr(self, n) for n in NORMS})
        return w

    def step(self, e: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return head_step(self.weights(), e, h, self.eps)


@dataclass
class Batch:
    h0: torch.Tensor  # [B, d] the trunk's row before the first drafted position
    tokens: torch.Tensor  # [B, K] the token entering each step
    top_ids: torch.Tensor  # [B, K, k] trunk targets (trunk ids)
    top_p: torch.Tensor  # [B, K, k]
    target_h: torch.Tensor  # [B, K, d] the trunk's own rows at each step's position


def anchors(feats: Features, unroll: int) -> torch.Tensor:
    """Every (chunk, position) a K-step unroll can start from: [n, 2]."""
    C, L = feats.tokens.shape
    pos = torch.arange(1, L - unroll + 1)
    return torch.stack(torch.meshgrid(torch.arange(C), pos, indexing="ij"), dim=-1).reshape(-1, 2)


def make_batch(feats: Features, idx: torch.Tensor, unroll: int) -> Batch:
    c, i = idx[:, 0:1], idx[:, 1:2]
    steps = i + torch.arange(unroll)[None, :]  # [B, K] positions i .. i+K-1
    cc = c.expand_as(steps)
    return Batch(
        h0=feats.hidden[c[:, 0], i[:, 0] - 1].float(),
        tokens=feats.tokens[cc, steps],
        top_ids=feats.top_ids[cc, steps],
        top_p=feats.top_p[cc, steps],
        target_h=feats.hidden[cc, steps].float(),
    )


def run_unroll(head: HeadModule, embed: torch.Tensor, lm_rows: torch.Tensor, batch: Batch) -> tuple[list, list]:
    """-> per step: (logits over the draft vocabulary [B, V], output rows [B, d])."""
    h = batch.h0
    logits, rows = [], []
    for j in range(batch.tokens.shape[1]):
        h = head.step(embed[batch.tokens[:, j]], h)
        rows.append(h)
        logits.append(h @ lm_rows.T)
    return logits, rows


def loss_fn(head: HeadModule, embed: torch.Tensor, lm_rows: torch.Tensor, t2d: torch.Tensor, batch: Batch,
            feature_weight: float = 0.2, step_decay: float = 0.8) -> tuple[torch.Tensor, dict]:
    logits, rows = run_unroll(head, embed, lm_rows, batch)
    total = torch.zeros(())
    parts = {}
    for j, (lg, h) in enumerate(zip(logits, rows)):
        logq = torch.log_softmax(lg, dim=-1)
        d_ids = t2d[batch.top_ids[:, j]]  # [B, k], -1 outside the draft vocabulary
        p = batch.top_p[:, j] * (d_ids >= 0)
        ce = -(p * logq.gather(1, d_ids.clamp(min=0))).sum(-1).mean()
        feat = F.smooth_l1_loss(h, batch.target_h[:, j])
        total = total + (step_decay ** j) * (ce + feature_weight * feat)
        parts[f"ce{j + 1}"] = float(ce.detach())
    return total, parts


@torch.no_grad()
def evaluate(head: HeadModule, embed: torch.Tensor, lm_rows: torch.Tensor, d2t: torch.Tensor, feats: Features,
             steps: int = 4, max_anchors: int = 4096, seed: int = 0) -> dict:
    """Held-out acceptance as greedy decoding would see it.

    The head is chained ``steps`` times from each sampled position, fed the text's tokens. Its
    j-th draft is judged only where the trunk's greedy path follows the text for the j - 1 tokens
    before it (there the chained head sees exactly what it would see while drafting):
    ``accept[j - 1]`` is the share of those positions whose first j drafts all equal the trunk's
    greedy tokens, ``first`` the first draft's, over every position. ``tokens_per_verify`` is the
    expected tokens one verify emits with drafts of ``steps`` (the bonus token included)."""
    idx = anchors(feats, steps)
    if len(idx) > max_anchors:
        idx = idx[torch.randperm(len(idx), generator=torch.Generator().manual_seed(seed))[:max_anchors]]
    idx = idx.to(feats.tokens.device)
    batch = make_batch(feats, idx, steps)
    logits, _ = run_unroll(head, embed, lm_rows, batch)
    hit = torch.stack([d2t[lg.argmax(-1)] == batch.top_ids[:, j, 0] for j, lg in enumerate(logits)], dim=1)
    # the trunk's greedy token at each step's position equals the text's next token
    follows = batch.top_ids[:, :-1, 0] == batch.tokens[:, 1:]
    return path_acceptance(hit, follows)


def path_acceptance(hit: torch.Tensor, follows: torch.Tensor) -> dict:
    """Acceptance as greedy decoding sees it, from ``hit`` [n, K] (draft j equals the trunk's greedy
    token) and ``follows`` [n, >= K - 1] (the text's token there is the greedy one): draft j counts
    only at anchors whose first j - 1 positions follow the greedy path; ``accept[j - 1]`` is the
    share of those whose first j drafts all hit."""
    accept, counts = [], []
    for j in range(hit.shape[1]):
        on_path = follows[:, :j].all(dim=1)
        n = int(on_path.sum())
        counts.append(n)
        accept.append(float(hit[on_path, : j + 1].all(dim=1).float().mean()) if n else 0.0)
    return {"anchors": int(hit.shape[0]), "on_path": counts, "accept": accept, "first": accept[0],
            "tokens_per_verify": 1.0 + sum(accept)}


def add_provenance(w, arch: str, trunk: Mapping[str, object], training: Mapping[str, object]) -> None:
    """``ARCH.trunk.*`` (what the drafter binds to; checked on load) and ``ARCH.training.*`` keys."""
    for key, value in trunk.items():
        if key == "name":
            continue
        if isinstance(value, str):
            w.add_string(f"{arch}.trunk.{key}", value)
        else:
            w.add_uint32(f"{arch}.trunk.{key}", int(value))
    for key, value in training.items():
        if isinstance(value, str):
            w.add_string(f"{arch}.training.{key}", value)
        elif isinstance(value, float):
            w.add_float32(f"{arch}.training.{key}", value)
        else:
            w.add_uint64(f"{arch}.training.{key}", int(value))


def add_matrix(w, name: str, p: torch.Tensor, weights: str) -> None:
    """A trained matrix in Q8_0 (``weights="q8_0"``, when its rows split into 32-blocks) or F32."""
    import gguf

    a = p.detach().float().cpu().contiguous().numpy()
    if weights == "f32" or a.shape[1] % 32:
        w.add_tensor(name, a)
    else:
        qtype = gguf.GGMLQuantizationType.Q8_0
        w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)


def write_and_rename(w, tmp: Path, path: Path) -> None:
    """Write the GGUF to ``tmp`` and move it over ``path``: a file there is always a whole one."""
    from ..paths import check_output_file

    check_output_file(path, str(path))  # still a file (or nothing): a device is never replaced
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(path)


def export_gguf(path: Path, head: HeadModule, d2t: np.ndarray, trunk: Mapping[str, object], training: Mapping[str, object],
                weights: str = "q8_0") -> None:
    """Write the head as a ``tsspec-eagle`` GGUF (matrices in Q8_0 or F32; norms and ``d2t`` exact)."""
    import gguf

    path = Path(path)
    tmp = path.with_name(path.name + ".part")
    w = gguf.GGUFWriter(str(tmp), ARCH)
    w.add_name(f"tsspec draft head for {trunk.get('name', trunk['architecture'])}")
    w.add_uint32(f"{ARCH}.embedding_length", int(head.fc.shape[0]))
    w.add_uint32(f"{ARCH}.feed_forward_length", int(head.ffn_gate.shape[0]))
    w.add_uint32(f"{ARCH}.draft_vocab_size", int(len(d2t)))
    w.add_float32(f"{ARCH}.attention.layer_norm_rms_epsilon", float(head.eps))
    add_provenance(w, ARCH, trunk, training)
    for n in MATRICES:
        add_matrix(w, f"{n}.weight", getattr(head, n), weights)
    for n in NORMS:
        w.add_tensor(f"{n}.weight", getattr(head, n).detach().float().contiguous().numpy())
    w.add_tensor("d2t", np.asarray(d2t, dtype=np.int32))
    write_and_rename(w, tmp, path)
