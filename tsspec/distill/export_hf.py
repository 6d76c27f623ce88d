"""Export a ``dflash`` GGUF block drafter to the Hugging Face layout of the z-lab DFlash reference.

vLLM (``--speculative-config '{"method": "dflash", ...}'``), SGLang (``--speculative-algorithm
DFLASH``) and transformers (the reference's ``DFlashDraftModel`` through ``AutoModel`` with
``trust_remote_code``) read a DFlash drafter as a directory with ``config.json`` and
``model.safetensors``. The math is the one ``tsspec.drafters.dflash`` runs (passes A-C), so the
export is a renaming plus a config:

    ours (GGUF)                       reference (safetensors)
    fc.weight                         fc.weight
    enc.output_norm.weight            hidden_norm.weight        (norm of fc's output: both have it)
    output_norm.weight                norm.weight
    blk.{i}.attn_norm.weight          layers.{i}.input_layernorm.weight
    blk.{i}.attn_{q,k,v}.weight       layers.{i}.self_attn.{q,k,v}_proj.weight
    blk.{i}.attn_output.weight        layers.{i}.self_attn.o_proj.weight
    blk.{i}.attn_{q,k}_norm.weight    layers.{i}.self_attn.{q,k}_norm.weight
    blk.{i}.ffn_norm.weight           layers.{i}.post_attention_layernorm.weight
    blk.{i}.ffn_{gate,up,down}.weight layers.{i}.mlp.{gate,up,down}_proj.weight

    dflash.target_layers (residual ENTERING layer t)  -> dflash_config.target_layer_ids = t - 1
    (the reference reads ``hidden_states[id + 1]``, the output of layer id = what enters id + 1)

What is not carried: ``output.weight`` + ``d2t`` of a ``tsspec distill`` file (the trunk's own output
rows for a draft vocabulary; the reference scores with the target's whole LM head, which gives the
same logits on the draft vocabulary and real ones elsewhere). Refused: DFlash2 files (conv and
selector tensors; the plain reference layout has no place for them), files with their own token
embedding (the reference always borrows the target's), partial rope, and a tap on the residual after
the trunk's last layer (the reference's last hidden state is after the final norm).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..drafters.dflash.config import ARCH, read_config
from ..errors import BadInput, TsspecError
from ..gguf_file import GGUFFile
from ..paths import check_input_file

DTYPES = ("float32", "bfloat16")
DEFAULT_MAX_POSITIONS = 32768  # for a file without dflash.context_length; default rope ignores it

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {"fc.weight": "fc.weight", "enc.output_norm.weight": "hidden_norm.weight",
              "output_norm.weight": "norm.weight"}
_DFLASH2_MARKERS = ("_conv_base", "_conv_proj.weight", "selector_")


def hf_tensor_name(name: str) -> str | None:
    """Our GGUF tensor name -> the reference's safetensors name (None: not one of the mapped ones)."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    if name.startswith("blk."):
        parts = name.split(".", 2)
        if len(parts) == 3 and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
            return f"layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def _refuse(name: str, why: str) -> BadInput:
    return BadInput(f"{name}: cannot export to the DFlash reference layout: {why}")


def check_out_dir(out: Path) -> None:
    """``out`` can take the two files: a directory whose ``config.json`` and ``model.safetensors``
    are files or not there (a FIFO there blocked the write for ever), or a new directory's name."""
    from ..paths import check_output_file

    if out.is_dir():
        for name in OUT_FILES:
            check_output_file(out / name, f"-o {out}: {name}")
    elif out.exists() or out.is_symlink():
        raise BadInput(f"-o {out}: exists and is not a directory")
    else:  # made with its parents: the first missing one must be creatable
        top = out.absolute()
        while not top.parent.exists() and top.parent != top:
            top = top.parent
        check_output_file(top, f"-o {out}")


OUT_FILES = ("config.json", "model.safetensors")


def _hf_state(g: GGUFFile, cfg, tensors: list[str], dtype: str) -> dict:
    """The reference layout's tensors, dequantized to ``dtype``, each one the layout needs present."""
    import torch

    name = g.path.name
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    state: dict[str, torch.Tensor] = {}
    for t in tensors:
        hf = hf_tensor_name(t)
        if hf is not None:
            state[hf] = torch.from_numpy(np.array(g.tensor(t), dtype=np.float32)).to(torch_dtype)
    need = ["fc.weight", "hidden_norm.weight", "norm.weight"] + [
        f"layers.{i}.{n}" for i in range(cfg.n_layers) for n in _LAYER_NAMES.values()]
    missing = [n for n in need if n not in state]
    if missing:
        raise _refuse(name, f"tensor for {missing[0]!r} is missing")
    extra = sorted({k.split(".")[1] for k in state if k.startswith("layers.")} - {str(i) for i in range(cfg.n_layers)})
    if extra:
        raise _refuse(name, f"tensors for layer {extra[0]} but dflash.block_count is {cfg.n_layers}")
    if state["fc.weight"].shape[1] % cfg.d_model or state["fc.weight"].shape[1] // cfg.d_model != len(cfg.target_layers):
        raise _refuse(name, f"fc.weight is {tuple(state['fc.weight'].shape)}: the reference needs "
                            f"(hidden, {len(cfg.target_layers)} x hidden), its hidden size being the target's")

    return state


