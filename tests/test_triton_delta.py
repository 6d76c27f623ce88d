"""The gated delta rule row by row in Triton (tsspec/kernels/triton_delta.py), on the GPU or in
Triton's interpreter on the CPU (tests/triton_env.py).

* outputs and per-row states close to a float64 reference (and to the torch form the hybrid trunks
  use, ``gated_delta.delta_rule_rows``);
* batch invariance: n rows in one call give each row's output and state bitwise what n chained
  1-row calls give; the per-row slots hold exactly those states and leave the live state alone.
"""

from __future__ import annotations

import pytest
import torch

from triton_env import DEVICE  # noqa: F401  (sets TRITON_INTERPRET before the kernels load)

from tsspec.kernels import triton_delta as td  # noqa: E402
from tsspec.models import gated_delta  # noqa: E402


def inputs(n=9, H=3, dk=32, dv=48, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = gated_delta.l2norm(torch.randn(n, H, dk, generator=gen)) / dk ** 0.5
    k = gated_delta.l2norm(torch.randn(n, H, dk, generator=gen))
    v = torch.randn(n, H, dv, generator=gen)
    g = -torch.rand(n, H, generator=gen) * 0.5
    beta = torch.rand(n, H, generator=gen) * 0.9 + 0.05
    ssm = torch.randn(H, dk, dv, generator=gen) * 0.1
    return ssm, q, k, v, g, beta


def dev(*ts):
    return [t.to(DEVICE) for t in ts]


@pytest.mark.parametrize("dk,dv", [(32, 48), (20, 16)])  # dv over two column blocks; dk not a power of two
def test_close_to_reference_and_row_invariant(dk, dv):
    ssm, q, k, v, g, beta = inputs(dk=dk, dv=dv)
    n, H = q.shape[:2]
    ref_o, ref_s = td.reference(ssm, q, k, v, g, beta)
    slots = torch.full((n + 2, H, dk, dv), float("nan"), device=DEVICE)
    live = ssm.clone().to(DEVICE)
    o = td.delta_rule_rows(live, *dev(q, k, v, g, beta), rows_out=slots)
    assert torch.equal(live.cpu(), ssm)  # the live state is untouched while rows go to slots
    assert float((o.cpu().double() - ref_o).abs().max()) <= 1e-5 * float(ref_o.abs().max())
    assert float((slots[:n].cpu().double() - ref_s).abs().max()) <= 1e-5 * float(ref_s.abs().max())
    torch_o = gated_delta.delta_rule_rows(ssm.clone(), q, k, v, g, beta)
    assert float((o.cpu() - torch_o).abs().max()) <= 1e-5 * float(torch_o.abs().max())
    # chained single rows, the state updated in place: bitwise the same outputs and states
    state = ssm.clone().to(DEVICE)
    for t in range(n):
        o1 = td.delta_rule_rows(state, *dev(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1],
                                            beta[t : t + 1]))
        assert torch.equal(o1[0].cpu(), o[t].cpu()), t
        assert torch.equal(state.cpu(), slots[t].cpu()), t
    # and any prefix of the rows gives the same first rows
    for m in (1, 4, 8):
        assert torch.equal(td.delta_rule_rows(ssm.clone().to(DEVICE), *dev(q[:m], k[:m], v[:m], g[:m], beta[:m])).cpu(),
                           o[:m].cpu())


def test_refuses_mismatched_shapes():
    ssm, q, k, v, g, beta = inputs()
    with pytest.raises(ValueError, match="shapes"):
        td.delta_rule_rows(ssm[:2].to(DEVICE), *dev(q, k, v, g, beta))
