"""The Triton product over GGUF blocks (tsspec/kernels/triton_gguf.py), on the GPU or, without one,
in Triton's interpreter on the CPU (tests/triton_env.py).

* every type (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K, F32, F16, BF16), every row count 1..16: within
  ``error_bound`` of the float64 product of gguf-py's dequantization (float16 rounding of the
  inputs plus float32 accumulation, derived in the kernel module), and far closer than a wrong
  layout could be;
* batch invariance: row i of an M-row product is bitwise row i computed alone, for M = 1..16 and a
  multi-tile M (40), with N and K not multiples of the tiles;
* block sizes agree with gguf's GGML_QUANT_SIZES; wrong shapes are refused.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from triton_env import DEVICE, ON_GPU  # noqa: F401  (sets TRITON_INTERPRET before the kernels load)
from test_kernels import random_blocks  # noqa: E402

from tsspec.kernels import triton_gguf as tg  # noqa: E402

QUANT_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"]
FLOAT_TYPES = ["F32", "F16", "BF16"]
ROWS = range(1, 17)


def shape_for(type_name: str) -> tuple[int, int]:
    """Small shapes: N = 72 (two column tiles, the second partial), K = two blocks of the type."""
    k = 512 if type_name in ("Q4_K", "Q6_K") else 96
    return 72, k


def run(type_name: str, raw: np.ndarray, k: int, x: torch.Tensor) -> torch.Tensor:
    w = torch.from_numpy(raw).to(DEVICE)
    y = torch.full((x.shape[0], raw.shape[0]), float("nan"), device=DEVICE)
    tg.matmul(type_name, w, k, x.to(DEVICE).contiguous(), y)
    return y.cpu()


def test_block_sizes_are_ggufs():
    for name, (elems, nbytes) in tg.BLOCK.items():
        if name in FLOAT_TYPES:
            continue
        assert GGML_QUANT_SIZES[GGMLQuantizationType[name]] == (elems, nbytes), name


@pytest.mark.parametrize("type_name", QUANT_TYPES + FLOAT_TYPES)
def test_close_to_reference_and_batch_invariant(type_name):
    n, k = shape_for(type_name)
    raw = random_blocks(type_name, n, k, seed=11)
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(40, k, generator=gen) * torch.logspace(-2, 2, 40)[:, None]  # rows of every magnitude
    x[5] = 0.0  # a zero row (scale 1)
    ref = tg.reference(type_name, raw, k, x)
    bound = tg.error_bound(type_name, raw, k, x)
    singles = torch.cat([run(type_name, raw, k, x[i : i + 1]) for i in range(16)])
    err = (singles.double() - ref[:16]).abs()
    assert bool((err <= bound[:16]).all()), f"{type_name}: worst error / bound {float((err / bound[:16]).max()):.3g}"
    # not vacuous: the bound is a small fraction of each row's values (a layout mistake is not)
    assert bool((bound[:16].amax(1) <= 1e-2 * ref[:16].abs().amax(1) + 1e-30).all())
    for m in ROWS:
        got = run(type_name, raw, k, x[:m])
        assert torch.equal(got, singles[:m]), f"{type_name}: {m} rows differ from single rows"
    many = run(type_name, raw, k, x)  # three row tiles
    assert torch.equal(many[:16], singles)
    assert bool(((many.double() - ref).abs() <= bound).all())
    assert torch.equal(run(type_name, raw, k, x[20:21])[0], many[20])


def test_a_layout_mistake_would_be_caught():
    """The same bytes read as another 32-element type are far outside the bound (the test has teeth)."""
    n, k = 72, 96
    raw = random_blocks("Q4_1", n, k, seed=3)  # 20-byte blocks, read as Q4_0's layout would not fit
    x = torch.randn(2, k)
    right = tg.reference("Q4_1", raw, k, x)
    wrong_raw = raw.reshape(n, -1, 20)[:, :, :18].reshape(n, -1).copy()  # same codes offset wrong
    got = run("Q4_0", wrong_raw, k, x)
    assert not bool(((got.double() - right).abs() <= tg.error_bound("Q4_1", raw, k, x)).all())


def test_refuses_shapes_it_cannot_take():
    raw = random_blocks("Q4_K", 16, 256)
    with pytest.raises(ValueError, match="Q4_K"):
        tg.matmul("Q4_K", torch.from_numpy(raw).to(DEVICE), 128, torch.zeros(1, 128, device=DEVICE),
                  torch.zeros(1, 16, device=DEVICE))
    assert not tg.takes("Q4_K", 128) and tg.takes("Q4_K", 256) and not tg.takes("Q2_K", 256)
    assert tg.takes("Q6_K", 512) and tg.takes("F16", 8) is False and tg.takes("F32", 64)


def test_a_linear_of_mixed_parts_on_the_triton_backend():
    """``Linear.concat`` of parts of different types (a fused QKV whose V has more bits), with a
    bias, on the triton backend: the reference product of the same stored weights, and rows
    invariant."""
    from tsspec.weights import GGUFWeight, Linear

    k = 256
    parts = [("Q4_K", 48, 1), ("Q4_K", 16, 2), ("Q6_K", 16, 3), ("Q8_0", 8, 4)]
    ws = [(GGUFWeight(t, random_blocks(t, n, k, seed=s), (n, k)), None) for t, n, s in parts]
    bias = torch.randn(88)
    ws[0] = (ws[0][0], bias[:48].numpy())
    ws[1] = (ws[1][0], bias[48:64].numpy())
    ws[2] = (ws[2][0], bias[64:80].numpy())
    ws[3] = (ws[3][0], bias[80:].numpy())
    lin = Linear.concat(ws, "auto", DEVICE)
    assert lin.fmt == "triton" and [t for t, _, _ in lin.dev_parts] == ["Q4_K", "Q6_K", "Q8_0"]
    assert lin.nbytes() == sum(w.raw.nbytes for w, _ in ws) + 88 * 4
    x = torch.randn(6, k, device=DEVICE)
    y = lin(x)
    ref = lin.reference(x)
    assert float((y.cpu() - ref).abs().max()) <= 2e-3 * float(ref.abs().max())
    assert torch.equal(torch.cat([lin(x[i : i + 1]) for i in range(6)]).cpu(), y.cpu())
