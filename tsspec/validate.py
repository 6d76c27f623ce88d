"""Load-time checks of a GGUF model file, before anything is sized by a number read from it.

Contract: every function here is pure over plain values (metadata dict, tensor records, sizes, an
architecture's tables) and either returns or raises ``ModelFileError`` with one line naming the
file, the key or tensor, what was expected and what was found. Nothing is allocated in proportion
to a count from the file until that count has been bounded by what the file actually holds.

This module knows no architecture. Each one's file in ``tsspec/models`` declares its facts as an
``ArchTables`` (its ``{arch}.*`` keys with the defaults its loader uses, the tensor table of each
of its blocks, any sizes it derives) and the checks below run over whatever tables they are given.

* ``check_layout``: every tensor's data lies inside the file, in the order written, without
  overlapping the next one or leaving a gap bigger than the alignment (a tensor relabelled with a
  smaller type leaves one), with dimensions whose product does not overflow.
* ``check_hparams``: every hyper-parameter an architecture reads (``TRUNK_KEYS`` and its own) has
  the right type (an integer where a count belongs, a finite float where a float belongs) and a
  sane range, and the block count is bounded by the tensors present.
* ``check_tensors``: every tensor expected (``expected_tensors``: ``TRUNK_TENSORS`` and the
  architecture's block tables, written in the names ``check_hparams`` returns) exists with the
  shape its hyper-parameters and the tokenizer's vocabulary imply and a type the loader can read.

``check_model`` runs the last two (``tsspec.models.validate_model`` gives it a file's tables;
``GGUFFile`` runs the first on open).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

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

    def read(self, g, arch: str) -> Any:
        """The value a loader uses: the file's (``g.get``, as ``GGUFFile`` has it), else the default
        checked here, so the two cannot drift apart."""
        return g.get(f"{arch}.{self.suffix}", self.default)


def rope_base(default: float) -> Key:
    """``rope.freq_base`` with an architecture's default: any positive finite base."""
    return Key("rope.freq_base", float, default, low=1e-6, high=1e30)


# what every trunk reads, whatever its architecture
TRUNK_KEYS = (
    Key("block_count", int),
    Key("embedding_length", int),
    Key("feed_forward_length", int),
    Key("attention.head_count", int),
    Key("context_length", int, 4096, high=1 << 40),
    Key("attention.layer_norm_rms_epsilon", float, 1e-6, low=1e-30, high=1.0),
    Key("vocab_size", int, optional=True),
)

# name -> shape in numpy order, in the names ``check_hparams`` returns; a trailing "?" on the name
# marks a tensor a file may leave out
Table = Mapping[str, tuple]
# (checked hyper-parameters, names of the tensors present) -> (name prefix, table) of each block
Blocks = Callable[[Mapping[str, Any], set[str]], Iterable[tuple[str, Table]]]
# (file name, arch, metadata, typed key values, block count) -> more named sizes
Derive = Callable[[str, str, Mapping[str, Any], dict, int], dict]


@dataclass(frozen=True)
class ArchTables:
    """All ``validate`` knows of one architecture, declared by its file in ``tsspec/models``."""

    arch: str  # the GGUF ``general.architecture``: its keys are ``{arch}.*``
    keys: tuple[Key, ...]  # beyond TRUNK_KEYS, with the defaults its loader reads (``Key.read``)
    blocks: Blocks  # the tensor table of each block it loads
    derive: Derive | None = None  # sizes beyond the common ones its tables are written in


def every_block(table: Table) -> Blocks:
    """``Blocks`` of a trunk whose ``n_layers`` blocks all hold ``table``."""
    def blocks(hp: Mapping[str, Any], present: set[str]) -> Iterable[tuple[str, Table]]:
        return [(f"blk.{i}.", table) for i in range(hp["n_layers"])]
    return blocks


def typed_value(fname: str, key: str, value: Any, kind: type, low: float, high: float):
    """``value`` as ``kind`` within [low, high], or one error naming the key."""
    if kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        if not ok:
            raise ModelFileError(f"{fname}: metadata {key} should be an integer, found {show_value(value)}")
    else:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok:
            raise ModelFileError(f"{fname}: metadata {key} should be a number, found {show_value(value)}")
        value = float(value)
        if not math.isfinite(value):
            raise ModelFileError(f"{fname}: metadata {key} should be a finite number, found {value}")
    if not low <= value <= high:
        raise ModelFileError(f"{fname}: metadata {key} should be in [{low:g}, {high:g}], found {value}")
    return value


def show_value(value: Any) -> str:
    """A metadata value as an error line quotes it: its type and at most 40 characters."""
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{type(value).__name__} {text}"


