"""Tiny random-weight GGUF files, laid out exactly as the real converter writes them.

``write_tiny_model`` writes a model of any supported architecture with a working byte-level BPE
tokenizer in its metadata; ``write_bad_files`` writes the damaged files the loader must refuse.
Nothing here needs a download, so every correctness test can build the models it needs.

Layout notes (checked against the real files in ``~/.cache/tsspec/models``):

* matrices are numpy row-major ``[out, in]`` arrays; GGUF records the dims reversed, and
  ``GGUFFile.tensor`` reverses them back;
* ``{arch}.vocab_size`` is written for llama only (as SmolLM2's file has it); other architectures
  take the vocabulary size from ``tokenizer.ggml.tokens``;
* gemma3 writes ``key_length``/``value_length`` and ``sliding_window``; its norm weights are stored
  with Gemma's +1 already folded in, so they are drawn near 1 like everyone else's.

A new dense architecture's writer is its name in ``ARCHS``, its rope base in ``ROPE_BASE`` and its
tensors in ``_tensors`` (the hybrid trunks' is ``tiny_hybrid.py``). The writer follows the real
converter, not tsspec's tables (``tsspec/models/<arch>.py`` ``TABLES``), on purpose: a file built
from the tables could not show one of them wrong; ``test_validate.py`` holds the two side by side.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import numpy as np

ARCHS = ("llama", "qwen2", "qwen3", "gemma3")

ROPE_BASE = {"llama": 10000.0, "qwen2": 1000000.0, "qwen3": 1000000.0, "gemma3": 1000000.0}

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|endoftext|>"
N_BYTES = 256
MIN_BYTES_VOCAB = N_BYTES + len(SPECIAL_TOKENS)

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)

# Text the tiny BPE vocabulary is trained on: ordinary English and a little code, so common ASCII
# text encodes into a mix of merged and single-byte tokens.
_CORPUS = """
The quick brown fox jumps over the lazy dog. The cat sat on the mat, and the dog sat on the log.
In the beginning there was the word, and the word was with the reader of the text.
def main():
    for i in range(10):
        print("hello world", i)
    return None
class Model:
    def __init__(self, name):
        self.name = name
Speculative decoding drafts tokens and verifies them with the target model in one forward pass.
The model reads the tokens, then it writes the next token, and then the next one after that.
She said that they would meet at the station on the other side of the river in the morning.
Numbers like 1234 and 5678 appear in tables; dates like 2024-01-15 appear in logs and reports.
import numpy as np
x = np.zeros((3, 4), dtype=np.float32)
if x is not None and len(x) > 0:
    value = x[0] + x[1]
""" * 3

# GPT-2's word split, close enough for training merges (letters, digits, other, whitespace).
_WORD_RE = re.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+")


def _byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character map as a list indexed by byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    to_char = {b: chr(b) for b in printable}
    extra = 0
    for b in range(N_BYTES):
        if b not in to_char:
            to_char[b] = chr(256 + extra)
            extra += 1
    return [to_char[b] for b in range(N_BYTES)]


def byte_level_vocab(vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token_types, merges) of a GPT-2 style vocabulary of exactly ``vocab_size`` entries.

    Ids 0..255 are the byte symbols (id == byte value), then the special tokens, then merged tokens
    learned from a small corpus by plain BPE training; unused placeholders fill any remainder.
    """
    if vocab_size < MIN_BYTES_VOCAB:
        raise ValueError(f"a byte-level vocabulary needs vocab_size >= {MIN_BYTES_VOCAB}, got {vocab_size}")
    alphabet = _byte_alphabet()
    tokens = list(alphabet) + list(SPECIAL_TOKENS)
    types = [1] * N_BYTES + [3] * len(SPECIAL_TOKENS)  # NORMAL bytes, CONTROL specials
    merges: list[str] = []
    words = Counter(
        tuple(alphabet[b] for b in w.encode("utf-8")) for w in _WORD_RE.findall(_CORPUS)
    )
    known = set(tokens)
    while len(tokens) < vocab_size:
        pairs: Counter = Counter()
        for w, n in words.items():
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] += n
        # most frequent pair; ties broken by the pair's text so the vocabulary is deterministic
        best = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]), default=None)
        if best is None:
            break
        (a, b), _ = best
        merges.append(f"{a} {b}")
        if a + b not in known:
            tokens.append(a + b)
            types.append(1)
            known.add(a + b)
        new_words: Counter = Counter()
        for w, n in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new_words[tuple(out)] += n
        words = new_words
    while len(tokens) < vocab_size:
        tokens.append(f"<|unused_{len(tokens)}|>")
        types.append(5)  # UNUSED
    return tokens, types, merges


