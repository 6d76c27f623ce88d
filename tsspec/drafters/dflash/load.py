"""Loading a dflash GGUF and binding it to a trunk: tensor checks, the trunk match, ``DFlashDrafter``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ...errors import BadInput, ModelFileError
from ...gguf_file import GGUFFile
from ...models.base import load_weight
from ...validate import weight_types
from ...weights import Linear, load_format, to_tensor
from .. import DrafterOptions
from .config import DFlashConfig, _meta_int, read_config
from .model import DFlashHead, DFlashModel, DraftLayer, GroupedConv, Selector


# ----------------------------------------------------------------------------- the drafter


class DFlashDrafter:
    """What ``load_drafter`` returns for a dflash file: served by the registry's ``block`` entry."""

    speculator_name = "block"
    preferred_window = None  # the trunk's, else the default

    def __init__(self, model: DFlashModel, target, path=None):
        self.model = model
        self.cfg = model.cfg
        self.draft_head = DFlashHead(model)
        self.path = path
        # (hidden, layers, vocab) of the trunk it was bound to: it drafts for that trunk only
        self.target_shape = (target.hidden_size, target.n_layers, target.vocab_size)
        self.notes = [f"{Path(str(path)).name if path else 'drafter'}: {self.describe()}"]
        self.warnings = []  # the session adds why a switched-off DFlash2 piece is off

    def switched_off(self) -> list[str]:
        """DFlash2 pieces the file has but the options turned off: "conv", "selector"."""
        m = self.model
        return [name for name, present, on in (("conv", m.has_conv, m.conv_enabled),
                                                ("selector", m.has_selector, m.selector_enabled))
                if present and not on]

    @property
    def taps(self) -> tuple[int, ...]:
        return self.cfg.target_layers

    def describe(self) -> str:
        cfg = self.cfg
        parts = [f"DFlash{'2' if self.model.generation == 2 else ''}", f"{cfg.n_layers} layers",
                 f"block {cfg.block_size}", f"taps {list(cfg.target_layers)}"]
        if self.model.has_conv:
            parts.append(f"conv k={cfg.conv_kernel}/g={cfg.conv_group}" + ("" if self.model.conv_enabled else " (off)"))
        if self.model.has_selector:
            parts.append(f"selector r={cfg.selector_rank}/top-{cfg.selector_top_k}"
                         + ("" if self.model.selector_enabled else " (off)"))
        return ", ".join(parts)


# ----------------------------------------------------------------------------- loading


def _check_trunk(g: GGUFFile, cfg: DFlashConfig, target, fc_in: int, own_embed: bool, own_head: bool) -> None:
    """A drafter is trained against one trunk: refuse any other, naming the key that disagrees."""
    name = g.path.name
    bad = [t for t in cfg.target_layers if t >= target.n_layers]
    if bad:
        raise BadInput(
            f"{name}: dflash.target_layers {list(cfg.target_layers)} reach layer {max(bad)}, but the "
            f"trunk has {target.n_layers} layers; this drafter belongs to a different model"
        )
    want = len(cfg.target_layers) * target.hidden_size
    if fc_in != want:
        raise BadInput(
            f"{name}: fc.weight takes {fc_in} inputs, but {len(cfg.target_layers)} dflash.target_layers "
            f"x trunk hidden {target.hidden_size} = {want}; this drafter belongs to a different model"
        )
    if (not own_embed or not own_head) and cfg.d_model != target.hidden_size:
        raise BadInput(
            f"{name}: dflash.embedding_length {cfg.d_model} differs from the trunk's hidden size "
            f"{target.hidden_size}, and the drafter borrows the trunk's embedding and LM head"
        )
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        raise BadInput(
            f"{name}: dflash.mask_token_id {cfg.mask_token_id} is outside the trunk's vocabulary "
            f"of {target.vocab_size}"
        )
    vocab = g.get("dflash.vocab_size")
    if vocab is not None and int(vocab) != target.vocab_size:
        raise BadInput(f"{name}: dflash.vocab_size {vocab} differs from the trunk's vocabulary {target.vocab_size}")


