"""Pure pieces of a DFlash2 drafter: the grouped dynamic convolution, the candidate selector's lattice and
its greedy walk, and rope at arbitrary positions. Each is a function of its inputs only."""

from __future__ import annotations

import torch

from ...sampling import argmax


# ----------------------------------------------------------------------------- pure pieces


def grouped_dynamic_conv(
    x: torch.Tensor,  # [rows, H] one block, row 0 = the anchor
    dyn: torch.Tensor,  # [rows, K, G] dynamic taps of this side, from the sublayer input
    base: torch.Tensor,  # [K, H] static taps of this side
    group_size: int,
) -> torch.Tensor:
    """``y[r][c] = sum_t (base[t][c] + dyn[r][t][c // group_size]) * x[r - t][c]``, x[<0] = 0."""
    rows, hidden = x.shape
    kernel = base.shape[0]
    taps = base[None] + dyn.repeat_interleave(group_size, dim=-1)  # [rows, K, H]
    y = taps[:, 0] * x
    for t in range(1, min(kernel, rows)):
        y[t:] += taps[t:, t] * x[:-t]  # rows r < t would read before the block: zero
    return y


def selector_lattice(
    unary: torch.Tensor,  # [E, k] transformed logits of the candidates
    cand: torch.Tensor,  # [E, k] candidate token ids
    ph: torch.Tensor,  # [E, r] P h_e
    pred_book: torch.Tensor,  # [V, r] A
    succ_book: torch.Tensor,  # [V, r] B
    anchor: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (first [k], trans [E-1, k, k]).

    ``first[c] = score[0][anchor][c]``; ``trans[e-1][p][c] = score[e][cand[e-1][p]][c]``.
    """
    a0 = pred_book[anchor] * ph[0]  # [r]
    first = unary[0] + succ_book[cand[0]] @ a0
    if unary.shape[0] == 1:
        return first, unary.new_zeros(0, unary.shape[1], unary.shape[1])
    a = pred_book[cand[:-1]] * ph[1:, None, :]  # [E-1, k(p), r]
    b = succ_book[cand[1:]]  # [E-1, k(c), r]
    trans = unary[1:, None, :] + torch.einsum("epr,ecr->epc", a, b)
    return first, trans


def greedy_walk(first: torch.Tensor, trans: torch.Tensor) -> list[int]:
    """Candidate indices of the greedy walk: argmax of ``first``, then of ``trans[e][previous]``.

    Among all paths it is the one whose per-step scores are lexicographically largest (step 0
    first); it equals the maximum-total path only when transitions do not trade off (see tests).
    """
    path = [argmax(first)]
    for e in range(trans.shape[0]):
        path.append(argmax(trans[e, path[-1]]))
    return path


def _rope_at(positions: torch.Tensor, base: float, rot_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    ang = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    return ang.cos().float(), ang.sin().float()  # [n, rot_dim/2]
