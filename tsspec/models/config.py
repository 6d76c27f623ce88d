"""What a llama-family trunk is, without torch: its configuration (``ArchConfig``) read from the
GGUF metadata, the names of its block tensors (``read_blocks``), its rope tables and its cache's
sizing. The torch model (``base``) and the plain native run (``lean``) both build on these, so an
architecture's facts live once.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..errors import BadInput, ModelFileError
from ..gguf_file import GGUFFile

DEFAULT_CTX = 4096
# Keys are attended in spans rounded up to this many positions, so a row's attention shape is a
# function of its own position only (the same in a 1-row decode and a 9-row verify).
SPAN_BLOCK = 64
# a cache starts this large and doubles as it fills, up to the model's context
INITIAL_CAPACITY = 512


def round_span(n: int) -> int:
    return -(-n // SPAN_BLOCK) * SPAN_BLOCK


def grown_capacity(n: int, capacity: int, max_positions: int) -> int:
    """The capacity a cache of ``capacity`` positions grows to for ``n`` (> capacity) positions:
    at least double, rounded to whole spans, at most the context."""
    return round_span(min(max_positions, max(n, 2 * capacity)))


class CacheRoom:
    """The room rule of a K/V cache, whatever holds its arrays (``cache.KVCache``'s tensors, the lean
    trunk's numpy arrays): ``k`` and ``v`` [layers, n_kv, capacity, head_dim] start at
    ``INITIAL_CAPACITY`` positions (``first_capacity``) and grow by ``grown_capacity`` up to
    ``max_positions``; a subclass says how an array grows (``_grown``: zeros of the new capacity
    that hold the old positions)."""

    max_positions: int

    @staticmethod
    def first_capacity(max_positions: int, capacity: int = INITIAL_CAPACITY) -> int:
        return round_span(min(capacity, max_positions))

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def reserve(self, n: int) -> None:
        """Room for ``n`` positions; growing copies what is held."""
        if n > self.max_positions:
            raise BadInput(f"{n} tokens do not fit the context of {self.max_positions}")
        if n > self.capacity:
            cap = grown_capacity(n, self.capacity, self.max_positions)
            self.k, self.v = self._grown(self.k, cap), self._grown(self.v, cap)

    def _grown(self, a, capacity: int):
        raise NotImplementedError


@dataclass
class LayerSpec:
    rope_base: float
    window: int | None = None  # sliding-window size, None for global attention


@dataclass
class ArchConfig:
    arch: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    train_ctx: int
    rms_eps: float
    rope_dim: int
    rope_neox: bool  # NEOX halves layout; False = GGML's interleaved pairs (llama-arch files)
    layers: list[LayerSpec]
    activation: str = "silu"  # "silu" | "gelu_tanh"
    qk_norm: bool = False
    post_norms: bool = False  # gemma: norms after attention and FFN outputs
    embed_scale: float = 1.0
    attn_scale: float | None = None  # None: 1/sqrt(head_dim)
    final_softcap: float | None = None
    extra: dict = field(default_factory=dict)


def common_config(g: GGUFFile, arch: str) -> dict:
    """Hyper-parameters every llama-like GGUF stores under ``{arch}.*``."""

    def req(key: str):
        return g.require(f"{arch}.{key}")

    n_heads = int(req("attention.head_count"))
    d_model = int(req("embedding_length"))
    kv = g.get(f"{arch}.attention.head_count_kv", n_heads)
    if isinstance(kv, list):  # per-layer lists exist in some files; ours are uniform
        kv = kv[0]
    head_dim = int(g.get(f"{arch}.attention.key_length", d_model // n_heads))
    vocab = g.get(f"{arch}.vocab_size")
    if vocab is None:
        toks = g.get("tokenizer.ggml.tokens")
        if toks is None:
            raise ModelFileError(f"{g.path.name}: no {arch}.vocab_size and no tokenizer.ggml.tokens")
        vocab = len(toks)
    return dict(
        arch=arch,
        n_layers=int(req("block_count")),
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=int(kv),
        head_dim=head_dim,
        ffn_dim=int(req("feed_forward_length")),
        vocab_size=int(vocab),
        train_ctx=int(g.get(f"{arch}.context_length", DEFAULT_CTX)),
        rms_eps=float(g.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_dim=int(g.get(f"{arch}.rope.dimension_count", head_dim)),
    )


def q_scale(cfg: ArchConfig) -> float:
    """The factor queries are scaled by before attention."""
    return cfg.attn_scale if cfg.attn_scale is not None else 1.0 / math.sqrt(cfg.head_dim)


def rope_bases(cfg: ArchConfig) -> list[float]:
    """The rope bases the layers use, in the order the native blocks index their tables."""
    return sorted({spec.rope_base for spec in cfg.layers})


def rope_tables(base: float, rot_dim: int, n_pos: int) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin) float32 [n_pos, rot_dim / 2] of position x frequency, computed in float64 and
    rounded once. numpy's, not torch's, so that a run without torch (``lean``) has the same bits
    (torch's float64 pow and cos differ from numpy's in the last bit of a few entries)."""
    inv_freq = 1.0 / (base ** (np.arange(0, rot_dim, 2, dtype=np.float64) / rot_dim))
    ang = np.arange(n_pos, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


@dataclass
class Block:
    """One llama-family block's weights: products (``weights.Linear``, or ``lean.LeanLinear``) and
    norms (float32 torch tensors, or numpy arrays), as ``read_blocks`` names them in the file."""

    attn_norm: Any
    qkv: Any
    o: Any
    ffn_norm: Any
    gate_up: Any
    down: Any
    q_norm: Any = None
    k_norm: Any = None
    post_attn_norm: Any = None
    post_ffn_norm: Any = None


def read_blocks(g: GGUFFile, cfg: ArchConfig, *, bias: bool, fused: Callable, single: Callable, vec: Callable,
                threads: int) -> list[Block]:
    """Every block's tensors (``blk.N.*``) read as the llama family names them, in layer order:
    ``fused(names, biases)`` makes the stacked products (QKV, gate+up), ``single(name)`` the
    others, ``vec(name)`` a norm. Each block's pages of the file's map are let go once it is read
    (what the makers keep is their own copy), so one copy is held at a time. Layers are read in a
    pool of ``threads`` (numpy and the repack release the GIL)."""

    def opt(name: str) -> np.ndarray | None:
        return g.tensor(name) if g.has_tensor(name) else None

    def block(i: int) -> Block:
        p = f"blk.{i}."
        b = Block(
            attn_norm=vec(p + "attn_norm.weight"),
            qkv=fused([p + f"attn_{x}.weight" for x in "qkv"],
                      [opt(p + f"attn_{x}.bias") if bias else None for x in "qkv"]),
            o=single(p + "attn_output.weight"),
            ffn_norm=vec(p + "ffn_norm.weight"),
            gate_up=fused([p + "ffn_gate.weight", p + "ffn_up.weight"], [None, None]),
            down=single(p + "ffn_down.weight"),
            q_norm=vec(p + "attn_q_norm.weight") if cfg.qk_norm else None,
            k_norm=vec(p + "attn_k_norm.weight") if cfg.qk_norm else None,
            post_attn_norm=vec(p + "post_attention_norm.weight") if cfg.post_norms else None,
            post_ffn_norm=vec(p + "post_ffw_norm.weight") if cfg.post_norms else None,
        )
        g.release_pages([n for n in g.tensor_names() if n.startswith(p)])  # copied: one copy held at a time
        return b

    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        return list(pool.map(block, range(cfg.n_layers)))


def read_embedding(g: GGUFFile, cfg: ArchConfig, head_of: Callable):
    """(the token embedding's weight, the head) where the embedding is kept in the file's blocks:
    ``head_of(GGUFWeight)`` makes the head from the file's ``output.weight``, or from the embedding
    itself when the file has none (tied); then the embedding reads the head's own copy (its first
    part, repacked for the products), so the blocks are held once. A shape that disagrees with the
    metadata is one ``ModelFileError``."""
    from ..gguf_weight import GGUFWeight

    info = g.tensor_info("token_embd.weight")
    if tuple(info.shape) != (cfg.vocab_size, cfg.d_model):
        raise ModelFileError(
            f"{g.path.name}: token_embd is {tuple(info.shape)}, expected ({cfg.vocab_size}, {cfg.d_model})")
    embed_w = GGUFWeight.from_file(*g.tensor_raw("token_embd.weight"), info.shape)
    if g.has_tensor("output.weight"):
        out = g.tensor_info("output.weight")
        return embed_w, head_of(GGUFWeight.from_file(*g.tensor_raw("output.weight"), out.shape))
    head = head_of(embed_w)
    return (head.parts[0] if head.fmt == "gguf" else embed_w), head
