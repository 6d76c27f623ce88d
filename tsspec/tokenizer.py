"""Tokenizers built from a GGUF file's ``tokenizer.ggml.*`` metadata, behaving like llama.cpp's.

Contract:

* ``Tokenizer.from_metadata(meta)`` / ``Tokenizer.from_gguf(path)`` build the tokenizer the file
  describes. The splitting and merging is done by a HuggingFace ``tokenizers.Tokenizer`` assembled
  from the vocabulary; nothing here implements BPE by hand.

  - ``tokenizer.ggml.model == "gpt2"``: byte-level BPE from ``tokens`` + ``merges``, pre-split by the
    regexes llama.cpp uses for ``tokenizer.ggml.pre`` (applied one after another, as llama.cpp's
    ``unicode_regex_split`` does). An unknown ``pre`` falls back to the plain GPT-2 regex with a
    warning (llama.cpp refuses such files; we would rather run with the most common split).
  - ``tokenizer.ggml.model == "llama"``: SentencePiece-style vocabulary with ``scores``. llama.cpp
    tokenizes it by repeatedly merging the adjacent pair whose concatenation is the highest-scoring
    token (leftmost on ties), then falls back to ``<0xNN>`` byte tokens for unknown characters. That
    is BPE whose merge ranks are the scores, so the merges are derived from the vocabulary and ranked
    by score; spaces become ``▁`` and ``add_space_prefix`` prepends one to each text fragment.

* Tokens typed CONTROL (3) are special: matched whole only when ``parse_special=True``, plain text
  otherwise. Tokens typed USER_DEFINED (4) are always matched whole, as llama.cpp does (Gemma's
  whitespace-run tokens ``"\\n\\n"``, ``"  "`` are user-defined and must never be split).
* ``encode`` adds BOS/EOS only when ``add_special`` is set and the file asks for them
  (``add_bos_token``/``add_eos_token``; a SentencePiece vocabulary adds BOS unless told otherwise,
  as llama.cpp does).
* ``decode`` and ``StreamDecoder`` work on the bytes each token stands for, so text is exact and a
  multibyte character split across tokens is only emitted once complete. Invalid UTF-8 becomes
  U+FFFD in both, identically. ``skip_special`` drops CONTROL tokens (BOS, ``<|im_end|>``...) and
  the UNKNOWN/UNUSED placeholders; user-defined tokens are text and always kept.
* Missing or inconsistent metadata raises ``ModelFileError`` naming the key.
"""

from __future__ import annotations

import codecs
import contextlib
import functools
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from .env import return_freed_memory
from .errors import BadInput, ModelFileError

# llama.cpp token types (gguf TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SPACE_MARK = "\u2581"  # SentencePiece's visible space "▁"
MAX_TOKEN_BYTES = 256  # the most prompt bytes one token is counted for in min_tokens (see there)

# Pre-tokenizer regexes per ``tokenizer.ggml.pre``, as in llama.cpp's llama-vocab.cpp. Each list is
# applied in order, every regex splitting the pieces the previous one produced ("isolated": matches
# and the gaps between them both become pieces).
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_RE = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RE = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_STARCODER_RES = [r"\p{N}", _GPT2_RE]  # digits one by one, then GPT-2
# llama.cpp's fallback for BPE vocabularies (pre "default" or absent).
_DEFAULT_RES = [r"[\p{P}\$\+<=>\^~\|]+", _GPT2_RE, r"\p{N}+", r"[0-9][0-9][0-9]"]

PRE_TOKENIZER_REGEXES: dict[str, list[str]] = {
    "default": _DEFAULT_RES,
    "llama3": [_LLAMA3_RE],
    "llama-v3": [_LLAMA3_RE],
    "llama-bpe": [_LLAMA3_RE],
    "falcon3": [_LLAMA3_RE],
    "smaug-bpe": [_LLAMA3_RE],
    "dbrx": [_LLAMA3_RE],
    "qwen2": [_QWEN2_RE],
    "stablelm2": [_QWEN2_RE],
    "deepseek-r1-qwen": [_QWEN2_RE],
    "smollm": _STARCODER_RES,
    "starcoder": _STARCODER_RES,
    "refact": _STARCODER_RES,
    "command-r": _STARCODER_RES,
    "codeshell": _STARCODER_RES,
    "exaone": _STARCODER_RES,
    "minerva-7b": _STARCODER_RES,
    "gpt-2": [_GPT2_RE],
    "gpt2": [_GPT2_RE],
    "mpt": [_GPT2_RE],
    "olmo": [_GPT2_RE],
    "jais": [_GPT2_RE],
}

