"""A seeded corpus of damaged GGUF files, made from the tiny files the other tests write.

``corpus(bases, n, seed)`` picks ``n`` ``Case``s (pure data: which base file, what damage, and
whether the result must be refused); ``materialize(case, base, dst)`` writes the damaged copy.
Damage kinds:

* ``meta``: a hyper-parameter or tokenizer value replaced, in place (same GGUF type: 0, -1, huge,
  NaN, inf) or re-written with another type (a string, an array, a bool, a float where an integer
  belongs); ``drop_key``: a required key left out;
* ``tensor``: a tensor info's dimensions (transposed, halved, doubled, huge), type (relabelled),
  data offset (wrapping past 2^64, overlapping, misaligned) or name changed in place;
  ``drop_tensor``: a required tensor left out;
* ``header``: version, tensor count or key/value count changed; ``truncate``: the file cut short;
* ``flip``: random bytes changed anywhere (these may or may not stay valid: only "no traceback,
  no hang" is asserted of them).

``invalid`` is True where the file must be refused, None where either outcome is acceptable.
"""

from __future__ import annotations

import dataclasses
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tiny import rewrite_metadata

HUGE = (1 << 32) - 1

# hyper-parameter keys (suffix after "{arch}.") whose damaged values are all invalid
COUNT_KEYS = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count",
              "attention.head_count_kv", "attention.key_length", "rope.dimension_count", "vocab_size",
              "attention.sliding_window_pattern", "ssm.conv_kernel", "ssm.state_size", "ssm.group_count",
              "ssm.time_step_rank", "ssm.inner_size",
              # dflash drafters
              "block_size", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
FLOAT_KEYS = ("attention.layer_norm_rms_epsilon", "rope.freq_base")
# keys where a huge value is legitimate (only the other damages are invalid)
HUGE_OK = ("context_length", "attention.sliding_window")
REQUIRED = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")
# keys where 0 means "off" for that architecture
ZERO_OK = {"dflash": ("attention.sliding_window",)}
REQUIRED_BY_ARCH = {"dflash": ("block_count", "embedding_length", "attention.head_count", "block_size")}


# chat templates a file may carry (cases that hit the time budget would cost seconds each; the
# budget's own tests cover those)
HOSTILE_TEMPLATES = (
    "{{ 'x' * 10 ** 9 }}",
    "{% for m in messages %}{{ m.content | center(10 ** 10) }}{% endfor %}",
    "{% for i in range(100000) %}{{ 'y' * 100 }}{% endfor %}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.append(1) }}",
    "{% for m in messages %}",
    "{{ raise_exception('no') }}",
    "{{ messages[7].content }}",
    "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    "{{ 10 ** (10 ** 10) }}",
)


@dataclass(frozen=True)
class Case:
    base: str  # name of the base file
    kind: str  # meta | drop_key | tensor | drop_tensor | header | truncate | flip
    target: str  # key, tensor name, header field or ""
    change: Any  # what is done (see materialize)
    invalid: bool | None

    @property
    def id(self) -> str:
        text = f"{self.base}:{self.kind}:{self.target}={self.change!r}"
        return text if len(text) < 120 else text[:117] + "..."


@dataclass(frozen=True)
class BaseInfo:
    """What the generator needs to know of a base file."""

    name: str
    arch: str
    keys: dict  # key -> GGUF value type name of the scalar (or ARRAY)
    tensors: list  # (name, numpy shape, type name, required?)
    size: int
    min_valid_size: int  # data start + end of the last tensor
    rewritable: bool  # all-F32, so tiny.rewrite_metadata can re-write it
    drafter: bool = False  # attached to a trunk: only its token list and special ids are read
    meta_read: bool = True  # False: a NextN head file, bound by its tensors alone (metadata unread)