def _check_distilled_trunk(g: GGUFFile, target) -> None:
    """A drafter `tsspec distill` wrote records its trunk (architecture, shape, sha256 of the token
    list): refuse any other trunk by name, before the shape checks would give a vaguer reason."""
    from ..eagle import TRUNK_KEYS, check_trunk, trunk_identity

    trunk_path = getattr(target, "path", None)
    if trunk_path is None:
        return  # a trunk built in memory has no token list to compare; the shape checks still run
    meta = {k: g.get(f"dflash.trunk.{k}") for k in TRUNK_KEYS}
    check_trunk(g.path.name, meta, trunk_identity(GGUFFile(trunk_path), target), arch="dflash", noun="block drafter")


def _int_tensor(g: GGUFFile, name: str) -> torch.Tensor:
    """An integer tensor (``d2t`` is I64/I32), read as stored: there is nothing to dequantize."""
    for t in g.reader.tensors:
        if t.name == name:
            return torch.as_tensor(np.array(t.data).reshape(-1).astype(np.int64))
    raise ModelFileError(f"{g.path.name}: missing tensor {name!r}")


class _Reader:
    """One dflash file's tensors, each checked for presence, shape and type as it is read; a
    matrix a Linear multiplies comes in ``fmt`` (its stored blocks under "auto")."""

    def __init__(self, g: GGUFFile, fmt: str):
        self.g, self.name, self.fmt = g, g.path.name, fmt
        self.readable = weight_types()

    def shape_of(self, n: str) -> tuple[int, ...]:
        if not self.g.has_tensor(n):
            raise ModelFileError(f"{self.name}: missing tensor {n!r}")
        return tuple(int(x) for x in self.g.tensor_info(n).shape)

    def vec(self, n: str, size: int) -> torch.Tensor:
        a = to_tensor(self.g.tensor(n), torch.float32)
        if a.shape != (size,):
            raise ModelFileError(f"{self.name}: {n} is {tuple(a.shape)}, expected ({size},)")
        return a

    def mat(self, n: str, shape: tuple[int, ...]):
        got = self.shape_of(n)
        if got != shape:
            raise ModelFileError(f"{self.name}: {n} is {got}, expected {shape}")
        kind = self.g.tensor_info(n).type_name
        if kind not in self.readable:
            raise ModelFileError(f"{self.name}: tensor {n} has type {kind}, which is not a weight type "
                                 "(expected a float or quantized type)")
        return load_weight(self.g, [n], self.fmt)[0]

    def linear(self, n: str, shape: tuple[int, ...]) -> Linear:
        return Linear(self.mat(n, shape), None, self.fmt)

    def dense(self, n: str, shape: tuple[int, int]) -> torch.Tensor:
        """A matrix read as float values (an embedding, the selector's books)."""
        a = self.g.tensor(n)
        if a.shape != shape:
            raise ModelFileError(f"{self.name}: {n} is {a.shape}, expected {shape}")
        return to_tensor(a, torch.float32)