# Texts of end-of-turn tokens that stop generation besides the declared EOS (llama.cpp's EOG set).
_EOG_TEXTS = (
    "<|im_end|>",
    "<|endoftext|>",
    "<end_of_turn>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<|end_of_text|>",
    "<EOT>",
)
_EOG_ID_KEYS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> tuple[dict[int, str], dict[str, int]]:
    """GPT-2's reversible byte <-> printable-character map (byte -> char, char -> byte)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    to_char = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in to_char:  # control bytes, space, etc. move to 256+ so every byte is visible
            to_char[b] = chr(256 + extra)
            extra += 1
    return to_char, {c: b for b, c in to_char.items()}


def _require(meta: Mapping[str, Any], key: str) -> Any:
    if key not in meta:
        raise ModelFileError(f"GGUF tokenizer metadata is missing {key}")
    return meta[key]


def _optional_id(meta: Mapping[str, Any], key: str, n: int) -> int | None:
    value = meta.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < n:
        raise ModelFileError(f"GGUF tokenizer metadata {key}={value!r} is not a token id below {n}")
    return value


def _checked_list(meta: Mapping[str, Any], key: str, n: int) -> list:
    value = meta[key]
    if not isinstance(value, list) or len(value) != n:
        got = len(value) if isinstance(value, list) else type(value).__name__
        raise ModelFileError(
            f"GGUF tokenizer metadata {key} has {got} entries, tokenizer.ggml.tokens has {n}"
        )
    return value


def _tokenizers_call(fn):
    """``fn()``, with what the ``tokenizers`` library raises on a vocabulary it cannot build (a plain
    Exception, or a Rust panic, which arrives as pyo3's PanicException: a BaseException) turned into
    ``ModelFileError``."""
    try:
        with _panic_text_held():
            return fn()
    except ModelFileError:
        raise
    except Exception as e:
        raise ModelFileError(f"GGUF tokenizer metadata does not make a tokenizer: {_one_line(e)}") from None
    except BaseException as e:
        if type(e).__name__ != "PanicException":  # KeyboardInterrupt, SystemExit: not ours to turn
            raise
        raise ModelFileError(f"GGUF tokenizer metadata does not make a tokenizer (tokenizers panicked: "
                             f"{_one_line(e)})") from None


@contextlib.contextmanager
def _panic_text_held():
    """fd 2 into a temporary file while ``tokenizers`` builds: a Rust panic's hook writes its message
    and backtrace straight there, ahead of the error line. Replayed unless the block panicked, so a
    warning on the way is still seen."""
    try:
        sys.stderr.flush()
        saved, held = os.dup(2), tempfile.TemporaryFile()
        os.dup2(held.fileno(), 2)
    except (OSError, ValueError, AttributeError):  # no fd 2 (a test's captured stream): as it is
        yield
        return
    panicked = False
    try:
        yield
    except BaseException as e:
        panicked = type(e).__name__ == "PanicException"
        raise
    finally:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        if not panicked:
            held.seek(0)
            text = held.read()
            if text:
                os.write(2, text)
        held.close()


def _template_problem(template: Any) -> str | None:
    """Why ``tokenizer.chat_template`` is there but unusable; None when it is text or absent."""
    if template is None or isinstance(template, str) and template:
        return None
    if isinstance(template, str):
        return "tokenizer.chat_template is empty"
    kind = "a list" if isinstance(template, list) else f"{type(template).__name__} {_short(template)}"
    return f"tokenizer.chat_template is {kind}, not text"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return (text if len(text) <= 200 else text[:197] + "...") or type(e).__name__


def _token_map(tokens: Sequence[str]) -> dict[str, int]:
    """text -> id; on a duplicated text the first id wins so the vocabulary stays a bijection (built
    from the last id down, so that the first one is written last: no Python loop over 151k tokens)."""
    return dict(zip(reversed(tokens), range(len(tokens) - 1, -1, -1)))


def _all_of(values: Sequence, kinds: tuple[type, ...]) -> bool:
    """Whether every value's type is one of ``kinds`` exactly (a bool is not an int here): one pass
    in C over a 151k-entry vocabulary, where a generator of ``isinstance`` calls took 30-60 ms."""
    return set(map(type, values)) <= set(kinds)


def _byte_level_merges(meta: Mapping[str, Any], tokens: list[str]) -> list[tuple[str, str]]:
    """The file's merges, each checked to name tokens the vocabulary has."""
    merges_raw = _require(meta, "tokenizer.ggml.merges")
    if not isinstance(merges_raw, list):
        raise ModelFileError("GGUF tokenizer metadata tokenizer.ggml.merges is not a list")
    vocab = _token_map(tokens)
    merges: list[tuple[str, str]] = []
    for i, m in enumerate(merges_raw):
        parts = m.split(" ") if isinstance(m, str) else ()
        if len(parts) != 2 or not all(parts):
            raise ModelFileError(f"GGUF tokenizer metadata tokenizer.ggml.merges has a bad entry {_short(m)}")
        # checked here: a merge naming tokens the vocabulary lacks made the tokenizers library
        # panic, its Rust backtrace reaching the terminal before the error line
        missing = next((t for t in (parts[0], parts[1], parts[0] + parts[1]) if t not in vocab), None)
        if missing is not None:
            raise ModelFileError(f"GGUF tokenizer metadata does not make a tokenizer: tokenizer.ggml.merges[{i}] ({_short(m)}) names "
                                 f"{_short(missing)}, which is not in tokenizer.ggml.tokens")
        merges.append((parts[0], parts[1]))
    return merges


def _byte_level_model(meta: Mapping[str, Any], tokens: list[str], merges: list[tuple[str, str]]):
    from tokenizers import Regex, models, pre_tokenizers

    vocab = _token_map(tokens)
    model = models.BPE(vocab=vocab, merges=merges, ignore_merges=False)

    pre = meta.get("tokenizer.ggml.pre") or "default"
    regexes = PRE_TOKENIZER_REGEXES.get(pre)
    if regexes is None:
        warnings.warn(
            f"unknown tokenizer.ggml.pre {pre!r}; splitting text with the GPT-2 regex", stacklevel=3
        )
        regexes = [_GPT2_RE]
    pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    return model, pre_tokenizer


def _spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Every (left, right) split of a normal token into two normal tokens, best score first.

    llama.cpp merges the adjacent pair whose concatenation scores highest; ranking each merge by
    its result's score (then by id, for a stable order) makes HF's BPE pick the same pair.
    """
    normal = {t: i for i, t in enumerate(tokens) if types[i] == NORMAL}
    found: list[tuple[float, int, str, str]] = []
    for t, i in normal.items():
        for k in range(1, len(t)):
            left, right = t[:k], t[k:]
            if left in normal and right in normal:
                found.append((-scores[i], i, left, right))
    found.sort()
    return [(left, right) for _, _, left, right in found]


def _spm_model(meta: Mapping[str, Any], tokens: list[str], types: list[int], merges: list[tuple[str, str]]):
    from tokenizers import models, pre_tokenizers

    unk_id = _optional_id(meta, "tokenizer.ggml.unknown_token_id", len(tokens))
    has_bytes = any(types[i] == BYTE for i in range(len(tokens)))
    model = models.BPE(
        vocab=_token_map(tokens),
        merges=merges,
        unk_token=tokens[unk_id] if unk_id is not None else None,
        byte_fallback=has_bytes,
        ignore_merges=False,
    )
    # llama.cpp escapes spaces as "▁" and, with add_space_prefix, prepends one to every text
    # fragment (a fragment is text between special tokens). split=False: no splitting at spaces,
    # SentencePiece merges across them.
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SPACE_MARK, prepend_scheme="always" if prefix else "never", split=False
    )
    return model, pre_tokenizer, prefix


class StreamDecoder:
    """Incremental detokenizer: ``push`` returns only newly completed text, ``flush`` the rest.

    Works on token bytes through an incremental UTF-8 decoder, so each push costs O(token length)
    and a character split across tokens is held back until its last byte arrives.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._tok = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._strip_prefix = tokenizer._strip_prefix_space

    def push(self, token_id: int) -> str:
        piece = self._tok._piece(token_id, self._skip_special)
        if self._strip_prefix and piece:
            if not self._tok._is_control(token_id):
                self._strip_prefix = False
                if piece.startswith(b" "):
                    piece = piece[1:]
        return self._utf8.decode(piece)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


def _token_types(meta: Mapping[str, Any], n: int) -> list[int]:
    """Each token's llama.cpp type (all NORMAL when the file gives none), checked."""
    if "tokenizer.ggml.token_type" not in meta:
        return [NORMAL] * n
    types = _checked_list(meta, "tokenizer.ggml.token_type", n)
    if not _all_of(types, (int,)) and not all(isinstance(t, int) and not isinstance(t, bool) for t in types):
        raise ModelFileError("GGUF tokenizer metadata tokenizer.ggml.token_type is not a list of integers")
    # llama.cpp's enum: UNDEFINED (0) .. BYTE (6); anything else is damage, not a normal token
    if types and 0 <= min(types) and max(types) <= BYTE:
        return types
    bad = next((i for i, t in enumerate(types) if not 0 <= t <= BYTE), None)
    if bad is not None:
        raise ModelFileError(f"GGUF tokenizer metadata tokenizer.ggml.token_type[{bad}] is {types[bad]}, "
                             f"not a token type (0-{BYTE}): the file is damaged")
    return types


def _build_hf(kind: str, meta: Mapping[str, Any], tokens: list[str], types: list[int],
              merges: list[tuple[str, str]]):
    """The ``tokenizers`` tokenizer for a byte-level BPE ("gpt2") or SentencePiece ("llama")
    vocabulary, with its control and user-defined tokens matched whole; -> (it, add_space_prefix)."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    add_space_prefix = False
    if kind == "gpt2":
        model, pre_tokenizer = _byte_level_model(meta, tokens, merges)
    else:
        model, pre_tokenizer, add_space_prefix = _spm_model(meta, tokens, types, merges)
    hf = HFTokenizer(model)
    hf.pre_tokenizer = pre_tokenizer
    # normalized=False: matched against the raw text, before "▁" escaping or byte mapping.
    n = len(tokens)
    hf.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in range(n) if types[i] == CONTROL])
    hf.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in range(n) if types[i] == USER_DEFINED])
    return hf, add_space_prefix


CACHE_FORMAT = 2  # bump when what ``compute_merges`` makes changes: older entries then miss
CACHE_ENTRIES = 32  # entries kept (a real vocabulary's merges are 1-4 MB)


def tokenizer_cache_dir() -> Path:
    """Where tokenizers' merges are kept: ``$TSSPEC_CACHE/tokenizers``, else ~/.cache/tsspec/tokenizers."""
    from .env import cache_home

    return cache_home() / "tokenizers"


def metadata_key(meta: Mapping[str, Any]) -> str:
    """A hash of everything a tokenizer is built from (every ``tokenizer.ggml.*`` value), with the
    cache format and the ``tokenizers`` version: two files with the same key build the same one."""
    import hashlib

    import numpy as np
    import tokenizers

    h = hashlib.sha256(f"tsspec-tokenizer/{CACHE_FORMAT}/{tokenizers.__version__}".encode())
    for key in sorted(k for k in meta if k.startswith("tokenizer.ggml.")):
        v = meta[key]
        h.update(b"\x00" + key.encode() + b"\x00")
        if isinstance(v, list) and v and (_all_of(v, (str,)) or all(isinstance(x, str) for x in v)):
            h.update(b"s%d\x00" % len(v) + "\x00".join(v).encode("utf-8", "surrogatepass"))
        elif isinstance(v, list) and v and _all_of(v, (int, float)):
            h.update(b"n%d\x00" % len(v) + np.asarray(v, dtype=np.float64).tobytes())
        else:
            h.update(repr(v).encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def compute_merges(kind: str, meta: Mapping[str, Any], tokens: list[str], types: list[int]) -> list[tuple[str, str]]:
    """The BPE merges in rank order, checked: a byte-level file's own, or for a SentencePiece
    vocabulary every split of a normal token into two, ranked by score (``_spm_merges``)."""
    if kind == "gpt2":
        return _byte_level_merges(meta, tokens)
    _require(meta, "tokenizer.ggml.scores")
    return _spm_merges(tokens, _checked_list(meta, "tokenizer.ggml.scores", len(tokens)), types)


def _cached_merges(kind: str, meta: Mapping[str, Any], tokens: list[str], types: list[int]) -> list[tuple[str, str]]:
    """``compute_merges``, from the cache when an entry for this metadata is there and whole.

    The merges are what building a tokenizer costs in Python: ranking a SentencePiece
    vocabulary's splits took 1.4 s of gemma3-270m's 1.9 s build, checking qwen2.5's 151k merges
    most of its 0.6 s. (Caching the built tokenizer's own JSON saved less, and reading it back
    held 120 MB more at its peak.) An entry is one header line (the key, the count, the sha256 of
    the rest) and the merges as pairs of token ids (int32). A missing, damaged or foreign entry is
    computed again and rewritten; a cache that cannot be read or written costs the computation,
    never the run."""
    import hashlib
    import json

    import numpy as np

    key = metadata_key(meta)
    path = tokenizer_cache_dir() / f"{key}.merges"
    n_tokens = len(tokens)
    try:
        raw = path.read_bytes()
        head, _, body = raw.partition(b"\n")
        info = json.loads(head)
        if info["key"] == key and info["sha256"] == hashlib.sha256(body).hexdigest():
            ids = np.frombuffer(body, dtype="<i4").reshape(int(info["n"]), 2)
            if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= n_tokens):
                raise ValueError("a merge names no token")
            with contextlib.suppress(OSError):
                os.utime(path)  # recently used: the last to be evicted
            return [(tokens[a], tokens[b]) for a, b in ids.tolist()]
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no entry, or not a whole one: computed again below
    merges = compute_merges(kind, meta, tokens, types)
    index = _token_map(tokens)
    body = np.array([(index[a], index[b]) for a, b in merges], dtype="<i4").reshape(-1, 2).tobytes()
    head = json.dumps({"key": key, "n": len(merges), "sha256": hashlib.sha256(body).hexdigest()}).encode()
    part = path.with_name(f".{key}.{os.getpid()}.part")  # written whole, then renamed into place
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        part.write_bytes(head + b"\n" + body)
        os.replace(part, path)
        _evict(path.parent, keep=CACHE_ENTRIES)
    except OSError:
        with contextlib.suppress(OSError):
            part.unlink()
    return merges


def _evict(folder: Path, keep: int) -> None:
    """Leave the ``keep`` most recently used entries (and no entry of an older format)."""
    entries = sorted(folder.glob("*.merges"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in entries[keep:] + list(folder.glob("*.json")):
        with contextlib.suppress(OSError):
            old.unlink()


def _end_ids(meta: Mapping[str, Any], hf, types: list[int], eos_id: int | None) -> frozenset[int]:
    """The ids that end generation: the file's eos and end-of-generation ids, and the known end
    markers where the vocabulary holds them as control tokens."""
    n = len(types)
    eos = {eos_id} if eos_id is not None else set()
    eos.update(i for k in _EOG_ID_KEYS if (i := _optional_id(meta, k, n)) is not None)
    for text in _EOG_TEXTS:  # looked up one by one: the whole vocabulary as a dict took 0.3 s for 262k tokens
        i = hf.token_to_id(text)
        # A normal token spelled like an end marker is ordinary text, not a stop signal.
        if i is not None and types[i] != NORMAL:
            eos.add(i)
    return frozenset(eos)


class Tokenizer:
    """A GGUF model's tokenizer; see the module docstring for the contract."""

    def __init__(
        self,
        hf: Any,
        *,
        tokens: list[str],
        token_types: list[int],
        byte_level: bool,
        bos_id: int | None,
        eos_id: int | None,
        eos_ids: frozenset[int],
        add_bos: bool,
        add_eos: bool,
        add_space_prefix: bool,
        chat_template: str | None,
        chat_template_problem: str | None = None,
    ):
        self.hf = hf
        self._tokens = tokens
        self._types = token_types
        self._byte_level = byte_level
        self.vocab_size = len(tokens)
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.eos_ids = eos_ids
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.chat_template = chat_template
        # why a template the file holds is not used (one that is not text), for the messages
        # that say there is none
        self.chat_template_problem = chat_template_problem
        # The encoder prepended a space to the first fragment; decoding the start removes it again.
        self._strip_prefix_space = add_space_prefix
        self._bytes_cache: dict[int, bytes] = {}

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> Tokenizer:
        from .gguf_file import read_metadata

        return cls.from_metadata(read_metadata(path))

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        tokens = _require(meta, "tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens or not (_all_of(tokens, (str,))
                                                               or all(isinstance(t, str) for t in tokens)):
            raise ModelFileError("GGUF tokenizer metadata tokenizer.ggml.tokens is not a list of strings")
        n = len(tokens)
        types = _token_types(meta, n)
        kind = _require(meta, "tokenizer.ggml.model")
        if kind not in ("gpt2", "llama"):
            raise ModelFileError(
                f"unsupported tokenizer.ggml.model {kind!r} (supported: 'gpt2', 'llama')"
            )
        default_add_bos = kind == "llama"  # llama.cpp's default for SentencePiece vocabularies
        hf, add_space_prefix = _tokenizers_call(
            lambda: _build_hf(kind, meta, tokens, types, _cached_merges(kind, meta, tokens, types)))
        return_freed_memory()  # what the build used, freed but still held

        bos_id = _optional_id(meta, "tokenizer.ggml.bos_token_id", n)
        eos_id = _optional_id(meta, "tokenizer.ggml.eos_token_id", n)
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", default_add_bos))
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        for wanted, token_id, key in ((add_bos, bos_id, "bos"), (add_eos, eos_id, "eos")):
            if wanted and token_id is None:
                raise ModelFileError(
                    f"GGUF tokenizer sets tokenizer.ggml.add_{key}_token "
                    f"but has no tokenizer.ggml.{key}_token_id"
                )
        template = meta.get("tokenizer.chat_template")
        return cls(
            hf,
            tokens=tokens,
            token_types=types,
            byte_level=kind == "gpt2",
            bos_id=bos_id,
            eos_id=eos_id,
            eos_ids=_end_ids(meta, hf, types, eos_id),
            add_bos=add_bos,
            add_eos=add_eos,
            add_space_prefix=add_space_prefix,
            chat_template=template if isinstance(template, str) and template else None,
            chat_template_problem=_template_problem(template),
        )

    # -- encoding -----------------------------------------------------------------------------

    @functools.cached_property
    def _max_token_bytes(self) -> int:
        # >= 4: an unknown character (up to 4 bytes) becomes one <unk> at most; at most
        # MAX_TOKEN_BYTES, so one hostile 10 MB token cannot make the bound worthless
        longest = max((len(t.encode("utf-8", "surrogatepass")) for t in self._tokens), default=0)
        return min(MAX_TOKEN_BYTES, max(4, longest))

    def min_tokens(self, text: str) -> int:
        """A lower bound on ``len(encode(text))`` without encoding: no token stands for more bytes of
        text than its own spelling has (byte-level: one character per byte; SentencePiece: "▁"
        for a space, "<0x41>" for a byte), and none is counted as more than ``MAX_TOKEN_BYTES``
        (real vocabularies' longest are well under it; a file with a 10 MB token let a 30 MB
        prompt be tokenized whole, 6.9 GB resident). Lets a caller refuse a text far past the
        context before tokenizing all of it."""
        return -(-len(text.encode("utf-8", "surrogatepass")) // self._max_token_bytes)

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special`` adds BOS/EOS as the file asks, ``parse_special``
        lets control-token texts such as ``<|im_start|>`` become their single ids."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # lone surrogates: tokenizers would raise a TypeError
            raise BadInput(f"text to encode is not valid UTF-8 (at character {e.start})") from None
        # The flag lives on the shared HF object; set it on every call so no call sees another's.
        self.hf.encode_special_tokens = not parse_special
        ids = self.hf.encode(text, add_special_tokens=False).ids if text else []
        if add_special and self.add_bos:
            ids.insert(0, self.bos_id)
        if add_special and self.add_eos:
            ids.append(self.eos_id)
        return ids

    # -- decoding -----------------------------------------------------------------------------

    def _is_control(self, token_id: int) -> bool:
        return self._types[token_id] in (CONTROL, UNKNOWN, UNUSED)

    def _token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for, as llama.cpp's token_to_piece renders it."""
        cached = self._bytes_cache.get(token_id)
        if cached is not None:
            return cached
        text = self._tokens[token_id]
        kind = self._types[token_id]
        if kind == BYTE and (m := _BYTE_TOKEN.fullmatch(text)):
            out = bytes([int(m.group(1), 16)])
        elif kind != NORMAL:
            out = text.encode("utf-8")  # control / user-defined tokens are their literal text
        elif self._byte_level:
            to_byte = _byte_level_alphabet()[1]
            try:
                out = bytes(to_byte[c] for c in text)
            except KeyError:  # a normal token outside the byte alphabet: take it literally
                out = text.encode("utf-8")
        else:
            out = text.replace(SPACE_MARK, " ").encode("utf-8")
        self._bytes_cache[token_id] = out
        return out

    def _piece(self, token_id: int, skip_special: bool) -> bytes:
        if not 0 <= token_id < self.vocab_size:
            raise IndexError(f"token id {token_id} out of range (vocab size {self.vocab_size})")
        if skip_special and self._is_control(token_id):
            return b""
        return self._token_bytes(token_id)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        stream = self.stream(skip_special=skip_special)
        return "".join(stream.push(i) for i in ids) + stream.flush()

    def token_text(self, token_id: int) -> str:
        """The token's own text, with invalid UTF-8 (a lone byte token) shown as U+FFFD."""
        return self._piece(token_id, False).decode("utf-8", errors="replace")

    def stream(self, skip_special: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special)