def _rand(rng: np.random.Generator, shape, std: float) -> np.ndarray:
    return (rng.standard_normal(shape) * std).astype(np.float32)


def _norm(rng: np.random.Generator, n: int) -> np.ndarray:
    return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)


def _tensors(arch: str, rng: np.random.Generator, *, vocab_size, d_model, n_layers, n_heads, n_kv_heads,
             head_dim, ffn_dim, tied) -> dict[str, np.ndarray]:
    """All weights of a tiny model, numpy [out, in], in the order the real converter writes them."""
    q_dim, kv_dim = n_heads * head_dim, n_kv_heads * head_dim
    t: dict[str, np.ndarray] = {}
    # Scales chosen so greedy text from a random model is varied (logit std ~1-2.5 nats) instead of
    # copying the last token, which tied embeddings favour: block outputs (``attn_output``,
    # ``ffn_down`` at 3/sqrt(in); gemma's post-norms near 3) outweigh the embedding in the residual.
    gemma = arch == "gemma3"
    t["token_embd.weight"] = _rand(rng, (vocab_size, d_model), 0.15 if gemma else 0.3)
    out_gain = 1.0 if gemma else 3.0
    for i in range(n_layers):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = _norm(rng, d_model)
        t[p + "attn_q.weight"] = _rand(rng, (q_dim, d_model), 1.0 / np.sqrt(d_model))
        t[p + "attn_k.weight"] = _rand(rng, (kv_dim, d_model), 1.0 / np.sqrt(d_model))
        t[p + "attn_v.weight"] = _rand(rng, (kv_dim, d_model), 1.0 / np.sqrt(d_model))
        if arch == "qwen2":
            t[p + "attn_q.bias"] = _rand(rng, (q_dim,), 0.1)
            t[p + "attn_k.bias"] = _rand(rng, (kv_dim,), 0.1)
            t[p + "attn_v.bias"] = _rand(rng, (kv_dim,), 0.1)
        if arch in ("qwen3", "gemma3"):
            t[p + "attn_q_norm.weight"] = _norm(rng, head_dim)
            t[p + "attn_k_norm.weight"] = _norm(rng, head_dim)
        t[p + "attn_output.weight"] = _rand(rng, (d_model, q_dim), out_gain / np.sqrt(q_dim))
        if arch == "gemma3":
            t[p + "post_attention_norm.weight"] = 3.0 * _norm(rng, d_model)
        t[p + "ffn_norm.weight"] = _norm(rng, d_model)
        t[p + "ffn_gate.weight"] = _rand(rng, (ffn_dim, d_model), 1.0 / np.sqrt(d_model))
        t[p + "ffn_up.weight"] = _rand(rng, (ffn_dim, d_model), 1.0 / np.sqrt(d_model))
        t[p + "ffn_down.weight"] = _rand(rng, (d_model, ffn_dim), out_gain / np.sqrt(ffn_dim))
        if arch == "gemma3":
            t[p + "post_ffw_norm.weight"] = 3.0 * _norm(rng, d_model)
    t["output_norm.weight"] = _norm(rng, d_model)
    if not tied:
        t["output.weight"] = _rand(rng, (vocab_size, d_model), 0.3)
    return t


def tiny_tensors(arch: str = "llama", **kw) -> dict[str, np.ndarray]:
    """The F32 weights ``write_tiny_model`` writes for the same arguments (before quantization)."""
    args = _resolve(arch, **kw)
    return _tensors(arch, np.random.default_rng(args.pop("seed")), **{k: args[k] for k in _TENSOR_ARGS})


_TENSOR_ARGS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "tied")


