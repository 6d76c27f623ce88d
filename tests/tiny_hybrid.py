"""Tiny random-weight hybrid GGUF files (``qwen35``, ``qwen3next``) in llama.cpp's layout.

The weights come from a transformers model built with random weights (``hf_model``), converted the
way llama.cpp's converter does it, so a test can compare logits against the transformers model:

======================================  ==========================================================
HF tensor                               GGUF tensor (numpy order [out, in])
======================================  ==========================================================
embed_tokens / lm_head / norm           token_embd / output / output_norm (+1 folded)
layers.i.input_layernorm                blk.i.attn_norm (+1)
layers.i.post_attention_layernorm       blk.i.post_attention_norm (+1)
self_attn.q_proj ([q_h, gate_h]/head)   blk.i.attn_q (unchanged: llama.cpp views q and gate)
self_attn.k_proj / v_proj / o_proj      blk.i.attn_k / attn_v / attn_output
self_attn.q_norm / k_norm               blk.i.attn_q_norm / attn_k_norm (+1)
linear_attn.in_proj_qkv                 blk.i.attn_qkv       (qwen35: V rows reordered, below)
linear_attn.in_proj_z                   blk.i.attn_gate      (reordered)
linear_attn.in_proj_b / in_proj_a       blk.i.ssm_beta / ssm_alpha (reordered)
linear_attn.A_log                       blk.i.ssm_a = -exp(A_log) (reordered)
linear_attn.dt_bias                     blk.i.ssm_dt.bias (reordered)
linear_attn.conv1d [C, 1, K]            blk.i.ssm_conv1d [C, K] (V channels reordered)
linear_attn.norm                        blk.i.ssm_norm (no +1: HF stores it plain)
linear_attn.out_proj                    blk.i.ssm_out (V columns reordered)
mlp.gate_proj / up_proj / down_proj     blk.i.ffn_gate / ffn_up / ffn_down
======================================  ==========================================================

qwen35 reorders value heads from HF's grouped order (K0v0, K0v1, K1v0, ...) to llama.cpp's tiled
order (K0v0, K1v0, K0v1, ...). qwen3next keeps HF's grouped order; its HF ``in_proj_qkvz`` /
``in_proj_ba`` interleave per key head and the converter splits them into ``attn_qkv`` +
``attn_gate`` and keeps ``ssm_ba`` fused (per key head: r betas then r alphas).

An optional NextN/MTP block (random weights, no HF counterpart) is written as ``blk.{n}.nextn.*``
plus a full attention block at index n, with ``{arch}.nextn_predict_layers = 1``;
``write_nextn_only`` writes such a block alone, as a separate draft-head GGUF.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tiny import CHATML_TEMPLATE, EOS_TOKEN, byte_level_vocab, finish_gguf


VOCAB = 300
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
             linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=1024)


def hf_config(arch: str = "qwen35", **over):
    kw = dict(SMALL, **over)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    if arch == "qwen35":
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

        rope.update(mrope_section=[1, 1, 0], mrope_interleaved=True)
        return Qwen3_5TextConfig(rope_parameters=rope, tie_word_embeddings=False, **kw)
    from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig

    return Qwen3NextConfig(rope_parameters=rope, tie_word_embeddings=False, num_experts=0,
                           mlp_only_layers=list(range(kw["num_hidden_layers"])), **kw)


def hf_model(arch: str = "qwen35", seed: int = 0, **over):
    """A transformers causal LM with random weights of useful scale (not the near-zero init)."""
    cfg = hf_config(arch, **over)
    if arch == "qwen35":
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM as M
    else:
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextForCausalLM as M
    torch.manual_seed(seed)
    model = M(cfg).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.empty(p.shape).uniform_(0.5, 8.0, generator=gen)))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif "norm" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if name.endswith("linear_attn.norm.weight") else 0.0))
            elif "conv1d" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            elif p.ndim == 2:
                scale = 4.0 if "lm_head" in name else 1.0
                p.copy_(torch.randn(p.shape, generator=gen) * scale / p.shape[1] ** 0.5)
    return model


def _reorder_v(t: np.ndarray, axis: int, nk: int, r: int, hd: int) -> np.ndarray:
    """Grouped (by key head) -> tiled value-head order along ``axis``."""
    t = np.moveaxis(t, axis, 0)
    rest = t.shape[1:]
    t = t.reshape(nk, r, hd, *rest).swapaxes(0, 1).reshape(nk * r * hd, *rest)
    return np.ascontiguousarray(np.moveaxis(t, 0, axis))


def gguf_tensors(model, arch: str) -> dict[str, np.ndarray]:
    """The HF state dict converted to llama.cpp's GGUF tensors (see the module table)."""
    c = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    nk, nv = c.linear_num_key_heads, c.linear_num_value_heads
    dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
    r = nv // nk
    tiled = arch == "qwen35"
    out = {
        "token_embd.weight": sd["model.embed_tokens.weight"],
        "output_norm.weight": sd["model.norm.weight"] + 1,
        "output.weight": sd["lm_head.weight"],
    }
    for i, kind in enumerate(c.layer_types):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        out[b + "attn_norm.weight"] = sd[p + "input_layernorm.weight"] + 1
        out[b + "post_attention_norm.weight"] = sd[p + "post_attention_layernorm.weight"] + 1
        for x in ("gate", "up", "down"):
            out[b + f"ffn_{x}.weight"] = sd[p + f"mlp.{x}_proj.weight"]
        if kind == "full_attention":
            a = p + "self_attn."
            out[b + "attn_q.weight"] = sd[a + "q_proj.weight"]
            out[b + "attn_k.weight"] = sd[a + "k_proj.weight"]
            out[b + "attn_v.weight"] = sd[a + "v_proj.weight"]
            out[b + "attn_output.weight"] = sd[a + "o_proj.weight"]
            out[b + "attn_q_norm.weight"] = sd[a + "q_norm.weight"] + 1
            out[b + "attn_k_norm.weight"] = sd[a + "k_norm.weight"] + 1
            continue
        la = p + "linear_attn."
        if arch == "qwen35":
            qkv, z = sd[la + "in_proj_qkv.weight"], sd[la + "in_proj_z.weight"]
            beta, alpha = sd[la + "in_proj_b.weight"], sd[la + "in_proj_a.weight"]
        else:  # split the per-key-head interleaved [q, k, v, z] and [b, a] groups
            w = sd[la + "in_proj_qkvz.weight"].reshape(nk, 2 * dk + 2 * r * dv, -1)
            q, k = w[:, :dk], w[:, dk : 2 * dk]
            v, z = w[:, 2 * dk : 2 * dk + r * dv], w[:, 2 * dk + r * dv :]
            d = w.shape[-1]
            qkv = np.concatenate([q.reshape(-1, d), k.reshape(-1, d), v.reshape(-1, d)])
            z = z.reshape(-1, d)
            ba = sd[la + "in_proj_ba.weight"].reshape(nk, 2 * r, -1)
            beta, alpha = ba[:, :r].reshape(nv, -1), ba[:, r:].reshape(nv, -1)
        conv = sd[la + "conv1d.weight"].reshape(sd[la + "conv1d.weight"].shape[0], -1)
        a_log, dt = sd[la + "A_log"], sd[la + "dt_bias"]
        o = sd[la + "out_proj.weight"]
        if tiled and r > 1:
            kd2 = 2 * nk * dk
            qkv = np.concatenate([qkv[:kd2], _reorder_v(qkv[kd2:], 0, nk, r, dv)])
            z = _reorder_v(z, 0, nk, r, dv)
            beta, alpha = _reorder_v(beta, 0, nk, r, 1), _reorder_v(alpha, 0, nk, r, 1)
            a_log, dt = _reorder_v(a_log, 0, nk, r, 1), _reorder_v(dt, 0, nk, r, 1)
            conv = np.concatenate([conv[:kd2], _reorder_v(conv[kd2:], 0, nk, r, dv)])
            o = _reorder_v(o, 1, nk, r, dv)
        if arch == "qwen35":
            out[b + "ssm_beta.weight"], out[b + "ssm_alpha.weight"] = beta, alpha
        else:  # fused per key head: [b (r), a (r)]
            out[b + "ssm_ba.weight"] = np.concatenate(
                [beta.reshape(nk, r, -1), alpha.reshape(nk, r, -1)], axis=1).reshape(2 * nv, -1)
        out[b + "attn_qkv.weight"], out[b + "attn_gate.weight"] = qkv, z
        out[b + "ssm_conv1d.weight"] = conv
        out[b + "ssm_a"] = -np.exp(a_log)
        out[b + "ssm_dt.bias"] = dt
        out[b + "ssm_norm.weight"] = sd[la + "norm.weight"]
        out[b + "ssm_out.weight"] = o
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def nextn_tensors(c, layer: int, seed: int = 1, *, shared_head: bool = False) -> dict[str, np.ndarray]:
    """A random NextN/MTP block at ``blk.{layer}``: eh_proj, enorm, hnorm and a gated-attention block."""
    rng = np.random.default_rng(seed)
    d, nh, nkv, hd, f = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size

    def mat(o, i, s=1.0):
        return (rng.standard_normal((o, i)) * s / np.sqrt(i)).astype(np.float32)

    def norm(n):
        return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    b = f"blk.{layer}."
    t = {
        b + "nextn.eh_proj.weight": mat(d, 2 * d),
        b + "nextn.enorm.weight": norm(d),
        b + "nextn.hnorm.weight": norm(d),
        b + "attn_norm.weight": norm(d),
        b + "post_attention_norm.weight": norm(d),
        b + "attn_q.weight": mat(2 * nh * hd, d),
        b + "attn_k.weight": mat(nkv * hd, d),
        b + "attn_v.weight": mat(nkv * hd, d),
        b + "attn_output.weight": mat(d, nh * hd),
        b + "attn_q_norm.weight": norm(hd),
        b + "attn_k_norm.weight": norm(hd),
        b + "ffn_gate.weight": mat(f, d),
        b + "ffn_up.weight": mat(f, d),
        b + "ffn_down.weight": mat(d, f),
    }
    if shared_head:
        t[b + "nextn.shared_head_norm.weight"] = norm(d)
        t[b + "nextn.shared_head_head.weight"] = mat(c.vocab_size, d, 4.0)
    return t


