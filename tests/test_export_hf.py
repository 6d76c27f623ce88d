"""`tsspec export-hf`: a trained block drafter in the Hugging Face layout of the DFlash reference.

The exported tensors are run by a plain-torch forward written here from the reference's semantics
(its names, ``hidden_states[target_layer_id + 1]``, ``hidden_norm(fc(...))`` as context shared by
every layer's keys and values, a block ``[anchor, mask, ...]`` of the target's embeddings attending
non-causally over context + block, rotate-half rope over all head dims, the final ``norm`` and the
target's LM head) and compared with the decode path ``DFlashModel.block_forward``.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from tests.clirun import run
from tests.distill_corpus import TEXT, own_cache, write_corpus  # noqa: F401 (own_cache: an autouse fixture)
from tests.tiny import write_tiny_model
from tsspec.distill.block import BlockShape
from tsspec.distill.export_hf import export_block_hf
from tsspec.distill.train import DistillConfig, distill
from tsspec.drafters import load_drafter
from tsspec.errors import BadInput
from tsspec.gguf_file import GGUFFile
from tsspec.models import load_model



@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("export-hf")
    # untied: the embedding (block input) and the LM head (read-out) are different matrices
    trunk = write_tiny_model(d / "trunk.gguf", arch="llama", vocab_size=300, d_model=64, n_layers=4, tied=False)
    corpus = write_corpus(d / "corpus")
    cfg = DistillConfig(model=str(trunk), out=str(d / "block.gguf"), kind="block", corpus=(str(corpus),), tokens=4096,
                        heldout_tokens=512, steps=20, batch=32, chunk=64, draft_vocab=128, eval_every=20, lr=3e-3,
                        weights="f32", precision="f32", block_size=5, taps=3, layers=2)
    # grouped-query attention (4 query heads over 2 KV heads), which the default shape for a
    # 64-wide trunk does not have: the export's head order must survive it
    mp = pytest.MonkeyPatch()
    mp.setattr(BlockShape, "for_trunk", classmethod(
        lambda cls, d, n_taps, n_layers, ffn, block, eps, base: cls(d, n_taps, n_layers, 4, 2, 16, ffn, block, eps, base)))
    try:
        result = distill(cfg)
    finally:
        mp.undo()
    return {"dir": d, "trunk": trunk, "drafter": result.out}


@pytest.fixture(scope="module")
def exported(world):
    out = export_block_hf(world["drafter"], world["dir"] / "hf")
    return json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))


# ----------------------------------------------------------------------------- the reference's forward


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def reference_block(cfg: dict, w: dict, hidden_states: list, embed: torch.Tensor, anchor: int, start: int):
    """DFlash draft forward for the block at ``start`` with context = positions 0..start-1.
    hidden_states: the target's per-layer outputs as transformers lists them (index 0 = embeddings).
    -> the final-normed rows 1..B-1 [B-1, hidden]."""
    dc = cfg["dflash_config"]
    eps, hd = cfg["rms_norm_eps"], cfg["head_dim"]
    nh, nkv, B = cfg["num_attention_heads"], cfg["num_key_value_heads"], dc["block_size"]
    feat = torch.cat([hidden_states[i + 1][:start] for i in dc["target_layer_ids"]], dim=-1)
    ctx = _rms(feat @ w["fc.weight"].T, w["hidden_norm.weight"], eps)  # [C, H]
    x = embed[torch.tensor([anchor] + [dc["mask_token_id"]] * (B - 1))]
    pos = torch.arange(start + B, dtype=torch.float64)
    inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = torch.cat([pos[:, None] * inv] * 2, dim=-1)
    cos, sin = ang.cos().float(), ang.sin().float()  # [C+B, hd]
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        u = _rms(x, w[p + "input_layernorm.weight"], eps)
        q = _rms((u @ w[p + "self_attn.q_proj.weight"].T).view(B, nh, hd), w[p + "self_attn.q_norm.weight"], eps)
        kin = torch.cat([ctx, u])
        k = _rms((kin @ w[p + "self_attn.k_proj.weight"].T).view(-1, nkv, hd), w[p + "self_attn.k_norm.weight"], eps)
        v = (kin @ w[p + "self_attn.v_proj.weight"].T).view(-1, nkv, hd)
        q = q * cos[-B:, None] + _rotate_half(q) * sin[-B:, None]
        k = k * cos[:, None] + _rotate_half(k) * sin[:, None]
        k, v = (t.repeat_interleave(nh // nkv, dim=1) for t in (k, v))
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd), dim=-1)  # no mask: non-causal
        x = x + torch.einsum("hqk,khd->qhd", att, v).reshape(B, nh * hd) @ w[p + "self_attn.o_proj.weight"].T
        u = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        x = x + (F.silu(u @ w[p + "mlp.gate_proj.weight"].T) * (u @ w[p + "mlp.up_proj.weight"].T)) \
            @ w[p + "mlp.down_proj.weight"].T
    return _rms(x, w["norm.weight"], eps)[1:]


# ----------------------------------------------------------------------------- tests


def test_layout_names_and_config(world, exported):
    cfg, w = exported
    g = GGUFFile(world["drafter"])
    taps = list(g.get("dflash.target_layers"))
    dc = cfg["dflash_config"]
    n = cfg["num_hidden_layers"]
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    assert dc["target_layer_ids"] == [t - 1 for t in taps]  # residual entering t == output of layer t - 1
    assert dc["block_size"] == cfg["block_size"] == 5
    assert dc["mask_token_id"] == g.get("dflash.mask_token_id")
    assert cfg["num_target_layers"] == 4 and cfg["vocab_size"] == 300 and cfg["hidden_size"] == 64
    assert cfg["max_position_embeddings"] == GGUFFile(world["trunk"]).get("llama.context_length") != 32768
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], n) == (4, 2, 16, 2)
    assert cfg["is_causal"] is False and cfg["layer_types"] == ["full_attention"] * cfg["num_hidden_layers"]
    assert cfg["rope_parameters"]["rope_theta"] == cfg["rope_theta"] == pytest.approx(g.get("dflash.rope.freq_base"))
    per_layer = {"input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                 "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
    want = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{m}.weight" for i in range(n) for m in per_layer}
    assert set(w) == want  # no output.weight, no d2t: the target's LM head does the read-out
    assert all(t.dtype == torch.float32 for t in w.values())
    H, hd = cfg["hidden_size"], cfg["head_dim"]
    assert w["fc.weight"].shape == (H, len(taps) * H)
    assert w["layers.0.self_attn.q_proj.weight"].shape == (cfg["num_attention_heads"] * hd, H)
    assert w["layers.0.self_attn.k_proj.weight"].shape == (cfg["num_key_value_heads"] * hd, H)
    assert w["layers.0.mlp.down_proj.weight"].shape == (H, cfg["intermediate_size"])
    assert torch.equal(w["layers.0.self_attn.k_norm.weight"], torch.tensor(g.tensor("blk.0.attn_k_norm.weight")))


def test_reference_forward_on_the_export_equals_the_decode_path(world, exported):
    cfg, w = exported
    target = load_model(world["trunk"], fmt="f32")
    model = load_drafter(world["drafter"], target).model
    trunk = GGUFFile(world["trunk"])
    embed = torch.tensor(trunk.tensor("token_embd.weight"))
    lm_head = torch.tensor(trunk.tensor("output.weight"))
    tokens = [ord(c) % 256 for c in TEXT[:40]]
    L = target.n_layers
    # transformers' hidden_states: [0..L-1] = the residual entering each layer, [L] = final-normed
    rows = target.forward(tokens, target.make_cache(), all_logits=True, taps=tuple(range(L + 1))).hidden.float()
    hidden_states = list(rows.split(cfg["hidden_size"], dim=-1))
    hidden_states[L] = _rms(hidden_states[L], target.out_norm.float(), float(target.cfg.rms_eps))
    taps = model.cfg.target_layers
    feat = torch.cat([hidden_states[t] for t in taps], dim=-1)
    d2t = model.d2t
    for p in (1, 17, 35):
        ring = model.new_state()
        model.inject(feat[:p], 0, ring)
        h_ours, logits_ours = model.block_forward(tokens[p], p, ring)
        h_ref = reference_block(cfg, w, hidden_states, embed, tokens[p], p)
        assert torch.allclose(h_ref, h_ours, atol=1e-4), (h_ref - h_ours).abs().max()
        logits_ref = h_ref @ lm_head.T  # the target's whole LM head
        assert torch.allclose(logits_ref[:, d2t], logits_ours[:, d2t], atol=1e-4)
        assert torch.equal(d2t[logits_ref[:, d2t].argmax(-1)], logits_ours.argmax(-1))


def test_bfloat16_export(world, tmp_path):
    out = export_block_hf(world["drafter"], tmp_path / "bf16", dtype="bfloat16")
    w = load_file(str(out / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in w.values())
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    with pytest.raises(BadInput, match="--dtype must be one of float32, bfloat16"):
        export_block_hf(world["drafter"], tmp_path / "x", dtype="float16")


def _rewrite(src, dst, *, add: dict | None = None, drop=(), meta: dict | None = None):
    """A copy of GGUF ``src`` with extra tensors, some left out, or some metadata replaced."""
    import gguf

    g = GGUFFile(src)
    wr = gguf.GGUFWriter(str(dst), "dflash")
    for k, v in {**g.metadata, **(meta or {})}.items():
        if k.startswith("general.architecture"):
            continue
        if isinstance(v, str):
            wr.add_string(k, v)
        elif isinstance(v, list):
            wr.add_array(k, v)
        elif isinstance(v, float):
            wr.add_float32(k, v)
        else:
            wr.add_uint32(k, int(v)) if v < 2 ** 32 else wr.add_uint64(k, int(v))
    for name in g.tensor_names():
        if name in drop:
            continue
        if name == "d2t":
            wr.add_tensor(name, np.asarray(g.reader.tensors[[t.name for t in g.reader.tensors].index(name)].data,
                                           dtype=np.int32).reshape(-1))
        else:
            wr.add_tensor(name, g.tensor(name))
    for name, a in (add or {}).items():
        wr.add_tensor(name, a)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return dst


def test_refuses_what_the_reference_layout_cannot_hold(world, tmp_path):
    src = world["drafter"]
    with pytest.raises(BadInput, match="is a 'llama' file, not a dflash block drafter"):
        export_block_hf(world["trunk"], tmp_path / "a")
    conv = _rewrite(src, tmp_path / "dflash2.gguf", add={"blk.0.attn_conv_base": np.zeros((2, 2, 64), np.float32)})
    with pytest.raises(BadInput, match="DFlash2 drafter .blk.0.attn_conv_base"):
        export_block_hf(conv, tmp_path / "b")
    sel = _rewrite(src, tmp_path / "sel.gguf", add={"selector_hidden.weight": np.zeros((8, 64), np.float32)})
    with pytest.raises(BadInput, match="DFlash2 drafter .selector_hidden.weight"):
        export_block_hf(sel, tmp_path / "c")
    emb = _rewrite(src, tmp_path / "emb.gguf", add={"token_embd.weight": np.zeros((300, 64), np.float32)})
    with pytest.raises(BadInput, match="its own token embedding"):
        export_block_hf(emb, tmp_path / "d")
    head = _rewrite(src, tmp_path / "head.gguf", drop=("d2t",))
    with pytest.raises(BadInput, match="its own LM head"):
        export_block_hf(head, tmp_path / "e")
    last = _rewrite(src, tmp_path / "last.gguf", meta={"dflash.target_layers": [1, 4]})
    with pytest.raises(BadInput, match=r"reads the residual after the trunk's last layer \(4\)"):
        export_block_hf(last, tmp_path / "g")
    rope = _rewrite(src, tmp_path / "rope.gguf", meta={"dflash.rope.dimension_count": 8})
    with pytest.raises(BadInput, match="rope covers 8 of 16 head dims"):
        export_block_hf(rope, tmp_path / "h")
    with pytest.raises(BadInput, match="no such file"):
        export_block_hf(tmp_path / "missing.gguf", tmp_path / "f")
    assert not any((tmp_path / n).exists() for n in "abcdefgh")  # nothing half-written


def test_cli(world, tmp_path):
    r = run("export-hf", str(world["drafter"]), "-o", str(tmp_path / "out"))
    assert r.exit_code == 0, r.output
    assert "DFlash reference layout" in " ".join(r.output.split())
    assert (tmp_path / "out" / "config.json").is_file() and (tmp_path / "out" / "model.safetensors").is_file()
    r = run("export-hf", str(world["trunk"]), "-o", str(tmp_path / "bad"))
    assert r.exit_code == 2 and "error:" in r.output and "not a dflash block drafter" in " ".join(r.output.split())
    r = run("export-hf", "--help")
    assert r.exit_code == 0 and "Hugging Face layout" in r.output and "model.safetensors" in r.output
