"""A whole trunk on the Triton path (``load_model(device=...)``): every Linear on the triton
backend, attention by the Triton kernel, caches on the device. On the GPU when torch sees one; here,
in Triton's interpreter on CPU tensors (tests/triton_env.py), with tiny random-weight models.

* logits close to the CPU f32 reference on the same file (F32, Q8_0 and Q4_0 weights; biases,
  QK norms, gemma's sliding windows and post-norms, tied heads);
* batch invariance through the whole model: a 5-row verify gives each row the bits of 1-row steps;
* speculative decoding with a scripted acceptance pattern emits exactly the plain tokens (the
  scripted drafter and pattern of scripts/gpu_check.py, which the GPU check runs on real shapes).
"""

from __future__ import annotations

import pytest
import torch

from triton_env import DEVICE, ON_GPU  # noqa: F401  (sets TRITON_INTERPRET before the kernels load)
from tiny import write_tiny_model  # noqa: E402

from tsspec.models import load_model  # noqa: E402
from tsspec.weights import Linear  # noqa: E402

import gpu_check_module  # noqa: E402  (scripts/gpu_check.py)

CASES = [("llama", None), ("qwen2", "Q8_0"), ("gemma3", "Q4_0")]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("triton_models")
    # gemma3 with two (sliding-window) layers, to keep the interpreter quick; windows of 8 < the prompt
    return {arch: write_tiny_model(d / f"{arch}.gguf", arch, seed=5, ctx=256, quant=quant, tied=arch != "qwen2",
                                   n_layers=2 if arch == "gemma3" else None)
            for arch, quant in CASES}


def gpu_model(path):
    return load_model(path, device=DEVICE.type, triton=True)


@pytest.mark.parametrize("arch,quant", CASES)
def test_logits_close_to_the_cpu_reference_and_batch_invariant(files, arch, quant):
    model = gpu_model(files[arch])
    assert model.triton and all(isinstance(b.qkv, Linear) and b.qkv.fmt == "triton" for b in model.blocks)
    assert model.lm_head.fmt == "triton" and model.fused is None
    ref = load_model(files[arch], fmt="f32")
    prompt = [5, 17, 200, 33, 9, 120, 77, 3, 250, 41, 8, 66]
    got = model.forward(prompt, model.make_cache(), all_logits=True).logits
    want = ref.forward(prompt, ref.make_cache(), all_logits=True).logits
    assert got.device.type == "cpu" and got.shape == want.shape
    tol = 2e-3 if quant is None else 2e-2  # float16 inputs of the quantized products
    assert float((got - want).abs().max()) <= tol * float(want.abs().max()), arch
    if quant is None:  # float weights: the same greedy tokens as the CPU reference
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    # batch invariance: rows 7..11 as one verify == as five 1-row steps, bitwise
    a, b = model.make_cache(), model.make_cache()
    model.forward(prompt[:7], a)
    model.forward(prompt[:7], b)
    verify = model.forward(prompt[7:], a, all_logits=True).logits
    steps = torch.cat([model.forward([t], b).logits for t in prompt[7:]])
    assert torch.equal(verify, steps), arch
    assert a.k.device.type == DEVICE.type


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_scripted_speculation_equals_plain(files, arch):
    model = gpu_model(files[arch])
    prompt = [5, 17, 200, 33, 9, 120, 77, 3]
    res = gpu_check_module.spec_equals_plain(model, prompt, n_new=20)
    assert res["equal"], res
    assert res["verifies"] >= 3 and 0 < res["accepted"] < res["drafted"]  # some accepted, some rejected


def test_drafters_on_the_triton_path(files, tmp_path):
    """A draft model follows the trunk onto the Triton path; a block drafter (which borrows the
    trunk's embedding and head on the host) is refused in one line; hybrid trunks are refused."""
    from tiny_dflash import write_tiny_dflash

    from tsspec.drafters import DrafterOptions, load_drafter
    from tsspec.errors import BadInput

    trunk = gpu_model(files["llama"])
    drafter = load_drafter(files["llama"], trunk, DrafterOptions())
    assert drafter.model.triton and drafter.model.device == trunk.device
    cpu_drafter = load_drafter(files["llama"], trunk, DrafterOptions(weights="bf16"))
    assert not cpu_drafter.model.triton
    dflash = write_tiny_dflash(tmp_path / "d.gguf", files["llama"])
    with pytest.raises(BadInput, match="dflash drafter runs with --device cpu only"):
        load_drafter(dflash, trunk, DrafterOptions())
    with pytest.raises(BadInput, match="the GPU path runs the file's own GGUF blocks"):
        load_model(files["llama"], fmt="bf16", device=DEVICE.type, triton=True)


def test_hybrid_trunks_are_refused_on_the_triton_path(tmp_path):
    """Refused by architecture, before the file is validated or loaded."""
    import gguf
    import numpy as np

    from tsspec.errors import BadInput

    path = tmp_path / "h.gguf"
    w = gguf.GGUFWriter(str(path), "qwen35")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(BadInput, match="qwen35 trunks run on the CPU only for now"):
        load_model(path, device=DEVICE.type, triton=True)
