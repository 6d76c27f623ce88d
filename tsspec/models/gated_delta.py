"""The gated delta rule and the short causal convolution of a GatedDeltaNet layer, as pure functions.

Per value head h, with key/query vectors of ``dk`` and value vectors of ``dv`` dims, the recurrent
state is a matrix ``S [dk, dv]``; token t updates and reads it as

    S'  = exp(g_t) * S                       # gated decay (g_t <= 0)
    u_t = beta_t * (v_t - S'^T k_t)          # the delta: what S' mispredicts for key k_t
    S_t = S' + k_t u_t^T
    o_t = S_t^T q_t

Two forms compute it:

* ``delta_rule_step`` - one token, the reference. ``delta_rule_rows`` runs it row by row and can
  keep the state after every row (what a verify needs for a free rollback). The arithmetic of a row
  is the same whether it is computed alone or as row m of a longer call, so a row's result is
  bit-for-bit independent of how many rows share the forward.
* ``delta_rule_chunked`` - the parallel (WY) form over chunks, for long prefills: unrolling the
  recurrence inside a chunk gives U = T (beta V) - T (beta e^G K) S_0 with T = (I + A)^-1 and
  A[t, s] = beta_t e^(G_t - G_s) k_t.k_s (s < t), solved as one unit-triangular system. It agrees
  with the one-step form to float32 rounding (about 1e-6 relative), not bit for bit; the models
  therefore use it only where no batch-invariance contract applies (prompts longer than a verify).

The conv keeps the last ``K-1`` pre-conv inputs as its state; ``causal_conv`` is an explicit sum
over the K taps, so it too is row-wise batch invariant, and the state after row m of a call is the
window ``cat(state, x)[m+1 : m+K]`` of a tensor the call builds anyway.

State types say what they can undo: ``RecurrentState`` is one layer's live state plus where it
came from; snapshot semantics (copy vs. per-row slots) live in the model that owns the states.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

L2_EPS = 1e-6  # as the reference implementations' l2norm


@dataclass
class RecurrentState:
    """One GatedDeltaNet layer's state after some number of tokens.

    ``conv`` [K-1, C] holds the last K-1 pre-conv inputs; ``ssm`` [H, dk, dv] the delta-rule
    matrices. Either may be a view into a larger per-row buffer (a committed verify slot); the
    owner never writes into a buffer a live state points at except through that state.
    """

    conv: torch.Tensor
    ssm: torch.Tensor

    def clone(self) -> "RecurrentState":
        return RecurrentState(self.conv.clone(), self.ssm.clone())

    def nbytes(self) -> int:
        return (self.conv.numel() + self.ssm.numel()) * 4


def l2norm(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


# ----------------------------------------------------------------------------- conv


def causal_conv(window: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
    """Depthwise causal conv + SiLU: window [K-1+n, C] (state then new inputs), w [C, K] -> [n, C]."""
    k = w.shape[1]
    acc = window[0:n] * w[:, 0]
    for j in range(1, k):
        acc = acc + window[j : j + n] * w[:, j]
    return F.silu(acc)


# ----------------------------------------------------------------------------- delta rule


def delta_rule_step(
    ssm: torch.Tensor,  # [H, dk, dv] state before the token
    q: torch.Tensor,  # [H, dk] l2-normed and scaled by 1/sqrt(dk)
    k: torch.Tensor,  # [H, dk] l2-normed
    v: torch.Tensor,  # [H, dv]
    g: torch.Tensor,  # [H] log decay (<= 0)
    beta: torch.Tensor,  # [H] in (0, 1)
    out: torch.Tensor,  # [H, dk, dv] receives the new state; may be ``ssm`` itself (in place)
) -> torch.Tensor:
    """One token of the gated delta rule; writes the new state into ``out`` and returns o [H, dv]."""
    torch.mul(ssm, g.exp()[:, None, None], out=out)
    kv_mem = torch.bmm(k.unsqueeze(1), out).squeeze(1)  # [H, dv]
    u = (v - kv_mem) * beta[:, None]
    out.addcmul_(k.unsqueeze(2), u.unsqueeze(1))
    return torch.bmm(q.unsqueeze(1), out).squeeze(1)


def delta_rule_rows(
    ssm: torch.Tensor,  # [H, dk, dv] initial state
    q: torch.Tensor,  # [n, H, dk]
    k: torch.Tensor,  # [n, H, dk]
    v: torch.Tensor,  # [n, H, dv]
    g: torch.Tensor,  # [n, H]
    beta: torch.Tensor,  # [n, H]
    rows_out: torch.Tensor | None = None,  # [>= n, H, dk, dv]: keep the state after every row
) -> torch.Tensor:
    """Row-by-row recurrence -> o [n, H, dv].

    With ``rows_out`` the state after row m lands in ``rows_out[m]`` and ``ssm`` is untouched;
    without it ``ssm`` is updated in place (the single-row decode and the no-snapshot path).
    """
    n = q.shape[0]
    o = torch.empty(n, v.shape[1], v.shape[2])
    prev = ssm
    for t in range(n):
        dst = ssm if rows_out is None else rows_out[t]
        o[t] = delta_rule_step(prev, q[t], k[t], v[t], g[t], beta[t], dst)
        prev = dst
    return o


def delta_rule_chunked(
    ssm: torch.Tensor,  # [H, dk, dv] initial state; updated in place to the final state
    q: torch.Tensor,  # [n, H, dk]
    k: torch.Tensor,  # [n, H, dk]
    v: torch.Tensor,  # [n, H, dv]
    g: torch.Tensor,  # [n, H]
    beta: torch.Tensor,  # [n, H]
    chunk: int = 64,
) -> torch.Tensor:
    """Parallel form over chunks of ``chunk`` tokens -> o [n, H, dv]; ``ssm`` ends as the final state."""
    n = q.shape[0]
    # heads first: [H, n, d]
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    gh, bh = g.transpose(0, 1), beta.transpose(0, 1)
    outs = []
    state = ssm
    for c0 in range(0, n, chunk):
        c1 = min(n, c0 + chunk)
        qc, kc, vc = qh[:, c0:c1], kh[:, c0:c1], vh[:, c0:c1]
        bc = bh[:, c0:c1]
        G = torch.cumsum(gh[:, c0:c1], dim=1)  # [H, c] cumulative log decay inside the chunk
        m = c1 - c0
        diff = G[:, :, None] - G[:, None, :]  # [H, t, s] = G_t - G_s
        lower = torch.tril(torch.ones(m, m, dtype=torch.bool))
        decay = torch.where(lower, diff, torch.full_like(diff, float("-inf"))).exp()  # 0 above diag
        strict = decay * (~torch.eye(m, dtype=torch.bool))
        A = bc[:, :, None] * (kc @ kc.transpose(1, 2)) * strict  # [H, t, s], s < t
        eye = torch.eye(m).expand_as(A)
        eG = G.exp()  # [H, c]
        rhs = torch.cat([bc[:, :, None] * vc, (bc * eG)[:, :, None] * kc], dim=2)
        sol = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        dv = vc.shape[2]
        U = sol[:, :, :dv] - sol[:, :, dv:] @ state  # [H, c, dv]
        # o_t = e^{G_t} S0^T q_t + sum_{s<=t} e^{G_t-G_s} (q_t.k_s) u_s
        o = (eG[:, :, None] * qc) @ state + ((qc @ kc.transpose(1, 2)) * decay) @ U
        outs.append(o)
        tail = (G[:, -1:] - G).exp()  # [H, c] = e^{G_C - G_s}
        state = eG[:, -1, None, None] * state + (kc * tail[:, :, None]).transpose(1, 2) @ U
    ssm.copy_(state)
    return torch.cat(outs, dim=1).transpose(0, 1).contiguous()