def describe(name: str, path: Path, optional_tensors=(), drafter: bool = False, meta_read: bool = True) -> BaseInfo:
    import gguf

    r = gguf.GGUFReader(str(path))
    arch = r.fields["general.architecture"].contents()
    keys = {k: f.types[0].name for k, f in r.fields.items() if not k.startswith("GGUF.")}
    tensors = [(t.name, tuple(int(x) for x in reversed(t.shape.tolist())), t.tensor_type.name,
                t.name not in optional_tensors) for t in r.tensors]
    end = max(int(t.data_offset) + int(t.n_bytes) for t in r.tensors)
    return BaseInfo(name, arch, keys, tensors, path.stat().st_size, end,
                    all(t.tensor_type.name == "F32" for t in r.tensors), drafter, meta_read)


# ----------------------------------------------------------------------------- choosing cases


def _meta_cases(b: BaseInfo, rng: random.Random) -> list[Case]:
    out = []
    arch = b.arch
    for suffix in COUNT_KEYS + FLOAT_KEYS + HUGE_OK:
        key = f"{arch}.{suffix}"
        if key not in b.keys:
            continue
        t = b.keys[key]
        huge_ok = suffix in HUGE_OK
        if t.startswith("FLOAT"):
            for v in (0.0, -1.0, float("nan"), float("inf"), float("-inf")):
                out.append(Case(b.name, "meta", key, ("same", v), not huge_ok))
        elif t.startswith("UINT") or t.startswith("INT"):
            out.append(Case(b.name, "meta", key, ("same", 0), None if suffix in ZERO_OK.get(arch, ()) else True))
            out.append(Case(b.name, "meta", key, ("same", HUGE), None if huge_ok else True))
        if b.rewritable:
            for v, vt in (("four", "STRING"), ([1, 2], "ARRAY"), (True, "BOOL"), (-4, "INT32"), (2.5, "FLOAT32")):
                # a positive number of another numeric type is still a valid float
                ok_anyway = suffix in FLOAT_KEYS and vt == "FLOAT32"
                out.append(Case(b.name, "meta", key, ("retype", v, vt), None if ok_anyway else True))
    if f"{arch}.mask_token_id" in b.keys:  # 0 is a token like any other; past the vocabulary is not
        out.append(Case(b.name, "meta", f"{arch}.mask_token_id", ("same", HUGE), True))
    if b.rewritable and f"{arch}.target_layers" in b.keys:
        for v in (["a"], [99], [-1], [1, 1]):  # (gguf cannot write an empty array)
            out.append(Case(b.name, "meta", f"{arch}.target_layers", ("retype", v, "ARRAY"), None if v == [1, 1] else True))
    if b.rewritable:
        for suffix in REQUIRED_BY_ARCH.get(arch, REQUIRED):
            out.append(Case(b.name, "drop_key", f"{arch}.{suffix}", None, True))
        out.append(Case(b.name, "meta", "general.architecture", ("retype", "mamba9", "STRING"), True))
        out.append(Case(b.name, "meta", "general.architecture", ("retype", 7, "UINT32"), True))
        if "tokenizer.ggml.tokens" in b.keys:
            # fewer tokens than embedding rows is padding where {arch}.vocab_size states the rows
            padded = f"{arch}.vocab_size" in b.keys
            out.append(Case(b.name, "meta", "tokenizer.ggml.tokens", ("shorten", 1), None if padded else True))
            out.append(Case(b.name, "meta", "tokenizer.ggml.tokens", ("retype", [1, 2, 3], "ARRAY"), True))
            out.append(Case(b.name, "meta", "tokenizer.ggml.tokens", ("retype", "abc", "STRING"), True))
            # a drafter's own merges and token types are never read (the trunk's tokenizer splits text)
            unread = None if b.drafter else True
            out.append(Case(b.name, "meta", "tokenizer.ggml.token_type", ("shorten", 3), unread))
            out.append(Case(b.name, "meta", "tokenizer.ggml.merges", ("retype", ["nospace"], "ARRAY"), unread))
            out.append(Case(b.name, "meta", "tokenizer.ggml.merges", ("retype", 5, "UINT32"), unread))
            out.append(Case(b.name, "meta", "tokenizer.ggml.model", ("retype", "bert", "STRING"), True))
            out.append(Case(b.name, "meta", "tokenizer.ggml.eos_token_id", ("retype", 10**6, "UINT32"), True))
            out.append(Case(b.name, "meta", "tokenizer.ggml.eos_token_id", ("retype", "x", "STRING"), True))
            out.append(Case(b.name, "meta", "tokenizer.chat_template", ("retype", 3, "UINT32"), None))
            if not b.drafter:  # run with --chat: a template that cannot render a prompt is refused
                for template in HOSTILE_TEMPLATES:
                    out.append(Case(b.name, "meta", "tokenizer.chat_template", ("retype", template, "STRING"), True))
            out.append(Case(b.name, "drop_key", "tokenizer.ggml.model", None, True))
    return out


