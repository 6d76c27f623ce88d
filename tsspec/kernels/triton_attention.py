"""Decode/verify attention over a contiguous KV cache, in Triton.

Row i of a forward sits at position ``start + i`` and attends to the cache positions ``t`` with
``t <= start + i`` (and ``t > start + i - window`` for a sliding-window layer): causal within a
verify block, since its rows' K/V are written to the cache before attention runs. One program per
(row, KV head) computes that KV head's query heads (grouped-query attention) with an online
softmax over key blocks of ``BLOCK_N`` positions, aligned to absolute multiples of ``BLOCK_N``.
Everything a row's result depends on is fixed by its own position and the cache's contents: the
blocks it visits, their order and the masking are the same in a 1-row decode and a 16-row verify,
so the result is bitwise the same (batch invariance). Products are float32 (``ieee``: no TF32).

``reference`` beside the kernel is the plain float64 softmax attention of each row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 32  # key positions per step (fixed)
MIN_HEADS = 16  # query heads per program are padded to this (the smallest tile a GPU dot takes)


@triton.jit
def _attend_kernel(q_ptr, k_ptr, v_ptr, o_ptr, start, window,
                   sq_m, sq_h, sk_h, sk_t, so_m, so_h,
                   REP: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BH: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    pos = start + row
    hh = tl.arange(0, BH)
    dd = tl.arange(0, BD)
    h_ok = hh < REP
    d_ok = dd < D
    heads = kvh * REP + hh
    q = tl.load(q_ptr + row * sq_m + heads[:, None] * sq_h + dd[None, :], mask=h_ok[:, None] & d_ok[None, :],
                other=0.0)
    lo = 0
    if window > 0:
        lo = tl.maximum(pos - window + 1, 0)
    first = (lo // BLOCK_N) * BLOCK_N
    m_i = tl.full((BH,), float("-inf"), tl.float32)
    l_i = tl.zeros((BH,), tl.float32)
    acc = tl.zeros((BH, BD), tl.float32)
    tt = tl.arange(0, BLOCK_N)
    for t0 in range(first, pos + 1, BLOCK_N):
        t = t0 + tt
        t_ok = (t <= pos) & (t >= lo)
        kv_off = kvh * sk_h + t[:, None] * sk_t + dd[None, :]
        kv_mask = t_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee", out_dtype=tl.float32)  # [BH, BLOCK_N]
        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee", out_dtype=tl.float32)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(o_ptr + row * so_m + heads[:, None] * so_h + dd[None, :], out, mask=h_ok[:, None] & d_ok[None, :])


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int,
           window: int | None = None) -> torch.Tensor:
    """Attention of the rows q [M, n_heads, head_dim] (float32, roped and scaled) at positions
    ``start .. start + M - 1`` over k_cache, v_cache [n_kv, capacity, head_dim] (float32, the rows'
    own K/V already written). -> [M, n_heads, head_dim] float32."""
    m, n_heads, d = q.shape
    n_kv, cap, dk = k_cache.shape
    if dk != d or v_cache.shape != k_cache.shape or n_heads % n_kv:
        raise ValueError(f"attention shapes: q {tuple(q.shape)}, cache {tuple(k_cache.shape)}")
    if start + m > cap:
        raise ValueError(f"rows up to position {start + m - 1} do not fit a cache of {cap}")
    if k_cache.stride(2) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("the K/V caches must be laid out alike, contiguous along head_dim")
    q = q.contiguous()
    out = torch.empty_like(q)
    rep = n_heads // n_kv
    _attend_kernel[(m, n_kv)](q, k_cache, v_cache, out, start, window or 0,
                              q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
                              out.stride(0), out.stride(1),
                              REP=rep, D=d, BD=max(16, triton.next_power_of_2(d)),
                              BH=max(MIN_HEADS, triton.next_power_of_2(rep)), BLOCK_N=BLOCK_N)
    return out


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int,
              window: int | None = None) -> torch.Tensor:
    """Each row's softmax attention over its allowed positions, in float64, on the CPU."""
    q, k, v = (t.detach().cpu().double() for t in (q, k_cache, v_cache))
    m, n_heads, _ = q.shape
    rep = n_heads // k.shape[0]
    out = torch.empty_like(q)
    for i in range(m):
        pos = start + i
        lo = max(0, pos - window + 1) if window else 0
        for h in range(n_heads):
            kk, vv = k[h // rep, lo : pos + 1], v[h // rep, lo : pos + 1]
            out[i, h] = torch.softmax(kk @ q[i, h], dim=0) @ vv
    return out