def check_hparams(fname: str, tables: ArchTables, meta: Mapping[str, Any], n_tensors: int) -> dict[str, Any]:
    """The architecture's hyper-parameters, typed and range-checked; raises on the first bad one.

    Returns short names (``n_layers``, ``d``, ``q``, ``kv``, ``hd``, ``ffn``, ``vocab`` and what
    ``tables.derive`` adds, e.g. a hybrid trunk's GatedDeltaNet sizes) that the tables' shapes are
    written in."""
    arch = tables.arch
    v = typed_keys(fname, arch, TRUNK_KEYS + tables.keys, meta)
    n_layers = v["block_count"]
    # every layer holds tensors: a count beyond the tensors present is refused before any per-layer list
    if n_layers > n_tensors:
        raise ModelFileError(f"{fname}: metadata {arch}.block_count is {n_layers}, but the file holds only "
                             f"{n_tensors} tensors")
    n_heads = v["attention.head_count"]
    n_kv, hd = _heads(fname, arch, meta, v["embedding_length"], n_heads, n_layers)
    hp = dict(n_layers=n_layers, d=v["embedding_length"], q=n_heads * hd, kv=n_kv * hd, hd=hd,
              ffn=v["feed_forward_length"], vocab=_vocab(fname, arch, meta, v.get("vocab_size")),
              q2=2 * n_heads * hd)
    if tables.derive is not None:
        hp.update(tables.derive(fname, arch, meta, v, n_layers))
    return hp


def typed_keys(fname: str, arch: str, keys: Sequence[Key], meta: Mapping[str, Any]) -> dict[str, Any]:
    """suffix -> value of each key: the file's, typed and ranged, else its default; a required key
    that is missing is one error."""
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
    return v


def _heads(fname: str, arch: str, meta: Mapping[str, Any], d: int, n_heads: int, n_layers: int) -> tuple[int, int]:
    """(KV heads, head dim): uniform per-layer KV counts, dividing the heads; an even rope width."""
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
    return n_kv, hd


def _vocab(fname: str, arch: str, meta: Mapping[str, Any], vocab: int | None) -> int:
    """The embedding rows: ``{arch}.vocab_size``, at least the tokenizer's tokens, else their count."""
    tokens = meta.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list):
        # more embedding rows than tokens is padding (allowed); fewer leaves token ids without a row
        if vocab is not None and vocab < len(tokens):
            raise ModelFileError(f"{fname}: metadata {arch}.vocab_size is {vocab}, but the tokenizer has "
                                 f"{len(tokens)} tokens")
        vocab = len(tokens) if vocab is None else vocab
    elif tokens is not None:
        raise ModelFileError(f"{fname}: metadata tokenizer.ggml.tokens should be a list of strings, "
                             f"found {show_value(tokens)}")
    if vocab is None:
        raise ModelFileError(f"{fname}: no {arch}.vocab_size and no tokenizer.ggml.tokens")
    if vocab < 1:
        raise ModelFileError(f"{fname}: empty vocabulary")
    return vocab


# ----------------------------------------------------------------------------- tensors

# what every trunk loads besides its blocks
TRUNK_TENSORS = {"token_embd.weight": ("vocab", "d"), "output_norm.weight": ("d",), "output.weight?": ("vocab", "d")}

# the types the loader can turn into weights (gguf-py dequantizes them)
FLOAT_TYPES = {"F32", "F16", "BF16"}


def weight_types() -> frozenset[str]:
    import gguf.quants

    return frozenset(FLOAT_TYPES | {t.name for t in gguf.quants._type_traits})


def table_tensors(prefix: str, table: Table, hp: Mapping[str, Any]) -> dict[str, tuple]:
    """name -> (shape, optional) of ``table``'s tensors under ``prefix``, shaped by ``hp``."""
    return {prefix + key.rstrip("?"): (tuple(hp[x] for x in dims), key.endswith("?")) for key, dims in table.items()}


def expected_tensors(tables: ArchTables, hp: Mapping[str, Any], present: set[str]) -> dict[str, tuple]:
    """name -> (shape, optional) of every tensor a trunk of ``tables`` with these hyper-parameters
    loads (``present``: the names the file holds, where a block's layout depends on them)."""
    out = table_tensors("", TRUNK_TENSORS, hp)
    for prefix, table in tables.blocks(hp, present):
        out.update(table_tensors(prefix, table, hp))
    return out


def _same_shape(found: tuple[int, ...], want: tuple[int, ...]) -> bool:
    if len(want) == 1:  # vectors: loaders flatten, so [1, n] is n
        return math.prod(found) == want[0] and sum(d != 1 for d in found) <= 1
    return found == want


def check_tensors(fname: str, hp: Mapping[str, Any], tensors: Mapping[str, TensorRecord],
                  expected: Mapping[str, tuple]) -> None:
    """Every tensor ``expected`` (name -> (shape, optional), see ``expected_tensors``): present, of
    the implied shape, of a type the loader reads."""
    readable = weight_types()
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


def check_model(fname: str, tables: ArchTables, meta: Mapping[str, Any],
                records: Sequence[TensorRecord]) -> dict[str, Any]:
    """Hyper-parameters and tensors of a language-model file of the architecture ``tables``
    describe; returns the checked hyper-parameters (see ``check_hparams``)."""
    hp = check_hparams(fname, tables, meta, len(records))
    by_name = {t.name: t for t in records}
    check_tensors(fname, hp, by_name, expected_tensors(tables, hp, set(by_name)))
    return hp
