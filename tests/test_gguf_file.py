"""Reading GGUF files: exact round trip of what the tiny writer wrote, dequantization of quantized
files, and one clear ``ModelFileError`` for every way a file can be bad."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from tiny import ARCHS, byte_level_vocab, tiny_tensors, write_bad_files, write_tiny_model
from tsspec.errors import ModelFileError
from tsspec.gguf_file import GGUFFile, read_metadata
from tsspec.models import load_model
from tsspec.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    return write_bad_files(tmp_path_factory.mktemp("bad"))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tied", [True, False])
def test_tiny_model_round_trips(tmp_path, arch, tied):
    p = write_tiny_model(tmp_path / "m.gguf", arch, seed=5, tied=tied)
    g = GGUFFile(p)
    want = tiny_tensors(arch, seed=5, tied=tied)
    assert g.arch == arch
    assert set(g.tensor_names()) == set(want)
    assert g.has_tensor("output.weight") is (not tied)
    for name, arr in want.items():
        info = g.tensor_info(name)
        assert info.shape == arr.shape and info.type_name == "F32"  # numpy order: [out, in]
        got = g.tensor(name)
        assert got.dtype == np.float32 and np.array_equal(got, arr), name
    assert g.quant_types() == {"F32": len(want)}
    meta = read_metadata(p)
    assert meta[f"{arch}.block_count"] == (6 if arch == "gemma3" else 2)
    assert meta[f"{arch}.embedding_length"] == 64
    assert meta["tokenizer.ggml.model"] == "gpt2"


def test_tiny_tokenizer_encodes_and_decodes(tmp_path):
    p = write_tiny_model(tmp_path / "m.gguf", "qwen2")
    tok = Tokenizer.from_gguf(p)
    assert tok.vocab_size == 300
    for text in ["The quick brown fox jumps over the lazy dog.", "def main():\n    return 42\n"]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert len(ids) < len(text.encode())  # merges apply: not one token per byte
    odd = "a  b\t~|^ \u00e9\u4e2d"  # unmerged bytes and multibyte characters still round-trip
    assert tok.decode(tok.encode(odd)) == odd
    eos = tok.encode("<|endoftext|>")
    assert len(eos) == 1 and eos[0] == tok.eos_id and tok.eos_id in tok.eos_ids
    assert len(tok.encode("<|im_start|>user\nhi<|im_end|>")) >= 3
    assert tok.encode("<|im_end|>")[0] in tok.eos_ids


def test_byte_level_vocab_is_consistent():
    tokens, types, merges = byte_level_vocab(400)
    assert len(tokens) == len(types) == 400 and len(set(tokens)) == 400
    known = set(tokens)
    for m in merges:
        a, b = m.split(" ")
        assert a in known and b in known and a + b in known
    with pytest.raises(ValueError):
        byte_level_vocab(96)


def test_no_tokenizer_model_takes_vocab_from_arch_key(tmp_path):
    p = write_tiny_model(tmp_path / "m.gguf", "qwen3", vocab_size=96, tokenizer=None)
    m = load_model(p)
    assert m.vocab_size == 96
    assert m.forward([1, 2, 95], m.make_cache()).logits.shape == (1, 96)


@pytest.mark.parametrize(
    "quant,max_err",
    # worst error as a fraction of a block's max |value|: half a step for Q8_0 (step amax/127);
    # a full step for Q4_0 (scale amax/8 from the signed extreme; the opposite extreme clips 8 -> 7)
    [("Q8_0", 0.5 / 127), ("Q4_0", 1 / 8)],
)
def test_quantized_tiny_models_dequantize_close(tmp_path, quant, max_err):
    f32 = write_tiny_model(tmp_path / "f32.gguf", "llama", seed=3)
    qp = write_tiny_model(tmp_path / f"{quant}.gguf", "llama", seed=3, quant=quant)
    g, want = GGUFFile(qp), tiny_tensors("llama", seed=3)
    n_matrices = sum(a.ndim == 2 for a in want.values())
    assert g.quant_types() == {quant: n_matrices, "F32": len(want) - n_matrices}
    for name, arr in want.items():
        got = g.tensor(name)
        assert got.shape == arr.shape
        if arr.ndim == 1:
            assert np.array_equal(got, arr)
            continue
        assert g.tensor_info(name).type_name == quant
        # every value within max_err of its block's max (plus fp16 rounding of the block scale)
        blocks = arr.reshape(-1, 32)
        amax = np.abs(blocks).max(axis=1, keepdims=True)
        err = np.abs(got.reshape(-1, 32) - blocks)
        assert (err <= amax * (max_err + 2e-3) + 1e-7).all(), name
    # the whole model: logits near the F32 file's (mean error relative to the logits' spread;
    # measured 0.017-0.019 for Q8_0 and 0.27-0.29 for Q4_0 of these Gaussian random weights)
    ids = list(range(10, 50))
    ma, mb = load_model(f32, fmt="f32"), load_model(qp, fmt="f32")
    a = ma.forward(ids, ma.make_cache(), all_logits=True).logits
    b = mb.forward(ids, mb.make_cache(), all_logits=True).logits
    rel = float((a - b).abs().mean() / a.std())
    assert 0 < rel < (0.04 if quant == "Q8_0" else 0.5), rel


def test_truncated_file(bad_files):
    """A file cut inside its tensor data (its header whole): the message names the tensor the cut
    falls in and the bytes the tensors need, not damage to the header (gguf-py fails there first,
    making the cut tensor's view)."""
    size = Path(bad_files["truncated"]).stat().st_size
    for load in (GGUFFile, load_model):
        with pytest.raises(ModelFileError) as e:
            load(bad_files["truncated"])
        msg = str(e.value)
        assert re.search(rf"tensor \S+ \(.*\) ends at byte \d+, past the end of the file \({size} bytes; "
                         rf"the tensors need {size + 1000}\): truncated", msg), msg
        assert "header" not in msg, msg


def test_file_cut_inside_its_header_says_so_in_the_files_terms(bad_files, tmp_path):
    """A file cut short inside its metadata: the reader's buffer arithmetic (a struct or numpy
    message) becomes what happened to the file, with its size."""
    good = Path(bad_files["truncated"]).read_bytes()  # cut in its tensor data; the header is whole
    for cut in (8, 16, 40, 200, 1000):  # 8, 16: right after the version, the tensor count
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(good[:cut])
        with pytest.raises(ModelFileError) as e:
            GGUFFile(p)
        msg = str(e.value)
        assert "corrupt or truncated GGUF file" in msg and "buffer" not in msg and "unpack" not in msg, msg
        assert f"runs past the end of the file ({cut} bytes)" in msg, msg


def test_unknown_tensor_type_code_says_so_in_the_files_terms(tmp_path):
    """A tensor type id no GGML type has: gguf-py's "np.uint32(1000) is not a valid
    GGMLQuantizationType" becomes the file's damage."""
    import struct

    import gguf

    path = write_tiny_model(tmp_path / "m.gguf", "llama")
    data = bytearray(path.read_bytes())
    t = gguf.GGUFReader(path).tensors[0]
    name = t.name.encode()
    i = data.index(struct.pack("<Q", len(name)) + name)  # the tensor's info: name, n_dims, dims, type
    type_at = i + 8 + len(name) + 4 + 8 * len(t.shape)
    assert struct.unpack_from("<I", data, type_at)[0] == int(t.tensor_type)
    struct.pack_into("<I", data, type_at, 1000)
    path.write_bytes(bytes(data))
    with pytest.raises(ModelFileError) as e:
        GGUFFile(path)
    msg = str(e.value)
    assert "a tensor has an unknown type code 1000: the header is damaged" in msg and "np." not in msg, msg


def test_bad_magic(bad_files):
    with pytest.raises(ModelFileError, match=r"not a GGUF file.*magic.*bad_magic\.gguf"):
        GGUFFile(bad_files["bad_magic"])


def test_empty_file(bad_files):
    with pytest.raises(ModelFileError, match=r"empty file, not a GGUF model.*empty\.gguf"):
        GGUFFile(bad_files["empty"])


def test_unknown_architecture(bad_files):
    g = GGUFFile(bad_files["unknown_arch"])  # a valid file...
    assert g.arch == "mamba9"
    with pytest.raises(ModelFileError, match=r"unknown architecture 'mamba9'.*llama"):
        load_model(bad_files["unknown_arch"])  # ...of an architecture we cannot run


def test_missing_tensor(bad_files):
    with pytest.raises(ModelFileError, match=r"missing tensor 'blk\.1\.ffn_down\.weight'"):
        load_model(bad_files["missing_tensor"])


def test_missing_path_and_directory(tmp_path):
    with pytest.raises(ModelFileError, match="not found"):
        GGUFFile(tmp_path / "nope.gguf")
    with pytest.raises(ModelFileError, match="directory"):
        load_model(tmp_path)


def test_missing_metadata_key(tmp_path):
    g = GGUFFile(write_tiny_model(tmp_path / "m.gguf", "llama"))
    with pytest.raises(ModelFileError, match="llama.nonexistent"):
        g.require("llama.nonexistent")
    with pytest.raises(ModelFileError, match="missing tensor 'nope'"):
        g.tensor("nope")


def _plain_metadata(path):
    import gguf

    r = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}


