"""``Linear``: the fast bf16 product against its plain f32 reference, and batch invariance on the
shapes of the real models (a row's result must not depend on how many rows share the product)."""

from __future__ import annotations

import pytest
import torch

from tsspec.weights import DENSE_CHUNK_ROWS, Linear, dense_product, pad_rows

# (out, in) of every product in the four real models: fused QKV is [q + 2 kv, d], fused gate+up
# [2 ffn, d], down [d, ffn]; plus a vocabulary-sized head.
SHAPES = {
    "smollm2-135m": [(576 + 2 * 192, 576), (2 * 1536, 576), (576, 1536), (576, 576)],
    "gemma3-270m": [(1024 + 2 * 256, 640), (2 * 2048, 640), (640, 2048), (640, 1024)],
    "qwen2.5-coder-0.5b": [(896 + 2 * 128, 896), (2 * 4864, 896), (896, 4864)],
    "qwen2.5-coder-1.5b": [(1536 + 2 * 256, 1536), (2 * 8960, 1536), (1536, 8960)],
    "head": [(49152, 576)],
}
ALL_SHAPES = [(name, s) for name, shapes in SHAPES.items() for s in shapes]
ROW_COUNTS = [*range(1, 18), 33, 65]


def _weights(out: int, inp: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) / inp**0.5
    x = torch.randn(max(ROW_COUNTS) + 8, inp, generator=g)
    return w, x


def test_pad_rows():
    x = torch.arange(6.0).view(3, 2)
    assert pad_rows(x, 3) is x and pad_rows(x, 1) is x  # nothing to do: no copy
    p = pad_rows(x[:1], 4)
    assert p.shape == (4, 2) and torch.equal(p, x[:1].expand(4, 2))
    p = pad_rows(x, 5)
    assert torch.equal(p[:3], x) and torch.equal(p[3:], x[2:].expand(2, 2))  # the last row repeats
    q = pad_rows(torch.zeros(1, 3, 4), 2)  # any trailing shape (attention pads [rows, heads, dim])
    assert q.shape == (2, 3, 4)


@pytest.mark.parametrize("fmt", ["bf16", "f32"])
def test_linear_matches_reference(fmt):
    w, x = _weights(384, 256)
    b = torch.randn(384)
    lin = Linear(w.numpy(), b.numpy(), fmt)
    assert lin.weight.dtype == (torch.bfloat16 if fmt == "bf16" else torch.float32)
    for m in (1, 2, 7, 33):
        got, want = lin(x[:m]), lin.reference(x[:m])
        assert got.dtype == torch.float32 and got.shape == (m, 384)
        if fmt == "f32":
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        else:
            # the bf16 path also rounds the inputs to bf16 (relative error 2^-9 per element), so the
            # error of each output is bounded by ~2^-8 of sum |x||w| (2x slack for accumulation)
            bound = 2.0**-7 * (x[:m].abs() @ lin.weight.float().abs().T) + 1e-5
            assert bool(((got - want).abs() <= bound).all())
    # the reference really is the stored (bf16-rounded) weights, not the originals
    torch.testing.assert_close(lin.reference(x[:2]) - b, x[:2] @ lin.weight.float().T)


def test_linear_concat_and_bias():
    a, b = torch.randn(8, 32), torch.randn(4, 32)
    ba = torch.randn(8)
    lin = Linear.concat([(a.numpy(), ba.numpy()), (b.numpy(), None)], "f32")
    assert (lin.out_features, lin.in_features) == (12, 32)
    x = torch.randn(3, 32)
    want = torch.cat([x @ a.T + ba, x @ b.T], dim=1)  # a part without bias gets zeros
    torch.testing.assert_close(lin(x), want, atol=1e-5, rtol=1e-5)
    assert Linear.concat([(a.numpy(), None), (b.numpy(), None)], "f32").bias is None


# bf16 on every real model's shapes; f32 (the reference format) on one model's
CASES = [("bf16", m, s) for m, s in ALL_SHAPES] + [("f32", m, s) for m, s in ALL_SHAPES if m == "smollm2-135m"]


@pytest.mark.parametrize("fmt,model,shape", CASES, ids=[f"{f}-{n}-{o}x{i}" for f, n, (o, i) in CASES])
@pytest.mark.parametrize("threads", [1, 2])
def test_linear_is_batch_invariant(fmt, model, shape, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check_invariant(fmt, shape)
    finally:
        torch.set_num_threads(before)


def _check_invariant(fmt, shape):
    out, inp = shape
    w, x = _weights(out, inp, seed=out + inp)
    lin = Linear(w.numpy(), None, fmt)
    full = lin(x)  # every row computed in one big product
    for m in ROW_COUNTS:
        for start in (0, 5):  # the same rows at another offset in the batch
            got = lin(x[start : start + m])
            assert torch.equal(got, full[start : start + m]), f"{m} rows at offset {start} differ"


def test_dense_product_runs_fixed_size_chunks(monkeypatch):
    """Every dense GEMM sees exactly DENSE_CHUNK_ROWS rows, whatever the row count."""
    seen = []
    real = torch.nn.functional.linear
    monkeypatch.setattr("tsspec.weights.F.linear", lambda x, w: seen.append(x.shape[0]) or real(x, w))
    w, x = torch.randn(8, 32), torch.randn(40, 32)
    for m in (1, DENSE_CHUNK_ROWS, DENSE_CHUNK_ROWS + 1, 40):
        seen.clear()
        y = dense_product(x[:m], w)
        assert set(seen) == {DENSE_CHUNK_ROWS} and len(seen) == -(-m // DENSE_CHUNK_ROWS)
        torch.testing.assert_close(y[:m], x[:m] @ w.T, atol=1e-5, rtol=1e-5)