def _resolve(arch: str, *, seed=0, vocab_size=300, d_model=64, n_layers=None, n_heads=4, n_kv_heads=2,
             head_dim=None, ffn_dim=128, tied=True, **_ignored) -> dict:
    if arch not in ARCHS:
        raise ValueError(f"tiny models exist for {', '.join(ARCHS)}, not {arch!r}")
    if n_layers is None:
        n_layers = 6 if arch == "gemma3" else 2  # gemma3: five local layers and one global
    if head_dim is None:
        # gemma3's real head_dim makes q_dim != d_model; keep that shape difference in the tiny one
        head_dim = 2 * d_model // n_heads if arch == "gemma3" else d_model // n_heads
    return dict(seed=seed, vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                n_kv_heads=n_kv_heads, head_dim=head_dim, ffn_dim=ffn_dim, tied=tied)


def write_tiny_model(
    path,
    arch: str = "llama",
    *,
    seed: int = 0,
    vocab_size: int = 300,
    d_model: int = 64,
    n_layers: int | None = None,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    head_dim: int | None = None,
    ffn_dim: int = 128,
    ctx: int = 256,
    tied: bool = True,
    quant: str | None = None,
    tokenizer: str | None = "bytes",
    sliding_window: int = 8,
    rope_base: float | None = None,
) -> Path:
    """Write a random-weight ``arch`` model to ``path``; returns the path.

    ``n_layers`` defaults to 2 (6 for gemma3, so it has a global layer after five local ones);
    ``head_dim`` to d_model/n_heads (2*d_model/n_heads for gemma3). ``quant`` None writes F32;
    "Q8_0", "Q4_0", "Q4_1" and "Q5_0" quantize every matrix with gguf-py; "Q4_K" and "Q6_K" with
    ``quantize_k`` (gguf-py has no K-quant writer), a matrix whose rows are not whole 256-element
    super-blocks in Q8_0 instead, as llama.cpp's quantizer falls back. ``tokenizer="bytes"`` writes a GPT-2 byte-level
    BPE vocabulary of ``vocab_size`` (>= 259) tokens with ``<|endoftext|>`` as EOS and ChatML
    specials; ``tokenizer=None`` writes no tokenizer (then ``{arch}.vocab_size`` carries the size).
    ``sliding_window`` is written for gemma3 only.
    """
    import gguf

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    a = _resolve(arch, seed=seed, vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                 n_kv_heads=n_kv_heads, head_dim=head_dim, ffn_dim=ffn_dim, tied=tied)
    if tokenizer not in ("bytes", None):
        raise ValueError(f"tokenizer must be 'bytes' or None, not {tokenizer!r}")
    if quant not in FILE_TYPES:
        raise ValueError(f"quant must be one of {', '.join(map(str, FILE_TYPES))}, not {quant!r}")
    hd = a["head_dim"]

    w = gguf.GGUFWriter(str(path), arch)
    w.add_type("model")
    w.add_name(f"tiny {arch} seed {seed}")
    w.add_context_length(ctx)
    w.add_embedding_length(a["d_model"])
    w.add_block_count(a["n_layers"])
    w.add_feed_forward_length(a["ffn_dim"])
    w.add_head_count(a["n_heads"])
    w.add_head_count_kv(a["n_kv_heads"])
    w.add_rope_freq_base(float(rope_base if rope_base is not None else ROPE_BASE[arch]))
    w.add_layer_norm_rms_eps(1e-6 if arch != "llama" else 1e-5)
    if arch in ("gemma3", "qwen3") or hd != a["d_model"] // a["n_heads"]:
        w.add_key_length(hd)
        w.add_value_length(hd)
    if arch == "gemma3":
        w.add_sliding_window(sliding_window)
    if arch == "llama":
        w.add_vocab_size(a["vocab_size"])
        w.add_rope_dimension_count(hd)
    elif tokenizer is None:
        w.add_vocab_size(a["vocab_size"])
    w.add_file_type(FILE_TYPES[quant])

    if tokenizer == "bytes":
        tokens, types, merges = byte_level_vocab(a["vocab_size"])
        eos = tokens.index(EOS_TOKEN)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(eos)
        w.add_eos_token_id(eos)
        w.add_pad_token_id(eos)
        w.add_add_bos_token(False)
        w.add_chat_template(CHATML_TEMPLATE)
    w.add_quantization_version(2)

    rng = np.random.default_rng(seed)
    tensors = _tensors(arch, rng, **{k: a[k] for k in _TENSOR_ARGS})
    return finish_gguf(w, tensors, path, quant)


