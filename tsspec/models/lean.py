"""A plain greedy run on the native kernels without torch: the scripted one-prompt case's target.

A scripted user runs one process per prompt, so what a process does before its first token is paid
on every call, and ``import torch`` alone is about a second of it (issue 51). A llama-family trunk
whose every weight is on the native kernels computes nothing in torch: the torch model's
``NativeRunner`` is three C calls (the embedding rows ``tsq_dequant_rows``, every block
``tsq_forward``, the norm and head ``tsq_output``) on arrays it merely holds as tensors. ``LeanTrunk``
makes those same calls on numpy arrays: its weights are read and repacked as ``weights.Linear``
does (``gguf_weight``), its block structures built by the same builder (``native.fused_blocks``),
its tensor names read by the same reader (``config.read_blocks``), so a row's logits are the torch
model's bit for bit (``tests/test_lean.py`` holds them equal on every architecture it takes).

What it serves is plain decoding with greedy draws and no penalties (``spec.plain.LeanDecode``,
driven by the same ``spec.run.Run``); ``declines`` says why a file or run is not for it, and the run
then loads the torch model as before. Speculation, sampling at a temperature, taps, trees and
batches of sequences stay the torch model's.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import BadInput
from ..gguf_file import GGUFFile
from ..gguf_weight import GGUFWeight, gguf_native, stack_biases, stack_parts
from .config import DEFAULT_CTX, ArchConfig, CacheRoom, q_scale, read_blocks, read_embedding, rope_bases, rope_tables, \
    round_span

class Declined(Exception):
    """Why a trunk is not for the lean path (the torch model then loads it); not a user error."""


def declines(config, params) -> str | None:
    """Why a run with ``config`` (``settings.RunConfig``) and ``params`` (``SamplingParams``) is not
    for the lean path before its file is read, or None: it must decode plainly (speculation off),
    greedily without penalties, on the CPU with the file's own blocks (weights auto)."""
    from .. import kernels

    if config.spec.enabled:
        return "speculation is on"
    if not params.greedy or params.has_penalties:
        return "sampling at a temperature or with penalties"
    if config.device != "cpu" or config.weights != "auto":
        return f"device {config.device}, weights {config.weights}"
    if not kernels.available():
        return f"native kernels unavailable ({kernels.unavailable_reason()})"
    return None


class LeanLinear:
    """A product over GGUF parts stacked along N, as ``kernels.c_linear`` reads it: what
    ``weights.Linear`` keeps on its gguf backend (the parts repacked for the products, a bias as a
    float32 copy), without torch."""

    fmt = "gguf"

    def __init__(self, parts: list[GGUFWeight], bias=None):
        if not all(gguf_native(p.type_name, p.shape) for p in parts):
            kinds = ", ".join(sorted({p.type_name for p in parts}))
            raise Declined(f"a {kinds} weight the native kernels do not take")
        self.parts = [p.for_products() for p in parts]
        self.in_features = parts[0].shape[1]
        self.out_features = sum(p.shape[0] for p in parts)
        self.bias = None if bias is None else np.array(bias, dtype=np.float32, copy=True)


class LeanCache(CacheRoom):
    """``cache.KVCache`` in numpy: K/V [layers, n_kv, capacity, head_dim] float32, sized and grown
    by the same rule (``config.CacheRoom``)."""

    def __init__(self, n_layers: int, n_kv: int, head_dim: int, max_positions: int):
        self.max_positions = max_positions
        self.k = np.zeros((n_layers, n_kv, self.first_capacity(max_positions), head_dim), dtype=np.float32)
        self.v = np.zeros_like(self.k)
        self.length = 0

    def _grown(self, a: np.ndarray, capacity: int) -> np.ndarray:
        new = np.zeros((a.shape[0], a.shape[1], capacity, a.shape[3]), dtype=np.float32)
        new[:, :, : a.shape[2]] = a
        return new

    def reset(self) -> None:
        self.length = 0