def _tensor_cases(b: BaseInfo, rng: random.Random) -> list[Case]:
    out = []
    for i, (name, shape, tname, required) in enumerate(b.tensors):
        if len(shape) == 2 and shape[0] != shape[1]:
            out.append(Case(b.name, "tensor", name, ("dims", tuple(reversed(shape))), True))
        out.append(Case(b.name, "tensor", name, ("dims", (shape[0] * 2,) + shape[1:]), True))
        out.append(Case(b.name, "tensor", name, ("dims", (1 << 40,) + shape[1:]), True))
        out.append(Case(b.name, "tensor", name, ("dims", (0,) + shape[1:]), True))
        if shape[0] % 2 == 0:
            out.append(Case(b.name, "tensor", name, ("dims", (shape[0] // 2,) + shape[1:]), True))
        for new in ("F16", "BF16", "Q8_0", "Q4_0", "I8", "I32", "F64", "Q4_K", 99):
            if new != tname:
                out.append(Case(b.name, "tensor", name, ("type", new), True))
        out.append(Case(b.name, "tensor", name, ("offset", (1 << 64) - 32), True))
        out.append(Case(b.name, "tensor", name, ("offset", 1 << 62), True))
        out.append(Case(b.name, "tensor", name, ("offset_add", 1), True))
        out.append(Case(b.name, "tensor", name, ("offset_add", 32), True))
        if i > 0:
            out.append(Case(b.name, "tensor", name, ("offset_of", b.tensors[i - 1][0]), True))
        out.append(Case(b.name, "tensor", name, ("rename", None), True if required else None))
        if b.rewritable and required:
            out.append(Case(b.name, "drop_tensor", name, None, True))
    return out


def _file_cases(b: BaseInfo, rng: random.Random) -> list[Case]:
    out = [Case(b.name, "header", "version", v, True) for v in (0, 1, 4, 99, 0x00030000)]
    out += [Case(b.name, "header", f, v, True) for f in ("n_tensors", "n_kv") for v in (0, "+1", "-1", 1 << 62)]
    for _ in range(12):
        cut = rng.randrange(0, b.size)
        out.append(Case(b.name, "truncate", "", cut, True if cut < b.min_valid_size else None))
    for _ in range(40):
        n = rng.randint(1, 4)
        # most flips in the header and metadata, where a byte changes meaning
        hi = b.size if rng.random() < 0.2 else min(b.size, 4096)
        flips = tuple((rng.randrange(0, hi), rng.randrange(0, 256)) for _ in range(n))
        out.append(Case(b.name, "flip", "", flips, None))
    return out


def corpus(bases: list[BaseInfo], n: int, seed: int) -> list[Case]:
    """``n`` cases drawn evenly over the bases (seeded: the same arguments give the same list)."""
    rng = random.Random(seed)
    pools = []  # per base: metadata, tensor-info and whole-file damage, drawn in turn
    for b in bases:
        for make in (_meta_cases, _tensor_cases, _file_cases):
            cases = make(b, rng)
            if make is _meta_cases and not b.meta_read:  # damage nothing reads: it need only not crash
                cases = [dataclasses.replace(c, invalid=None) for c in cases]
            rng.shuffle(cases)
            pools.append(cases)
    out: list[Case] = []
    i = 0
    while len(out) < n and any(pools):
        cases = pools[i % len(pools)]
        if cases:
            out.append(cases.pop())
        i += 1
    return out


# ----------------------------------------------------------------------------- writing cases


def _patch(path: Path, fn) -> None:
    """Run ``fn(reader)`` on a writable memory map of ``path`` (changes land in the file)."""
    import gguf

    r = gguf.GGUFReader(str(path), "r+")
    try:
        fn(r)
        r.data.flush()
    finally:
        del r


def _retype(kv: dict, key: str, value: Any, vtype: str) -> None:
    import gguf

    T = gguf.GGUFValueType
    if vtype == "ARRAY":
        sub = T.STRING if value and isinstance(value[0], str) else T.INT32
        kv[key] = (value, T.ARRAY, sub)
    else:
        kv[key] = (value, T[vtype], T[vtype])


def materialize(case: Case, base: Path, dst: Path) -> Path:
    """Write ``case``'s damaged copy of ``base`` to ``dst``."""
    kind, target, change = case.kind, case.target, case.change
    if kind == "drop_key":
        return rewrite_metadata(base, dst, lambda kv: kv.pop(target, None))
    if kind == "drop_tensor":
        return rewrite_metadata(base, dst, drop=target)
    if kind == "meta" and change[0] == "retype":
        return rewrite_metadata(base, dst, lambda kv: _retype(kv, target, change[1], change[2]))
    if kind == "meta" and change[0] == "shorten":
        def shorten(kv):
            value, vt, sub = kv[target]
            kv[target] = (value[: len(value) - change[1]], vt, sub)
        return rewrite_metadata(base, dst, shorten)
    shutil.copyfile(base, dst)
    if kind == "truncate":
        with open(dst, "r+b") as f:
            f.truncate(change)
        return dst
    if kind == "flip":
        with open(dst, "r+b") as f:
            for pos, byte in change:
                f.seek(pos)
                f.write(bytes([byte]))
        return dst
    if kind == "header":
        with open(dst, "r+b") as f:
            if target == "version":
                f.seek(4)
                f.write(int(change).to_bytes(4, "little"))
            else:
                pos = 8 if target == "n_tensors" else 16
                f.seek(pos)
                old = int.from_bytes(f.read(8), "little")
                new = old + 1 if change == "+1" else old - 1 if change == "-1" else int(change)
                f.seek(pos)
                f.write(new.to_bytes(8, "little"))
        return dst
    if kind == "meta":  # ("same", value): same GGUF type, new value
        def edit(r):
            f = r.fields[target]
            part = f.parts[f.data[0]]
            with np.errstate(over="ignore", invalid="ignore"):
                part[0] = np.array(change[1]).astype(part.dtype)
        _patch(dst, edit)
        return dst
    if kind == "tensor":
        _patch(dst, lambda r: _edit_tensor(r, target, change))
        return dst
    raise ValueError(f"unknown damage kind {kind!r}")


def _edit_tensor(r, name: str, change) -> None:
    import gguf

    t = next(t for t in r.tensors if t.name == name)
    _name_len, name_data, n_dims, dims, raw_type, offset = t.field.parts
    what, arg = change
    if what == "dims":
        gguf_dims = list(reversed(arg))
        for i, d in enumerate(gguf_dims[: len(dims)]):
            dims[i] = d
    elif what == "type":
        raw_type[0] = arg if isinstance(arg, int) else gguf.GGMLQuantizationType[arg].value
    elif what == "offset":
        offset[0] = np.uint64(arg)
    elif what == "offset_add":
        offset[0] = np.uint64(int(offset[0]) + arg)
    elif what == "offset_of":
        other = next(t for t in r.tensors if t.name == arg)
        offset[0] = other.field.parts[5][0]
    elif what == "rename":
        name_data[0] = ord("X")  # "blk.0..." -> "Xlk.0...", "token_embd" -> "Xoken_embd"
    else:
        raise ValueError(what)
