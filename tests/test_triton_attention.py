"""Decode/verify attention in Triton (tsspec/kernels/triton_attention.py), on the GPU or in
Triton's interpreter on the CPU (tests/triton_env.py).

* each row attends to exactly the positions its own position allows (causal within a verify block,
  optionally a sliding window): close to a float64 reference (float32 accumulation over a few
  hundred keys: 1e-5 of the values' scale);
* batch invariance: a verify of M rows (1..16) gives each row bitwise what a 1-row step at that
  position gives, for global and sliding-window layers and grouped-query heads;
* a cache position a row may not see (the future, or outside its window) does not change it.
"""

from __future__ import annotations

import pytest
import torch

from triton_env import DEVICE  # noqa: F401  (sets TRITON_INTERPRET before the kernels load)

from tsspec.kernels import triton_attention as ta  # noqa: E402

# (heads, kv heads, head_dim): GQA 4/2 of 64, one KV head of 32 for 3 query heads (odd, < the tile)
SHAPES = [(4, 2, 64), (3, 1, 32)]


def setup(n_heads, n_kv, d, cap=160, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n_kv, cap, d, generator=g)
    v = torch.randn(n_kv, cap, d, generator=g)
    q = torch.randn(16, n_heads, d, generator=g) / d ** 0.5
    return q, k, v


def run(q, k, v, start, window=None):
    return ta.attend(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), start, window).cpu()


@pytest.mark.parametrize("n_heads,n_kv,d", SHAPES)
@pytest.mark.parametrize("window", [None, 24])
def test_close_to_reference_and_batch_invariant(n_heads, n_kv, d, window):
    q, k, v = setup(n_heads, n_kv, d)
    start = 37  # rows at positions 37..52: spans cross key-block boundaries (32, 64)
    singles = torch.cat([run(q[i : i + 1], k, v, start + i, window) for i in range(16)])
    ref = ta.reference(q, k, v, start, window)
    assert float((singles.double() - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
    for m in range(1, 17):
        assert torch.equal(run(q[:m], k, v, start, window), singles[:m]), f"{m} rows"
    assert torch.equal(run(q[3:9], k, v, start + 3, window), singles[3:9])  # a verify block mid-way


def test_rows_do_not_see_what_their_position_forbids():
    q, k, v = setup(4, 2, 64, seed=1)
    start = 40
    before = run(q[:8], k, v, start, 16)
    k2, v2 = k.clone(), v.clone()
    k2[:, start + 8 :] += 100.0  # the future of the last row
    v2[:, start + 8 :] -= 100.0
    k2[:, : start - 16] *= -3.0  # before the first row's window
    v2[:, : start - 16] += 7.0
    assert torch.equal(run(q[:8], k2, v2, start, 16), before)
    # and the first position at the edge of the window is seen
    k2[:, start - 15] += 1.0
    assert not torch.equal(run(q[:1], k2, v2, start, 16), before[:1])


def test_first_position_and_refusals():
    q, k, v = setup(4, 2, 64, seed=2)
    out = run(q[:1], k, v, 0)
    assert torch.allclose(out[0, 0], v[0, 0], atol=1e-6) and torch.allclose(out[0, 3], v[1, 0], atol=1e-6)
    with pytest.raises(ValueError, match="do not fit"):
        run(q[:4], k, v, 158)
    with pytest.raises(ValueError, match="shapes"):
        ta.attend(q[:1, :3].to(DEVICE), k.to(DEVICE), v.to(DEVICE), 0)
