"""The gated delta rule (GatedDeltaNet's recurrence) row by row, with per-row states, in Triton.

Per value head h the state is ``S [dk, dv]``; token t computes (``tsspec.models.gated_delta``)

    S' = exp(g_t) S;  u = beta_t (v_t - S'^T k_t);  S_t = S' + k_t u^T;  o_t = S_t^T q_t

One program per (head, block of ``BV`` value columns) keeps its slice of S in registers and runs the
rows in order; with ``rows_out`` it also writes the state after every row (the per-row slots a verify
rolls back to without copying or re-running anything). A row's arithmetic is the same instructions
whether it is the only row of a call or row m of a 16-row verify (the state between rows is exact
float32 either way), so its output and state are bitwise independent of the row count.

Not wired into a model yet: the hybrid trunks still run on the CPU only (their architecture files say ``TRITON = False``).
``reference`` is ``gated_delta.delta_rule_rows``' arithmetic in float64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BV = 32  # value columns per program (fixed)


@triton.jit
def _delta_rows_kernel(s_ptr, q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, o_ptr, rows_ptr, n, H, DK, DV,
                       KEEP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    h = tl.program_id(0)
    vb = tl.program_id(1)
    kk = tl.arange(0, BK)
    vv = vb * BV + tl.arange(0, BV)
    k_ok = kk < DK
    v_ok = vv < DV
    sm = k_ok[:, None] & v_ok[None, :]
    s_off = h * DK * DV + kk[:, None] * DV + vv[None, :]
    S = tl.load(s_ptr + s_off, mask=sm, other=0.0)
    for t in range(0, n):
        row = t * H + h
        k = tl.load(k_ptr + row * DK + kk, mask=k_ok, other=0.0)
        q = tl.load(q_ptr + row * DK + kk, mask=k_ok, other=0.0)
        v = tl.load(v_ptr + row * DV + vv, mask=v_ok, other=0.0)
        g = tl.load(g_ptr + row)
        beta = tl.load(b_ptr + row)
        S = S * tl.exp(g)
        kv = tl.sum(k[:, None] * S, axis=0)
        u = (v - kv) * beta
        S = S + k[:, None] * u[None, :]
        o = tl.sum(q[:, None] * S, axis=0)
        tl.store(o_ptr + row * DV + vv, o, mask=v_ok)
        if KEEP:
            tl.store(rows_ptr + t * H * DK * DV + s_off, S, mask=sm)
    if not KEEP:
        tl.store(s_ptr + s_off, S, mask=sm)


def delta_rule_rows(ssm: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor, rows_out: torch.Tensor | None = None) -> torch.Tensor:
    """As ``tsspec.models.gated_delta.delta_rule_rows``: ssm [H, dk, dv], q/k [n, H, dk], v [n, H, dv],
    g/beta [n, H] (float32, one device) -> o [n, H, dv]. With ``rows_out`` [>= n, H, dk, dv] the state
    after row m lands in ``rows_out[m]`` and ``ssm`` is untouched; without it ``ssm`` is updated."""
    n, H, dk = q.shape
    dv = v.shape[2]
    if ssm.shape != (H, dk, dv) or k.shape != q.shape or v.shape[:2] != (n, H) or g.shape != (n, H) \
            or beta.shape != (n, H) or (rows_out is not None and (rows_out.shape[0] < n or rows_out.shape[1:] != ssm.shape)):
        raise ValueError(f"delta rule shapes: state {tuple(ssm.shape)}, q {tuple(q.shape)}, v {tuple(v.shape)}")
    if not ssm.is_contiguous() or (rows_out is not None and not rows_out.is_contiguous()):
        raise ValueError("the states must be contiguous")
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    o = torch.empty(n, H, dv, dtype=torch.float32, device=q.device)
    if n == 0:
        return o
    _delta_rows_kernel[(H, triton.cdiv(dv, BV))](
        ssm, q, k, v, g, beta, o, rows_out if rows_out is not None else ssm, n, H, dk, dv,
        KEEP=rows_out is not None, BK=max(16, triton.next_power_of_2(dk)), BV=BV)
    return o


def reference(ssm, q, k, v, g, beta) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [n, H, dv], the states after each row [n, H, dk, dv]) in float64 on the CPU."""
    S = ssm.detach().cpu().double().clone()
    q, k, v, g, beta = (t.detach().cpu().double() for t in (q, k, v, g, beta))
    outs, states = [], []
    for t in range(q.shape[0]):
        S = S * g[t].exp()[:, None, None]
        u = (v[t] - torch.einsum("hk,hkv->hv", k[t], S)) * beta[t][:, None]
        S = S + k[t][:, :, None] * u[:, None, :]
        outs.append(torch.einsum("hk,hkv->hv", q[t], S))
        states.append(S.clone())
    return torch.stack(outs), torch.stack(states)