def load(g: GGUFFile, target, options: DrafterOptions | None = None, *, fmt: str | None = None) -> DFlashDrafter:
    """Read a dflash GGUF and bind it to ``target`` (a trunk exposing ``embed`` and ``lm_head``);
    ``fmt`` (default: ``options.weights``, else the trunk's) is the format of the drafter's own weights."""
    options = options or DrafterOptions()
    name = g.path.name
    for marker, what in (("markov_w1.weight", "DSpark Markov head"), ("blk.0.attn_sinks.weight", "attention sinks")):
        if g.has_tensor(marker):
            raise ModelFileError(f"{name}: this dflash file carries a {what} ({marker}), which is not supported")
    trunk_base = None
    tcfg = getattr(target, "cfg", None)
    if tcfg is not None and getattr(tcfg, "layers", None):
        trunk_base = tcfg.layers[0].rope_base
    cfg = read_config(g, trunk_base)
    if g.get("dflash.trunk.vocab_sha256") is not None:  # written by `tsspec distill --kind block`
        _check_distilled_trunk(g, target)
    # the drafter format, else the trunk's load format as resolved ("auto": every matrix stays in
    # its GGUF blocks on the native kernels; a Linear's backend name "gguf" means the same)
    r = _Reader(g, load_format(fmt or options.weights or getattr(target, "weight_format", None)
                               or getattr(getattr(target, "lm_head", None), "fmt", None)))
    d = cfg.d_model
    fc_shape = r.shape_of("fc.weight")
    if len(fc_shape) != 2 or fc_shape[0] != d:
        raise ModelFileError(f"{name}: fc.weight is {fc_shape}, expected ({d}, len(target_layers) x trunk hidden)")
    own_embed, own_head = g.has_tensor("token_embd.weight"), g.has_tensor("output.weight")
    _check_trunk(g, cfg, target, fc_shape[1], own_embed, own_head)
    cfg.ffn_dim = _ffn_dim(g, cfg)
    layers = _layers(r, cfg)
    vocab = target.vocab_size
    embed = r.dense("token_embd.weight", (vocab, d)) if own_embed else target.embed
    lm_head, d2t = _head(r, d, vocab) if own_head else (target.lm_head, None)
    selector = _selector(r, cfg, vocab)
    # every layer sliding: the ring needs one window of rows; any full-attention layer: everything
    if cfg.sliding_window is not None and all(cfg.swa_layers):
        ring_rows = cfg.sliding_window
    else:
        ring_rows = int(getattr(target, "max_context", 4096))
    model = DFlashModel(
        cfg, layers,
        fc=r.linear("fc.weight", fc_shape),
        enc_norm=r.vec("enc.output_norm.weight", d),
        out_norm=r.vec("output_norm.weight", d),
        embed=embed, lm_head=lm_head, vocab_size=vocab, ring_rows=ring_rows, d2t=d2t,
        selector=selector, path=g.path,
    )
    model.conv_enabled = options.dflash_conv
    model.selector_enabled = options.dflash_selector
    return DFlashDrafter(model, target, path=g.path)


def _ffn_dim(g: GGUFFile, cfg) -> int:
    """The feed-forward width, from the first gate's rows (and the metadata's, which must agree)."""
    if not g.has_tensor("blk.0.ffn_gate.weight"):
        raise ModelFileError(f"{g.path.name}: missing tensor 'blk.0.ffn_gate.weight'")
    f = g.tensor_info("blk.0.ffn_gate.weight").shape[0]
    stated = _meta_int(g, "dflash.feed_forward_length")
    if stated is not None and stated != f:
        raise ModelFileError(f"{g.path.name}: dflash.feed_forward_length {stated} disagrees with "
                             f"blk.0.ffn_gate.weight ({f} rows)")
    return f


def _conv_groups(g: GGUFFile, cfg) -> int:
    """The grouped convolutions' group count: 0 when the file has none, checked when it has."""
    name, d = g.path.name, cfg.d_model
    conv_on = g.has_tensor("blk.0.attn_conv_base")
    stray = [n for n in g.tensor_names() if n.endswith("_conv_base")]
    if stray and not conv_on:
        raise ModelFileError(f"{name}: conv tensors present ({stray[0]}, ...) but blk.0.attn_conv_base is missing")
    if not conv_on:
        return 0
    if cfg.conv_kernel <= 0 or cfg.conv_group <= 0:
        raise ModelFileError(f"{name}: conv tensors present but dflash.conv_kernel_size / "
                             "dflash.conv_group_size are missing or zero")
    if d % cfg.conv_group:
        raise ModelFileError(f"{name}: dflash.conv_group_size {cfg.conv_group} does not divide "
                             f"dflash.embedding_length {d}")
    return d // cfg.conv_group