def _hf_config(g: GGUFFile, cfg, dtype: str, *, ffn: int, trunk_layers) -> dict:
    """The reference's ``config.json`` for this drafter."""
    name = g.path.name
    vocab = g.get(f"{ARCH}.vocab_size", g.get(f"{ARCH}.trunk.vocab_size"))
    if vocab is None:
        raise _refuse(name, "the target's vocabulary size is not recorded (dflash.vocab_size)")
    n_target = int(trunk_layers) if trunk_layers is not None else max(cfg.target_layers) + 1
    sliding = cfg.sliding_window is not None and any(cfg.swa_layers)
    draft_cfg: dict[str, object] = {
        "block_size": cfg.block_size,
        "mask_token_id": cfg.mask_token_id,
        "target_layer_ids": [t - 1 for t in cfg.target_layers],
    }
    if cfg.logit_scale != 1.0:
        draft_cfg["output_multiplier"] = cfg.logit_scale
    if cfg.final_softcap:
        draft_cfg["final_logit_softcapping"] = cfg.final_softcap
    config = {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "block_size": cfg.block_size,
        "dflash_config": draft_cfg,
        "dtype": dtype,
        "torch_dtype": dtype,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "hidden_size": cfg.d_model,
        "initializer_range": 0.02,
        "intermediate_size": int(ffn),
        "is_causal": bool(cfg.causal),
        "layer_types": ["sliding_attention" if (sliding and s) else "full_attention" for s in cfg.swa_layers],
        "max_position_embeddings": int(g.get(f"{ARCH}.context_length", DEFAULT_MAX_POSITIONS)),
        "max_window_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_hidden_layers": cfg.n_layers,
        "num_key_value_heads": cfg.n_kv_heads,
        "num_target_layers": n_target,
        "rms_norm_eps": cfg.rms_eps,
        "rope_theta": cfg.rope_base,
        "rope_parameters": {"rope_theta": cfg.rope_base, "rope_type": "default"},
        "rope_scaling": None,
        "sliding_window": cfg.sliding_window if sliding else None,
        "use_sliding_window": sliding,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": int(vocab),
    }
    return config


def export_block_hf(gguf_path, out_dir, dtype: str = "float32") -> Path:
    """Write ``out_dir/config.json`` and ``out_dir/model.safetensors`` for the dflash GGUF at
    ``gguf_path``; returns ``out_dir``. Weights are dequantized to ``dtype`` (float32: exactly
    what the GGUF's dequantized matrices are; bfloat16: the reference's published checkpoints)."""
    if dtype not in DTYPES:
        raise BadInput(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    check_out_dir(Path(out_dir))
    path = check_input_file(gguf_path, "drafter")  # one line for a missing name, a FIFO, a device
    g = GGUFFile(path)
    name = path.name
    arch = g.get("general.architecture")
    if arch != ARCH:
        raise _refuse(name, f"it is a {arch!r} file, not a dflash block drafter (general.architecture = dflash)")
    tensors = g.tensor_names()
    dflash2 = [t for t in tensors if any(m in t for m in _DFLASH2_MARKERS)]
    if dflash2:
        raise _refuse(name, f"it is a DFlash2 drafter ({dflash2[0]}, ...): its convolutions and candidate "
                            "selector have no place in the plain DFlash layout")
    try:
        cfg = read_config(g)
    except TsspecError as e:
        raise _refuse(name, str(e)) from None
    if g.has_tensor("token_embd.weight"):
        raise _refuse(name, "it carries its own token embedding; the reference always uses the target's")
    ours = g.get(f"{ARCH}.trunk.vocab_sha256") is not None  # written by `tsspec distill --kind block`
    if g.has_tensor("output.weight") and not (ours and g.has_tensor("d2t")):
        raise _refuse(name, "it carries its own LM head; the reference always uses the target's")
    if cfg.rope_dim != cfg.head_dim:
        raise _refuse(name, f"rope covers {cfg.rope_dim} of {cfg.head_dim} head dims; the reference ropes all")
    trunk_layers = g.get(f"{ARCH}.trunk.block_count")
    if trunk_layers is not None and max(cfg.target_layers) >= int(trunk_layers):
        raise _refuse(name, f"dflash.target_layers {list(cfg.target_layers)} reads the residual after the "
                            f"trunk's last layer ({trunk_layers}); the reference's last hidden state is final-normed")
    unknown = [t for t in tensors if hf_tensor_name(t) is None and t not in ("output.weight", "d2t")]
    if unknown:
        raise _refuse(name, f"tensor {unknown[0]!r} has no counterpart in the reference layout")

    state = _hf_state(g, cfg, tensors, dtype)
    config = _hf_config(g, cfg, dtype, ffn=int(state["layers.0.mlp.gate_proj.weight"].shape[0]),
                        trunk_layers=trunk_layers)
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise TsspecError("export-hf needs the safetensors package (a tsspec dependency): "
                          "pip install safetensors") from None
    out = Path(out_dir)
    check_out_dir(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