def _write(path: Path, arch: str, c, tensors: dict[str, np.ndarray], n_blocks: int, n_nextn: int) -> Path:
    import gguf

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_type("model")
    w.add_name(f"tiny {arch}")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(n_blocks + n_nextn)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_rope_dimension_count(int(c.head_dim * c.rope_parameters.get("partial_rotary_factor", 0.25)))
    if arch == "qwen35":
        w.add_rope_dimension_sections([1, 1, 0, 0])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    w.add_ssm_state_size(c.linear_key_head_dim)
    w.add_ssm_group_count(c.linear_num_key_heads)
    w.add_ssm_time_step_rank(c.linear_num_value_heads)
    w.add_ssm_inner_size(c.linear_value_head_dim * c.linear_num_value_heads)
    w.add_full_attention_interval(4)
    if n_nextn:
        w.add_uint32(f"{arch}.nextn_predict_layers", n_nextn)
    w.add_file_type(0)
    tokens, types, merges = byte_level_vocab(c.vocab_size)
    eos = tokens.index(EOS_TOKEN)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    if merges:
        w.add_token_merges(merges)
    w.add_bos_token_id(eos)
    w.add_eos_token_id(eos)
    w.add_add_bos_token(False)
    if CHATML_TEMPLATE:
        w.add_chat_template(CHATML_TEMPLATE)
    return finish_gguf(w, tensors, path)


def write_hybrid(path, arch: str = "qwen35", *, seed: int = 0, mtp: bool = False, shared_head: bool = False,
                 model=None, **over):
    """Write a tiny ``arch`` GGUF (optionally with a NextN/MTP block); returns (path, hf_model)."""
    model = model if model is not None else hf_model(arch, seed, **over)
    c = model.config
    tensors = gguf_tensors(model, arch)
    n = c.num_hidden_layers
    if mtp:
        tensors.update(nextn_tensors(c, n, seed + 1, shared_head=shared_head))
    return _write(path, arch, c, tensors, n, 1 if mtp else 0), model


def write_nextn_only(path, model, arch: str = "qwen35", *, seed: int = 1) -> Path:
    """A separate draft-head GGUF: only the NextN/MTP block (at index n_layers) and the metadata."""
    c = model.config
    return _write(path, arch, c, nextn_tensors(c, c.num_hidden_layers, seed), c.num_hidden_layers, 1)