def test_fast_metadata_reader_equals_gguf_py(tmp_path):
    """The array fast path is a reading optimisation only: values equal gguf-py's own."""
    path = write_tiny_model(tmp_path / "m.gguf", arch="gemma3", seed=2)
    g = GGUFFile(path)
    assert g.metadata == _plain_metadata(path)
    assert isinstance(g.metadata["tokenizer.ggml.tokens"], list) and len(g.metadata["tokenizer.ggml.tokens"]) == 300


def _string_array(strings: list[bytes], lead: bytes = b"\x07" * 5) -> tuple[bytes, int]:
    """GGUF's layout of a string array's values after ``lead`` bytes: -> (data, offset of the first)."""
    import struct

    return lead + b"".join(struct.pack("<Q", len(x)) + x for x in strings) + b"tail", len(lead)


def test_string_arrays_decoded_in_one_piece_equal_the_one_at_a_time_reference():
    """``gguf_strings`` (the lengths walked, the bytes decoded once) gives the reference's strings and
    end offset on every kind of string: empty, multi-byte, invalid UTF-8 at either end (each run
    replaced as the one-at-a-time decode replaces it), NULs inside (then the reference decodes), and
    a cut array (the reference's own result or error)."""
    import random
    import struct

    from tsspec.gguf_file import gguf_strings, gguf_strings_reference

    rng = random.Random(7)
    tricky = [b"", b"a", "é€😀".encode(), b"\xe2\x82", b"\x82abc", b"ab\xe2", b"\xc0\xaf", b"\xff\xfe", b"\xf0\x9f\x98",
              "Ġthe".encode(), b" ", b"\n\t"]
    for trial in range(300):
        strings = [rng.choice(tricky) if rng.random() < 0.5 else bytes(rng.randrange(1, 256) for _ in range(rng.randrange(9)))
                   for _ in range(rng.randrange(0, 40))]
        data, offs = _string_array(strings)
        want = gguf_strings_reference(data, offs, len(strings))
        assert gguf_strings(data, offs, len(strings)) == want, strings
        assert want[1] == len(data) - 4
    for strings in ([b"a\x00b", b"c"], [b"\x00"], [b"", b"\x00\x00", b"x"]):  # NULs inside
        data, offs = _string_array(strings)
        assert gguf_strings(data, offs, len(strings)) == gguf_strings_reference(data, offs, len(strings))
        assert gguf_strings(data, offs, len(strings))[0] == [x.decode() for x in strings]
    data, offs = _string_array([b"abc", b"defgh"])
    cut = data[: offs + 8 + 3 + 8 + 2]  # the last string runs past the data
    assert gguf_strings(cut, offs, 2) == gguf_strings_reference(cut, offs, 2)
    with pytest.raises(struct.error):
        gguf_strings(data[: offs + 8 + 3 + 4], offs, 2)  # a length field cut in two
    with pytest.raises(struct.error):
        gguf_strings_reference(data[: offs + 8 + 3 + 4], offs, 2)
    with pytest.raises(struct.error):  # a damaged count is refused, never a list of 2**60 places
        gguf_strings(data, offs, 1 << 60)


@pytest.mark.real_model
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"])
def test_fast_metadata_reader_equals_gguf_py_on_real_files(real_model_path, name):
    path = real_model_path(name)
    assert GGUFFile(path).metadata == _plain_metadata(path)