def _layers(r: _Reader, cfg) -> list[DraftLayer]:
    d, hd, f = cfg.d_model, cfg.head_dim, cfg.ffn_dim
    q_dim, kv_dim = cfg.n_heads * hd, cfg.n_kv_heads * hd
    n_groups = _conv_groups(r.g, cfg)

    def conv(prefix: str) -> GroupedConv | None:
        if not n_groups:
            return None
        base = r.g.tensor(prefix + "_base")
        if base.shape != (2, cfg.conv_kernel, d):
            raise ModelFileError(f"{r.name}: {prefix}_base is {base.shape}, expected (2, {cfg.conv_kernel}, {d})")
        proj = r.linear(prefix + "_proj.weight", (2 * cfg.conv_kernel * n_groups, d))
        return GroupedConv(to_tensor(base, torch.float32), proj, cfg.conv_group)

    layers = []
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        layers.append(DraftLayer(
            attn_norm=r.vec(p + "attn_norm.weight", d),
            q=r.linear(p + "attn_q.weight", (q_dim, d)),
            kv=Linear.concat([(r.mat(p + "attn_k.weight", (kv_dim, d)), None),
                              (r.mat(p + "attn_v.weight", (kv_dim, d)), None)], r.fmt),
            o=r.linear(p + "attn_output.weight", (d, q_dim)),
            q_norm=r.vec(p + "attn_q_norm.weight", hd),
            k_norm=r.vec(p + "attn_k_norm.weight", hd),
            ffn_norm=r.vec(p + "ffn_norm.weight", d),
            gate_up=Linear.concat([(r.mat(p + "ffn_gate.weight", (f, d)), None),
                                   (r.mat(p + "ffn_up.weight", (f, d)), None)], r.fmt),
            down=r.linear(p + "ffn_down.weight", (d, f)),
            attn_conv=conv(p + "attn_conv"),
            ffn_conv=conv(p + "ffn_conv"),
        ))
    return layers


def _head(r: _Reader, d: int, vocab: int) -> tuple[Linear, torch.Tensor | None]:
    """The drafter's own output head, and its ``d2t`` map into the trunk's vocabulary when it
    drafts over fewer rows."""
    head_shape = r.shape_of("output.weight")
    if len(head_shape) != 2 or head_shape[1] != d:
        raise ModelFileError(f"{r.name}: output.weight is {head_shape}, expected (vocab, {d})")
    d2t = None
    if r.g.has_tensor("d2t"):
        d2t = _int_tensor(r.g, "d2t")
        if d2t.numel() != head_shape[0] or int(d2t.min()) < 0 or int(d2t.max()) >= vocab:
            raise ModelFileError(f"{r.name}: d2t must map the {head_shape[0]} draft rows into the "
                                 f"trunk's vocabulary of {vocab}")
    elif head_shape[0] != vocab:
        raise BadInput(f"{r.name}: output.weight has {head_shape[0]} rows and no d2t map, but the "
                       f"trunk's vocabulary is {vocab}")
    return r.linear("output.weight", head_shape), d2t


def _selector(r: _Reader, cfg, vocab: int) -> Selector | None:
    """DFlash2's candidate selector, when the file carries one."""
    g, name = r.g, r.name
    parts = [n for n in ("selector_hidden.weight", "selector_predecessor.weight", "selector_successor.weight")
             if g.has_tensor(n)]
    if parts and not g.has_tensor("selector_hidden.weight"):
        raise ModelFileError(f"{name}: selector tensors present ({parts[0]}) but selector_hidden.weight is missing")
    if not g.has_tensor("selector_hidden.weight"):
        return None
    rank, k = cfg.selector_rank, cfg.selector_top_k
    if rank <= 0 or k <= 0:
        raise ModelFileError(f"{name}: selector tensors present but dflash.selector_rank / "
                             "dflash.selector_top_k are missing or zero")
    if k > vocab:
        raise ModelFileError(f"{name}: dflash.selector_top_k {k} exceeds the vocabulary {vocab}")
    return Selector(
        pred_book=r.dense("selector_predecessor.weight", (vocab, rank)),
        succ_book=r.dense("selector_successor.weight", (vocab, rank)),
        hidden=r.linear("selector_hidden.weight", (rank, cfg.d_model)),
        top_k=k,
    )