class LeanTrunk:
    """A llama-family trunk's native forward over numpy arrays (see the module docstring)."""

    lean = True  # what ``generate.Engine`` decodes with ``spec.plain.LeanDecode`` when it runs plainly

    def __init__(self, g: GGUFFile, cfg: ArchConfig, n_ctx: int | None, threads: int, *, qkv_bias: bool = False):
        from .native import fused_blocks

        why = self.declines(g, cfg)
        if why is not None:
            raise Declined(why)
        self.cfg, self.path = cfg, g.path
        self.vocab_size = cfg.vocab_size
        self.max_context = min(n_ctx or DEFAULT_CTX, cfg.train_ctx)
        blocks = read_blocks(g, cfg, bias=qkv_bias, fused=self._fused(g), single=self._single(g),
                             vec=lambda name: np.array(g.tensor(name), dtype=np.float32, copy=True), threads=threads)
        # the embedding's blocks as ``base.load_embedding`` holds them (a tied head's copy is its own)
        self.embed, head = read_embedding(g, cfg, lambda w: LeanLinear([w]))
        g.release_pages([n for n in ("token_embd.weight", "output.weight") if g.has_tensor(n)])
        out_norm = np.array(g.tensor("output_norm.weight"), dtype=np.float32, copy=True)
        bases = rope_bases(cfg)
        tables = [rope_tables(b, cfg.rope_dim, round_span(self.max_context)) for b in bases]
        self.cos, self.sin = [t[0] for t in tables], [t[1] for t in tables]
        self.fused = fused_blocks(cfg, blocks, bases, q_scale(cfg), head, out_norm)
        if self.fused is None or self.fused.output is None:
            raise Declined("its blocks are not the native fused block")

    @staticmethod
    def declines(g: GGUFFile, cfg: ArchConfig) -> str | None:
        """Why this file's trunk is not for the lean path, found before anything is loaded: soft-capped
        logits, steps the C block does not take, or a matrix (any 2-d tensor: the products, the
        embedding, the head) of a type the native kernels do not multiply."""
        if cfg.final_softcap:
            return "its logits are soft-capped"
        if cfg.activation not in ("silu", "gelu_tanh") or cfg.rope_dim % 2 or cfg.rope_dim > cfg.head_dim:
            return "its steps are not the native fused block's"
        for name in g.tensor_names():
            info = g.tensor_info(name)
            if len(info.shape) == 2 and not gguf_native(info.type_name, tuple(info.shape)):
                return f"{name} is {info.type_name}, which the native kernels do not multiply"
        return None

    @staticmethod
    def _fused(g: GGUFFile):
        def fused(names: list[str], biases: list) -> LeanLinear:
            ws = [GGUFWeight.from_file(*g.tensor_raw(n), g.tensor_info(n).shape) for n in names]
            return LeanLinear(stack_parts(ws), stack_biases(biases, [w.shape[0] for w in ws]))
        return fused

    @staticmethod
    def _single(g: GGUFFile):
        def single(name: str) -> LeanLinear:
            return LeanLinear([GGUFWeight.from_file(*g.tensor_raw(name), g.tensor_info(name).shape)])
        return single

    def make_cache(self) -> LeanCache:
        cfg = self.cfg
        return LeanCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, self.max_context)

    def forward(self, tokens: Sequence[int], cache: LeanCache, *, prompt: bool = False) -> np.ndarray:
        """``tokens`` appended to ``cache``; -> the last row's logits [vocab] (float32). ``prompt``:
        they are prompt tokens (``ForwardItem.prompt``)."""
        from .. import kernels

        if len(tokens) == 0:
            raise ValueError("forward needs at least one token")
        if min(tokens) < 0 or max(tokens) >= self.vocab_size:
            raise BadInput(f"token id out of range for a vocabulary of {self.vocab_size}")
        start = cache.length
        cache.reserve(start + len(tokens))
        h = kernels.dequant_rows_np(self.embed.type_name, self.embed.raw, self.cfg.d_model, list(tokens),
                                    packed=self.embed.packed)
        if self.cfg.embed_scale != 1.0:
            h = h * self.cfg.embed_scale  # float32 times a Python float: float32, as torch's product
        self.fused.run(h, 0, self.cfg.n_layers, start, cache.k, cache.v, self.cos, self.sin, prompt=prompt)
        cache.length = start + len(tokens)
        return self.fused.output(h[-1:])[0]


def load(g: GGUFFile, n_ctx: int | None, threads: int) -> LeanTrunk:
    """The lean trunk of ``g`` (its architecture's config and facts from its own module, which says
    ``LEAN`` where its trunk is the llama block), or ``Declined`` with the reason."""
    from . import arch_module

    mod = arch_module(g.arch, g.path.name)
    if not getattr(mod, "LEAN", False):
        raise Declined(f"{g.arch} trunks are not the llama block")
    return LeanTrunk(g, mod.config(g), n_ctx, threads, qkv_bias=getattr(mod, "QKV_BIAS", False))
