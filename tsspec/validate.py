"""Load-time checks of a GGUF model file, before anything is sized by a number read from it.

Contract: every function here is pure over plain values (metadata dict, tensor records, sizes) and
either returns or raises ``ModelFileError`` with one line naming the file, the key or tensor, what
was expected and what was found. Nothing is allocated in proportion to a count from the file until
that count has been bounded by what the file actually holds.

* ``check_layout``: every tensor's data lies inside the file, in the order written, without
  overlapping the next one or leaving a gap bigger than the alignment (a tensor relabelled with a
  smaller type leaves one), with dimensions whose product does not overflow.
* ``check_hparams``: every hyper-parameter an architecture reads has the right type (an integer
  where a count belongs, a finite float where a float belongs) and a sane range, and the block count
  is bounded by the tensors present.
* ``check_tensors``: every tensor the architecture loads exists with the shape its hyper-parameters
  and the tokenizer's vocabulary imply (``LAYER_TENSORS``, a table per kind of layer) and a type
  the loader can read.

``validate_model(g)`` runs the last two for a ``GGUFFile`` (``GGUFFile`` runs the first on open).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .errors import ModelFileError

# ----------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class TensorRecord:
    """One tensor as its info entry in the file states it (Python ints, nothing wrapped)."""

    name: str
    shape: tuple[int, ...]  # numpy order: (rows, cols) for a matrix
    type_name: str
    offset: int  # relative to the start of the tensor data
    n_bytes: int  # what the type and shape take


def tensor_bytes(dims: Sequence[int], block_size: int, type_size: int) -> int:
    n = math.prod(int(d) for d in dims)
    return n * type_size // block_size


def check_layout(fname: str, tensors: Sequence[TensorRecord], data_start: int, file_size: int,
                 alignment: int, data=None) -> None:
    """Tensor data ranges: inside the file, no overlap, no gap of an alignment or more.

    With ``data`` (the file's bytes, e.g. a memory map) the padding after each tensor must be zeros,
    as every GGUF writer leaves it: a small tensor relabelled with a smaller type leaves its own
    bytes there."""
    if not tensors:
        return
    need = max(data_start + t.offset + t.n_bytes for t in tensors)
    for t in sorted(tensors, key=lambda t: t.offset):  # a cut file: name the tensor the cut falls in
        if any(d < 1 for d in t.shape):
            raise ModelFileError(f"{fname}: tensor {t.name} has shape {t.shape}; every dimension must be >= 1")
        if t.offset % alignment:
            raise ModelFileError(f"{fname}: tensor {t.name} starts at data offset {t.offset}, "
                                 f"not a multiple of the alignment {alignment}")
        end = data_start + t.offset + t.n_bytes
        if end > file_size:
            raise ModelFileError(f"{fname}: tensor {t.name} ({t.type_name} {t.shape}) ends at byte {end}, "
                                 f"past the end of the file ({file_size} bytes; the tensors need {need}): "
                                 f"truncated or a wrong offset")
    ordered = sorted(tensors, key=lambda t: t.offset)
    for a, b in zip(ordered, ordered[1:]):
        end = a.offset + a.n_bytes
        if end > b.offset:
            raise ModelFileError(f"{fname}: tensor {a.name} ({a.type_name} {a.shape}, {a.n_bytes} bytes at data "
                                 f"offset {a.offset}) overlaps tensor {b.name} at offset {b.offset}")
        if b.offset - end >= alignment or not _zeros(data, data_start + end, data_start + b.offset):
            raise ModelFileError(f"{fname}: tensor {a.name} is {a.type_name} {a.shape} ({a.n_bytes} bytes), but "
                                 f"the next tensor starts {b.offset - a.offset} bytes after it: wrong type or shape")
    last = ordered[-1]
    end = data_start + last.offset + last.n_bytes
    if file_size - end >= alignment or not _zeros(data, end, file_size):
        raise ModelFileError(f"{fname}: tensor {last.name} is {last.type_name} {last.shape} ({last.n_bytes} bytes) "
                             f"but {file_size - end} more bytes of data follow it: wrong type or shape")


def _zeros(data, start: int, end: int) -> bool:
    return data is None or start >= end or not any(bytes(data[start:end]))


# ----------------------------------------------------------------------------- hyper-parameters

MAX_DIM = 1 << 24  # no real model has a width, head count or context near this (checked before use)


@dataclass(frozen=True)
class Key:
    """One ``{arch}.<suffix>`` hyper-parameter: its type, default (None: required) and range."""

    suffix: str
    kind: type  # int or float
    default: Any = None
    low: float = 1
    high: float = MAX_DIM
    optional: bool = False  # absent -> not in the result (no default)


LLAMA_KEYS = (
    Key("block_count", int),
    Key("embedding_length", int),
    Key("feed_forward_length", int),
    Key("attention.head_count", int),
    Key("context_length", int, 4096, high=1 << 40),
    Key("attention.layer_norm_rms_epsilon", float, 1e-6, low=1e-30, high=1.0),
    Key("vocab_size", int, optional=True),
)
# per architecture: the keys beyond LLAMA_KEYS, with the defaults tsspec/models/<arch>.py uses
ARCH_KEYS: dict[str, tuple[Key, ...]] = {
    "llama": (Key("rope.freq_base", float, 10000.0, low=1e-6, high=1e30),),
    "qwen2": (Key("rope.freq_base", float, 1000000.0, low=1e-6, high=1e30),),
    "qwen3": (Key("rope.freq_base", float, 1000000.0, low=1e-6, high=1e30),),
    "gemma3": (
        Key("rope.freq_base", float, 1000000.0, low=1e-6, high=1e30),
        Key("attention.sliding_window", int, 512, high=1 << 40),
        Key("attention.sliding_window_pattern", int, 6),
        Key("final_logit_softcapping", float, optional=True, low=0, high=1e30),
    ),
}
HYBRID_KEYS = (
    Key("rope.freq_base", float, 10000000.0, low=1e-6, high=1e30),
    Key("ssm.conv_kernel", int, high=4096),
    Key("ssm.state_size", int),
    Key("ssm.group_count", int),
    Key("ssm.time_step_rank", int),
    Key("ssm.inner_size", int),
    Key("full_attention_interval", int, 4),
    Key("nextn_predict_layers", int, 0, low=0),
)
ARCH_KEYS["qwen35"] = HYBRID_KEYS
ARCH_KEYS["qwen3next"] = HYBRID_KEYS
HYBRID_ARCHS = ("qwen35", "qwen3next")


def typed_value(fname: str, key: str, value: Any, kind: type, low: float, high: float):
    """``value`` as ``kind`` within [low, high], or one error naming the key."""
    if kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        if not ok:
            raise ModelFileError(f"{fname}: metadata {key} should be an integer, found {_show(value)}")
    else:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok:
            raise ModelFileError(f"{fname}: metadata {key} should be a number, found {_show(value)}")
        value = float(value)
        if not math.isfinite(value):
            raise ModelFileError(f"{fname}: metadata {key} should be a finite number, found {value}")
    if not low <= value <= high:
        raise ModelFileError(f"{fname}: metadata {key} should be in [{low:g}, {high:g}], found {value}")
    return value


def _show(value: Any) -> str:
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{type(value).__name__} {text}"


def check_hparams(fname: str, arch: str, meta: Mapping[str, Any], n_tensors: int) -> dict[str, Any]:
    """The architecture's hyper-parameters, typed and range-checked; raises on the first bad one.

    Returns short names (``n_layers``, ``d``, ``q``, ``kv``, ``hd``, ``ffn``, ``vocab`` and, for
    hybrid trunks, the GatedDeltaNet sizes) that ``LAYER_TENSORS`` shapes are written in."""
    keys = LLAMA_KEYS + ARCH_KEYS[arch]
    v: dict[str, Any] = {}
    for k in keys:
        full = f"{arch}.{k.suffix}"
        if full not in meta:
            if k.optional:
                continue
            if k.default is None:
                raise ModelFileError(f"{fname}: missing metadata key {full!r}")
            v[k.suffix] = k.default
            continue
        v[k.suffix] = typed_value(fname, full, meta[full], k.kind, k.low, k.high)

    n_layers = v["block_count"]
    # every layer holds tensors: a count beyond the tensors present is refused before any per-layer list
    if n_layers > n_tensors:
        raise ModelFileError(f"{fname}: metadata {arch}.block_count is {n_layers}, but the file holds only "
                             f"{n_tensors} tensors")
    d, n_heads = v["embedding_length"], v["attention.head_count"]
    kv_key = f"{arch}.attention.head_count_kv"
    kv = meta.get(kv_key, n_heads)
    if isinstance(kv, list):  # per-layer counts: the trunk runs uniform ones
        if len(kv) != n_layers or not kv:
            raise ModelFileError(f"{fname}: metadata {kv_key} lists {len(kv)} counts for {n_layers} layers")
        kvs = {typed_value(fname, kv_key, x, int, 1, MAX_DIM) for x in kv}
        if len(kvs) != 1:
            raise ModelFileError(f"{fname}: metadata {kv_key} differs between layers ({sorted(kvs)}); "
                                 "only uniform KV head counts are supported")
        kv = kvs.pop()
    n_kv = typed_value(fname, kv_key, kv, int, 1, MAX_DIM)
    if n_heads % n_kv:
        raise ModelFileError(f"{fname}: {n_heads} attention heads do not divide into {n_kv} KV heads "
                             f"({arch}.attention.head_count / head_count_kv)")
    hd_key = f"{arch}.attention.key_length"
    if hd_key in meta:
        hd = typed_value(fname, hd_key, meta[hd_key], int, 1, MAX_DIM)
    else:
        hd = d // n_heads
        if hd < 1:
            raise ModelFileError(f"{fname}: embedding_length {d} is smaller than the head count {n_heads} "
                                 f"and there is no {hd_key}")
    rope_key = f"{arch}.rope.dimension_count"
    rope_dim = typed_value(fname, rope_key, meta[rope_key], int, 2, hd) if rope_key in meta else hd
    if rope_dim % 2:
        raise ModelFileError(f"{fname}: metadata {rope_key} should be even (rotary pairs), found {rope_dim}")

    vocab = v.get("vocab_size")
    tokens = meta.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list):
        # more embedding rows than tokens is padding (allowed); fewer leaves token ids without a row
        if vocab is not None and vocab < len(tokens):
            raise ModelFileError(f"{fname}: metadata {arch}.vocab_size is {vocab}, but the tokenizer has "
                                 f"{len(tokens)} tokens")
        vocab = len(tokens) if vocab is None else vocab
    elif tokens is not None:
        raise ModelFileError(f"{fname}: metadata tokenizer.ggml.tokens should be a list of strings, "
                             f"found {_show(tokens)}")
    if vocab is None:
        raise ModelFileError(f"{fname}: no {arch}.vocab_size and no tokenizer.ggml.tokens")
    if vocab < 1:
        raise ModelFileError(f"{fname}: empty vocabulary")

    hp = dict(n_layers=n_layers, d=d, q=n_heads * hd, kv=n_kv * hd, hd=hd, ffn=v["feed_forward_length"],
              vocab=vocab, q2=2 * n_heads * hd)
    if arch in HYBRID_ARCHS:
        hp.update(_hybrid_hparams(fname, arch, meta, v, n_layers))
    return hp


def _hybrid_hparams(fname: str, arch: str, meta: Mapping[str, Any], v: dict, n_layers: int) -> dict:
    n_nextn = v["nextn_predict_layers"]
    n_main = n_layers - n_nextn
    if n_main < 1:
        raise ModelFileError(f"{fname}: metadata {arch}.block_count {n_layers} leaves no layers beside "
                             f"{n_nextn} NextN layers ({arch}.nextn_predict_layers)")
    nk, nv = v["ssm.group_count"], v["ssm.time_step_rank"]
    if nv % nk:
        raise ModelFileError(f"{fname}: {nv} value heads ({arch}.ssm.time_step_rank) do not divide into "
                             f"{nk} key heads ({arch}.ssm.group_count)")
    inner = v["ssm.inner_size"]
    if inner % nv:
        raise ModelFileError(f"{fname}: metadata {arch}.ssm.inner_size {inner} is not a multiple of the "
                             f"{nv} value heads")
    flags_key = f"{arch}.attention.recurrent_layers"
    flags = meta.get(flags_key)
    if flags is not None:
        if not isinstance(flags, list) or not all(isinstance(x, (bool, int)) for x in flags):
            raise ModelFileError(f"{fname}: metadata {flags_key} should be a list of booleans, found {_show(flags)}")
    if isinstance(flags, list) and len(flags) >= n_main:
        recurrent = [bool(x) for x in flags[:n_main]]
    else:
        interval = v["full_attention_interval"]
        recurrent = [(i + 1) % interval != 0 for i in range(n_main)]
    dk, dv = v["ssm.state_size"], inner // nv
    return dict(n_main=n_main, n_nextn=n_nextn, recurrent=recurrent, nk=nk, nv=nv, dk=dk, dv=dv,
                conv_dim=2 * nk * dk + inner, value_dim=inner, conv_k=v["ssm.conv_kernel"],
                ssm_in=nk * (2 * dk + 2 * (nv // nk) * dv), nv2=2 * nv)


# ----------------------------------------------------------------------------- tensors

# Shapes in numpy order, written in the names ``check_hparams`` returns; a trailing "?" marks a
# tensor a file may leave out.
TRUNK_TENSORS = {"token_embd.weight": ("vocab", "d"), "output_norm.weight": ("d",), "output.weight?": ("vocab", "d")}
_ATTN = {"attn_norm.weight": ("d",), "attn_q.weight": ("q", "d"), "attn_k.weight": ("kv", "d"),
         "attn_v.weight": ("kv", "d"), "attn_output.weight": ("d", "q")}
_FFN = {"ffn_gate.weight": ("ffn", "d"), "ffn_up.weight": ("ffn", "d"), "ffn_down.weight": ("d", "ffn")}
_QK_NORM = {"attn_q_norm.weight": ("hd",), "attn_k_norm.weight": ("hd",)}
_GATED_ATTN = {**_ATTN, "attn_q.weight": ("q2", "d"), **_QK_NORM}  # hybrid: query and gate interleaved
_GDN = {"attn_norm.weight": ("d",), "ssm_conv1d.weight": ("conv_dim", "conv_k"), "ssm_a": ("nv",),
        "ssm_dt.bias": ("nv",), "ssm_norm.weight": ("dv",), "ssm_out.weight": ("d", "value_dim")}
_HYBRID_FFN = {"post_attention_norm.weight": ("d",), **_FFN}

LAYER_TENSORS: dict[str, dict[str, tuple]] = {
    "llama": {**_ATTN, "ffn_norm.weight": ("d",), **_FFN},
    "qwen2": {**_ATTN, "attn_q.bias?": ("q",), "attn_k.bias?": ("kv",), "attn_v.bias?": ("kv",),
              "ffn_norm.weight": ("d",), **_FFN},
    "qwen3": {**_ATTN, **_QK_NORM, "ffn_norm.weight": ("d",), **_FFN},
    "gemma3": {**_ATTN, **_QK_NORM, "post_attention_norm.weight": ("d",), "ffn_norm.weight": ("d",), **_FFN,
               "post_ffw_norm.weight": ("d",)},
    "hybrid_attention": {**_GATED_ATTN, **_HYBRID_FFN},
    "qwen35_recurrent": {**_GDN, "attn_qkv.weight": ("conv_dim", "d"), "attn_gate.weight": ("value_dim", "d"),
                         "ssm_beta.weight": ("nv", "d"), "ssm_alpha.weight": ("nv", "d"), **_HYBRID_FFN},
    # qwen3next: split attn_qkv + attn_gate (newer converters) or one fused ssm_in
    "qwen3next_recurrent": {**_GDN, "ssm_ba.weight": ("nv2", "d"), **_HYBRID_FFN},
    "qwen3next_split": {"attn_qkv.weight": ("conv_dim", "d"), "attn_gate.weight": ("value_dim", "d")},
    "qwen3next_fused": {"ssm_in.weight": ("ssm_in", "d")},
    "nextn": {"nextn.eh_proj.weight": ("d", "d2"), "nextn.enorm.weight": ("d",), "nextn.hnorm.weight": ("d",),
              "nextn.shared_head_norm.weight?": ("d",), "nextn.shared_head_head.weight?": ("vocab", "d"),
              "nextn.embed_tokens.weight?": ("vocab", "d")},
}

# the types the loader can turn into weights (gguf-py dequantizes them)
FLOAT_TYPES = {"F32", "F16", "BF16"}


def weight_types() -> frozenset[str]:
    import gguf.quants

    return frozenset(FLOAT_TYPES | {t.name for t in gguf.quants._type_traits})


def expected_tensors(arch: str, hp: Mapping[str, Any], present: set[str]) -> dict[str, tuple]:
    """name -> (shape, optional) of every tensor an ``arch`` trunk with these hyper-parameters loads."""
    out: dict[str, tuple] = {}

    def add(prefix: str, table: Mapping[str, tuple]) -> None:
        for key, dims in table.items():
            optional = key.endswith("?")
            name = prefix + key.rstrip("?")
            out[name] = (tuple(hp[x] for x in dims), optional)

    add("", TRUNK_TENSORS)
    if arch not in HYBRID_ARCHS:
        for i in range(hp["n_layers"]):
            add(f"blk.{i}.", LAYER_TENSORS[arch])
        return out
    for i, recurrent in enumerate(hp["recurrent"]):
        p = f"blk.{i}."
        if not recurrent:
            add(p, LAYER_TENSORS["hybrid_attention"])
        elif arch == "qwen35":
            add(p, LAYER_TENSORS["qwen35_recurrent"])
        else:
            add(p, LAYER_TENSORS["qwen3next_recurrent"])
            add(p, LAYER_TENSORS["qwen3next_split" if p + "attn_qkv.weight" in present else "qwen3next_fused"])
    for j in range(hp["n_nextn"]):
        p = f"blk.{hp['n_main'] + j}."
        if p + "nextn.eh_proj.weight" in present:
            add(p, LAYER_TENSORS["hybrid_attention"])
            add(p, LAYER_TENSORS["nextn"])
    return out


def _same_shape(found: tuple[int, ...], want: tuple[int, ...]) -> bool:
    if len(want) == 1:  # vectors: loaders flatten, so [1, n] is n
        return math.prod(found) == want[0] and sum(d != 1 for d in found) <= 1
    return found == want


def nextn_tensors(layer: int, hp: Mapping[str, Any]) -> dict[str, tuple]:
    """name -> (shape, optional) of a NextN/MTP block at ``blk.{layer}``: a gated-attention block
    and the ``nextn.*`` tensors, shaped by the trunk it binds to (``hp`` as ``check_hparams`` gives)."""
    hp = {**hp, "d2": 2 * hp["d"]}
    out = {}
    for table in (LAYER_TENSORS["hybrid_attention"], LAYER_TENSORS["nextn"]):
        for key, dims in table.items():
            out[f"blk.{layer}." + key.rstrip("?")] = (tuple(hp[x] for x in dims), key.endswith("?"))
    return out


def check_tensors(fname: str, arch: str, hp: Mapping[str, Any], tensors: Mapping[str, TensorRecord],
                  expected: Mapping[str, tuple] | None = None) -> None:
    """Every tensor the trunk loads (or ``expected``: name -> (shape, optional)): present, of the
    implied shape, of a type the loader reads."""
    hp = {**hp, "d2": 2 * hp["d"]}
    readable = weight_types()
    if expected is None:
        expected = expected_tensors(arch, hp, set(tensors))
    for name, (want, optional) in expected.items():
        t = tensors.get(name)
        if t is None:
            if optional:
                continue
            raise ModelFileError(f"{fname}: missing tensor {name!r}")
        if not _same_shape(t.shape, want):
            raise ModelFileError(f"{fname}: tensor {name} is {t.shape}, expected {want} from the metadata "
                                 f"({_describe(hp)})")
        if t.type_name not in readable:
            raise ModelFileError(f"{fname}: tensor {name} has type {t.type_name}, which is not a weight type "
                                 f"(expected a float or quantized type)")


def _describe(hp: Mapping[str, Any]) -> str:
    return (f"vocab {hp['vocab']}, d_model {hp['d']}, ffn {hp['ffn']}, q {hp['q']}, kv {hp['kv']}, "
            f"head dim {hp['hd']}")


# ----------------------------------------------------------------------------- entry


def records(reader) -> list[TensorRecord]:
    """``TensorRecord``s of a gguf-py reader's tensor infos, from the raw fields (Python ints, so a
    dimension product or an offset past 2^64 is seen as such, not wrapped)."""
    return field_records([t.field for t in reader.tensors])


def field_records(fields) -> list[TensorRecord]:
    """``TensorRecord``s of raw tensor-info fields (name, dims, type code, offset), as the header
    stores them: also where gguf-py could not make the tensors themselves."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    out = []
    for field in fields:
        parts = field.parts
        dims = [int(x) for x in parts[3]]
        offset = int(parts[5][0])
        qtype = GGMLQuantizationType(int(parts[4][0]))
        block, size = GGML_QUANT_SIZES[qtype]
        out.append(TensorRecord(str(bytes(parts[1]), encoding="utf-8"), tuple(reversed(dims)), qtype.name, offset,
                                tensor_bytes(dims, block, size)))
    return out


def validate_model(g) -> dict[str, Any]:
    """Hyper-parameters and tensors of a language-model ``GGUFFile``; returns the checked
    hyper-parameters (see ``check_hparams``)."""
    from .models import ARCHITECTURES

    arch = g.arch
    if arch not in ARCHITECTURES:
        return {}
    hp = check_hparams(g.path.name, arch, g.metadata, len(g.records))
    check_tensors(g.path.name, arch, hp, {t.name: t for t in g.records})
    return hp