# quant -> general.file_type (llama.cpp's LLAMA_FTYPE_MOSTLY_*)
FILE_TYPES = {None: 0, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q4_K": 15, "Q6_K": 18}


def quantize_k(arr: np.ndarray, type_name: str) -> np.ndarray:
    """``arr`` float32 [n, k] (k a multiple of 256) as GGUF Q4_K or Q6_K blocks (uint8 [n, row
    bytes]): a plain round-to-nearest quantizer (llama.cpp searches its scales; any valid blocks
    serve here), written in the layout ggml and gguf-py dequantize."""
    n, k = arr.shape
    if k % 256:
        raise ValueError(f"{type_name}: rows of {k} elements are not whole super-blocks of 256")
    x = arr.astype(np.float32).reshape(-1, 256)
    nb = len(x)
    if type_name == "Q6_K":
        sub = x.reshape(nb, 16, 16)
        s = np.abs(sub).max(axis=2) / 31.0  # per 16-element sub-block
        d = s.max(axis=1) / 127.0
        d16 = d.astype(np.float16)
        dd = d16.astype(np.float32)[:, None]
        sc = np.clip(np.rint(np.divide(s, dd, out=np.zeros_like(s), where=dd > 0)), -128, 127).astype(np.int8)
        step = dd * sc.astype(np.float32)
        q = np.clip(np.rint(np.divide(sub, step[:, :, None], out=np.zeros_like(sub), where=step[:, :, None] != 0)),
                    -32, 31).astype(np.int32) + 32  # 0..63
        q = q.reshape(nb, 2, 128)  # two halves of 128
        ql = np.zeros((nb, 2, 64), np.uint8)
        qh = np.zeros((nb, 2, 32), np.uint8)
        for t in range(4):  # element 32 t + l of a half: ql[l + 32 (t % 2)], nibble t // 2; qh[l] bits 2t
            c = q[:, :, 32 * t:32 * t + 32]
            lo = (c & 0xF).astype(np.uint8)
            ql[:, :, 32 * (t % 2):32 * (t % 2) + 32] |= lo << (4 * (t // 2))
            qh |= ((c >> 4) & 3).astype(np.uint8) << (2 * t)
        out = np.concatenate([ql.reshape(nb, 128), qh.reshape(nb, 64), sc.view(np.uint8).reshape(nb, 16),
                              d16.view(np.uint8).reshape(nb, 2)], axis=1)
        return out.reshape(n, -1)
    if type_name != "Q4_K":
        raise ValueError(f"quantize_k writes Q4_K and Q6_K, not {type_name}")
    sub = x.reshape(nb, 8, 32)
    lo = np.minimum(sub.min(axis=2), 0.0)
    s = (sub.max(axis=2) - lo) / 15.0
    mn = -lo
    d16, dm16 = (s.max(axis=1) / 63.0).astype(np.float16), (mn.max(axis=1) / 63.0).astype(np.float16)
    d, dm = d16.astype(np.float32)[:, None], dm16.astype(np.float32)[:, None]
    sc = np.clip(np.rint(np.divide(s, d, out=np.zeros_like(s), where=d > 0)), 0, 63).astype(np.int32)
    m = np.clip(np.rint(np.divide(mn, dm, out=np.zeros_like(mn), where=dm > 0)), 0, 63).astype(np.int32)
    step, off = d * sc, dm * m
    q = np.clip(np.rint(np.divide(sub + off[:, :, None], step[:, :, None], out=np.zeros_like(sub),
                                  where=step[:, :, None] > 0)), 0, 15).astype(np.uint8)
    scales = np.zeros((nb, 12), np.uint8)
    for j in range(4):  # ggml's 6-bit packing (get_scale_min_k4 reads it back)
        scales[:, j] = (sc[:, j] | ((sc[:, j + 4] >> 4) << 6)).astype(np.uint8)
        scales[:, j + 4] = (m[:, j] | ((m[:, j + 4] >> 4) << 6)).astype(np.uint8)
        scales[:, j + 8] = ((sc[:, j + 4] & 0xF) | ((m[:, j + 4] & 0xF) << 4)).astype(np.uint8)
    qs = (q[:, 0::2, :] | (q[:, 1::2, :] << 4)).reshape(nb, 128)  # sub-blocks 2j (low) and 2j+1 (high)
    out = np.concatenate([d16.view(np.uint8).reshape(nb, 2), dm16.view(np.uint8).reshape(nb, 2), scales, qs], axis=1)
    return out.reshape(n, -1)


def finish_gguf(w, tensors: dict, path: Path, quant: str | None = None) -> Path:
    """Add ``tensors`` (matrices quantized to ``quant`` if given; see ``write_tiny_model``) and
    write the file out."""
    import gguf

    for name, arr in tensors.items():
        qname = quant
        if quant in ("Q4_K", "Q6_K") and arr.ndim == 2 and arr.shape[1] % 256:
            qname = "Q8_0"
        if qname is not None and arr.ndim == 2:
            qtype = gguf.GGMLQuantizationType[qname]
            data = quantize_k(arr, qname) if qname in ("Q4_K", "Q6_K") else gguf.quants.quantize(arr, qtype)
            w.add_tensor(name, data, raw_dtype=qtype)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def rewrite_metadata(src: Path, dst: Path, edit=None, *, drop: str | None = None) -> Path:
    """Copy an F32 GGUF, letting ``edit(metadata dict)`` change its key/values and leaving out
    the tensor ``drop``."""
    import gguf

    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    kv = {}
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        kv[key] = (field.contents(), field.types[0], field.types[-1])
    if edit is not None:
        edit(kv)
    w = gguf.GGUFWriter(str(dst), arch)
    for key, (value, vtype, sub) in kv.items():
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, value, vtype, sub_type=sub)
        else:
            w.add_key_value(key, value, vtype)
    for t in r.tensors:
        if t.name == drop:
            continue
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        w.add_tensor(t.name, np.array(t.data, dtype=np.float32).reshape(shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def write_bad_files(dir) -> dict[str, Path]:
    """Files the loader must refuse, by what is wrong with them.

    ``truncated``: a tiny model cut in the middle of its tensor data; ``bad_magic``: right size,
    wrong first four bytes; ``empty``: zero bytes; ``unknown_arch``: a valid GGUF whose
    ``general.architecture`` is ``mamba9``; ``missing_tensor``: a llama file without
    ``blk.1.ffn_down.weight``; ``shape_mismatch``: a llama file whose metadata says a smaller FFN
    than its tensors have.
    """
    import gguf

    d = Path(dir)
    d.mkdir(parents=True, exist_ok=True)
    good = write_tiny_model(d / "good.gguf", "llama")
    data = good.read_bytes()
    out: dict[str, Path] = {}

    # cut inside the last tensor's bytes (the tensor data is the tail of the file)
    out["truncated"] = d / "truncated.gguf"
    out["truncated"].write_bytes(data[: len(data) - 1000])

    out["bad_magic"] = d / "bad_magic.gguf"
    out["bad_magic"].write_bytes(b"GGML" + data[4:])

    out["empty"] = d / "empty.gguf"
    out["empty"].write_bytes(b"")

    out["unknown_arch"] = d / "unknown_arch.gguf"
    w = gguf.GGUFWriter(str(out["unknown_arch"]), "mamba9")
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    out["missing_tensor"] = d / "missing_tensor.gguf"
    rewrite_metadata(good, out["missing_tensor"], drop="blk.1.ffn_down.weight")

    def smaller_ffn(kv):
        value, vtype, sub = kv["llama.feed_forward_length"]
        kv["llama.feed_forward_length"] = (int(value) // 2, vtype, sub)

    out["shape_mismatch"] = rewrite_metadata(good, d / "shape_mismatch.gguf", smaller_ffn)
    good.unlink()
    return out

