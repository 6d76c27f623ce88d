"""Tokenizer tests: tiny synthetic vocabularies (fast) and the four real models against fixtures
recorded from an independent reference (``scripts/record_tokenizer_reference.py``)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from tsspec.errors import ModelFileError
from tsspec.tokenizer import Tokenizer, _byte_level_alphabet

FIXTURES = Path(__file__).parent / "fixtures" / "tokenizer"
REAL_MODELS = ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]

NORMAL, CONTROL, USER_DEFINED, BYTE = 1, 3, 4, 6


# -- synthetic byte-level BPE ------------------------------------------------------------------


def bpe_meta(**overrides) -> dict:
    """A byte-level vocabulary: the 256 byte symbols, a few merges, control and user tokens."""
    alphabet = [_byte_level_alphabet()[0][b] for b in range(256)]
    merged = ["he", "ll", "hell", "hello", "Ġw", "Ġwo", "12"]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = alphabet + merged + specials + ["<think>"]
    types = [NORMAL] * (len(alphabet) + len(merged)) + [CONTROL] * len(specials) + [USER_DEFINED]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": ["h e", "l l", "he ll", "hell o", "Ġ w", "Ġw o", "1 2"],
        "tokenizer.ggml.bos_token_id": tokens.index("<|endoftext|>"),
        "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>"),
        "tokenizer.chat_template": "{{ messages[0]['content'] }}",
    }
    meta.update(overrides)
    return meta


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return Tokenizer.from_metadata(bpe_meta())


def tid(tok: Tokenizer, text: str) -> int:
    return tok.hf.token_to_id(text)


def test_bpe_merges_and_round_trip(bpe):
    assert bpe.encode("hello") == [tid(bpe, "hello")]
    ids = bpe.encode("hello wo")
    assert ids == [tid(bpe, "hello"), tid(bpe, "Ġwo")]
    assert bpe.decode(ids) == "hello wo"
    assert bpe.token_text(tid(bpe, "Ġwo")) == " wo"
    assert bpe.encode("") == []


def test_bpe_attributes(bpe):
    assert bpe.vocab_size == 256 + 7 + 3 + 1
    assert bpe.add_bos is False and bpe.add_eos is False  # byte-level default: no BOS
    assert bpe.encode("hello") == bpe.encode("hello", add_special=False)
    assert bpe.eos_ids == {tid(bpe, "<|im_end|>"), tid(bpe, "<|endoftext|>")}
    assert bpe.chat_template == "{{ messages[0]['content'] }}"


def test_special_tokens_parsed_only_when_asked(bpe):
    start, end = tid(bpe, "<|im_start|>"), tid(bpe, "<|im_end|>")
    ids = bpe.encode("<|im_start|>hello<|im_end|>")
    assert ids == [start, tid(bpe, "hello"), end]
    plain = bpe.encode("<|im_start|>hello", parse_special=False)
    assert start not in plain and bpe.decode(plain) == "<|im_start|>hello"
    # The flag does not stick: the next default call parses specials again.
    assert bpe.encode("<|im_start|>")[0] == start


def test_user_defined_tokens_always_whole(bpe):
    think = tid(bpe, "<think>")
    assert bpe.encode("<think>hello", parse_special=False) == [think, tid(bpe, "hello")]


def test_decode_skip_special(bpe):
    ids = bpe.encode("<|im_start|>hello<|im_end|>")
    assert bpe.decode(ids) == "<|im_start|>hello<|im_end|>"
    assert bpe.decode(ids, skip_special=True) == "hello"


def test_pre_tokenizer_follows_pre_name():
    # qwen2 splits digits one by one, so the "1 2" merge never applies; gpt2 keeps "12" together.
    qwen = Tokenizer.from_metadata(bpe_meta())
    gpt2 = Tokenizer.from_metadata(bpe_meta(**{"tokenizer.ggml.pre": "gpt2"}))
    smollm = Tokenizer.from_metadata(bpe_meta(**{"tokenizer.ggml.pre": "smollm"}))
    assert qwen.encode("12") == [tid(qwen, "1"), tid(qwen, "2")]
    assert smollm.encode("12") == [tid(smollm, "1"), tid(smollm, "2")]
    assert gpt2.encode("12") == [tid(gpt2, "12")]


def test_unknown_pre_falls_back_to_gpt2_with_warning():
    with pytest.warns(UserWarning, match="unknown tokenizer.ggml.pre 'mystery'"):
        tok = Tokenizer.from_metadata(bpe_meta(**{"tokenizer.ggml.pre": "mystery"}))
    assert tok.encode("12") == [tid(tok, "12")]


def test_add_bos_and_eos():
    tok = Tokenizer.from_metadata(
        bpe_meta(**{"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": True})
    )
    bos, eos = tid(tok, "<|endoftext|>"), tid(tok, "<|im_end|>")
    assert tok.encode("hello") == [bos, tid(tok, "hello"), eos]
    assert tok.encode("hello", add_special=False) == [tid(tok, "hello")]
    assert tok.encode("") == [bos, eos]


def test_eot_token_id_counts_as_eos():
    meta = bpe_meta(**{"tokenizer.ggml.eot_token_id": 104})
    assert 104 in Tokenizer.from_metadata(meta).eos_ids


def test_stream_holds_split_multibyte_char(bpe):
    ids = bpe.encode("é€")  # 2 + 3 bytes, one byte-level token per byte
    assert len(ids) == 5
    stream = bpe.stream()
    out = [stream.push(i) for i in ids]
    assert out == ["", "é", "", "", "€"]
    assert stream.flush() == ""


def test_stream_flush_reports_truncated_char(bpe):
    stream = bpe.stream()
    assert stream.push(bpe.encode("é")[0]) == ""
    assert stream.flush() == "\ufffd"
    assert bpe.decode(bpe.encode("é")[:1]) == "\ufffd"


# -- synthetic SentencePiece -------------------------------------------------------------------


def spm_meta(**overrides) -> dict:
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    normal = {"▁": -1.0, "a": -2.0, "b": -2.0, "c": -2.0, "h": -2.0, "i": -2.0,
              "ab": -5.0, "bc": -3.0, "▁h": -4.0, "hi": -6.0, "▁hi": -1.5}
    tokens = ["<unk>", "<s>", "</s>", "<start_of_turn>", "<end_of_turn>", "\n\n", *byte_tokens, *normal]
    types = [2, CONTROL, CONTROL, CONTROL, CONTROL, USER_DEFINED] + [BYTE] * 256 + [NORMAL] * len(normal)
    scores = [0.0] * (6 + 256) + list(normal.values())
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_space_prefix": False,
    }
    meta.update(overrides)
    return meta


@pytest.fixture(scope="module")
def spm() -> Tokenizer:
    return Tokenizer.from_metadata(spm_meta())


def test_spm_merges_by_score(spm):
    # "bc" outscores "ab", so "abc" is a + bc (llama.cpp merges the best-scoring pair first).
    assert spm.encode("abc", add_special=False) == [tid(spm, "a"), tid(spm, "bc")]
    better_ab = spm_meta()
    pairs = zip(better_ab["tokenizer.ggml.tokens"], better_ab["tokenizer.ggml.scores"])
    better_ab["tokenizer.ggml.scores"] = [-0.5 if t == "ab" else s for t, s in pairs]
    tok = Tokenizer.from_metadata(better_ab)
    assert tok.encode("abc", add_special=False) == [tid(tok, "ab"), tid(tok, "c")]


def test_spm_spaces_bos_and_defaults(spm):
    assert spm.add_bos is True  # SentencePiece vocabularies add BOS unless the file says otherwise
    assert spm.encode(" hi") == [1, tid(spm, "▁hi")]
    assert spm.decode(spm.encode(" hi")) == "<s> hi"
    assert spm.decode(spm.encode(" hi"), skip_special=True) == " hi"
    assert spm.eos_ids == {2, tid(spm, "<end_of_turn>")}


def test_spm_add_space_prefix():
    tok = Tokenizer.from_metadata(spm_meta(**{"tokenizer.ggml.add_space_prefix": True}))
    assert tok.encode("hi", add_special=False) == [tid(tok, "▁hi")]
    # After a special token the next fragment gets its own prefix, as in llama.cpp.
    assert tok.encode("<start_of_turn>hi", add_special=False) == [3, tid(tok, "▁hi")]
    assert tok.decode(tok.encode("hi"), skip_special=True) == "hi"


def test_spm_byte_fallback_and_stream(spm):
    ids = spm.encode("a€", add_special=False)  # "€" is not in the vocabulary: 3 byte tokens
    assert ids == [tid(spm, "a"), tid(spm, "<0xE2>"), tid(spm, "<0x82>"), tid(spm, "<0xAC>")]
    stream = spm.stream()
    assert [stream.push(i) for i in ids] == ["a", "", "", "€"]
    assert spm.decode(ids) == "a€"


def test_spm_special_and_user_defined(spm):
    ids = spm.encode("<start_of_turn>hi\n\nab", add_special=False)
    assert ids == [3, tid(spm, "hi"), 5, tid(spm, "ab")]
    plain = spm.encode("<start_of_turn>\n\n", add_special=False, parse_special=False)
    assert 3 not in plain and plain[-1] == 5


# -- bad metadata ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"tokenizer.ggml.tokens": None}, "tokenizer.ggml.tokens"),
        ({"tokenizer.ggml.model": None}, "tokenizer.ggml.model"),
        ({"tokenizer.ggml.model": "bert"}, "tokenizer.ggml.model"),
        ({"tokenizer.ggml.merges": None}, "tokenizer.ggml.merges"),
        ({"tokenizer.ggml.token_type": [1, 1]}, "tokenizer.ggml.token_type"),
        ({"tokenizer.ggml.token_type": "flip"}, r"tokenizer.ggml.token_type[3] is 32769"),
        ({"tokenizer.ggml.eos_token_id": 10**6}, "tokenizer.ggml.eos_token_id"),
        ({"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.bos_token_id": None},
         "tokenizer.ggml.bos_token_id"),
    ],
)
def test_bad_bpe_metadata(change, key):
    meta = {k: v for k, v in {**bpe_meta(), **change}.items() if v is not None}
    if change.get("tokenizer.ggml.token_type") == "flip":  # one bit flipped in a type: 1 -> 32769
        meta["tokenizer.ggml.token_type"] = [1] * len(meta["tokenizer.ggml.tokens"])
        meta["tokenizer.ggml.token_type"][3] = 32769
    with pytest.raises(ModelFileError, match=re.escape(key)) as err:
        Tokenizer.from_metadata(meta)
    assert "\n" not in str(err.value)


def test_vocabulary_tokenizers_cannot_build_is_a_model_file_error():
    # a merge whose result is not a token: tokenizers raises a plain Exception
    meta = bpe_meta()
    meta["tokenizer.ggml.merges"] = meta["tokenizer.ggml.merges"] + ["\u0120 zz"]
    with pytest.raises(ModelFileError, match="does not make a tokenizer"):
        Tokenizer.from_metadata(meta)
    with pytest.raises(ModelFileError, match="token_type is not a list of integers"):
        Tokenizer.from_metadata(bpe_meta(**{"tokenizer.ggml.token_type": ["x"] * len(meta["tokenizer.ggml.tokens"])}))
    n = len(meta["tokenizer.ggml.tokens"])
    with pytest.raises(ModelFileError, match="token_type is not a list of integers"):  # a bool is no type
        Tokenizer.from_metadata(bpe_meta(**{"tokenizer.ggml.token_type": [1] * (n - 1) + [True]}))


def test_the_vocabulary_checks_keep_their_meaning():
    """The one-pass checks (``_all_of``) accept exactly what the per-item ones did: a str subclass is
    a token text, a bool is not an integer, an int subclass is; the token map keeps the first id of a
    repeated text."""
    from tsspec.tokenizer import _all_of, _token_map

    class Text(str):
        pass

    class Small(int):
        pass

    meta = bpe_meta()
    toks = meta["tokenizer.ggml.tokens"]
    assert Tokenizer.from_metadata({**meta, "tokenizer.ggml.tokens": [Text(t) for t in toks]}).encode("hello") == \
        Tokenizer.from_metadata(meta).encode("hello")
    types = [Small(1)] * len(toks)
    assert Tokenizer.from_metadata(bpe_meta(**{"tokenizer.ggml.token_type": types})).vocab_size == len(toks)
    assert _all_of([1, 2], (int,)) and not _all_of([1, True], (int,)) and _all_of([1, 2.5], (int, float))
    assert _token_map(["a", "b", "a", "c"]) == {"a": 0, "b": 1, "c": 3}


def test_tokenizers_panic_is_wrapped_but_interrupts_pass():
    from tsspec.tokenizer import _tokenizers_call

    class PanicException(BaseException):  # what pyo3 raises for a Rust panic
        pass

    def panic():
        raise PanicException("called `Option::unwrap()` on a `None` value")

    with pytest.raises(ModelFileError, match="tokenizers panicked: called `Option::unwrap"):
        _tokenizers_call(panic)

    def interrupt():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _tokenizers_call(interrupt)


def test_bad_spm_metadata():
    meta = spm_meta()
    del meta["tokenizer.ggml.scores"]
    with pytest.raises(ModelFileError, match=r"tokenizer\.ggml\.scores"):
        Tokenizer.from_metadata(meta)
    with pytest.raises(ModelFileError, match=r"tokenizer\.ggml\.scores"):
        Tokenizer.from_metadata(spm_meta(**{"tokenizer.ggml.scores": [0.0]}))


# -- real models -------------------------------------------------------------------------------

_loaded: dict[str, Tokenizer] = {}


@pytest.fixture(params=REAL_MODELS)
def real(request, real_model_path) -> tuple[Tokenizer, dict]:
    name = request.param
    if name not in _loaded:
        _loaded[name] = Tokenizer.from_gguf(real_model_path(name))
    fixture = json.loads((FIXTURES / f"{name}.json").read_text(encoding="utf-8"))
    return _loaded[name], fixture


@pytest.mark.real_model
def test_real_encode_matches_reference(real):
    tok, fixture = real
    wrong = [(c["text"], c["ids"], tok.encode(c["text"], add_special=False))
             for c in fixture["cases"] if tok.encode(c["text"], add_special=False) != c["ids"]]
    assert not wrong
    assert tok.encode("") == fixture["empty_with_special"]


@pytest.mark.real_model
def test_real_decode_round_trips(real):
    tok, fixture = real
    for case in fixture["cases"]:
        assert tok.decode(case["ids"]) == case["text"]


@pytest.mark.real_model
def test_real_stream_equals_full_decode(real):
    tok, fixture = real
    ids = [i for case in fixture["cases"] for i in case["ids"]]
    stream = tok.stream()
    pieces = [stream.push(i) for i in ids]
    pieces.append(stream.flush())
    assert "".join(pieces) == tok.decode(ids) == "".join(c["text"] for c in fixture["cases"])
    assert not any("\ufffd" in p for p in pieces)  # never half a character


@pytest.mark.real_model
def test_real_chat_tokens_are_single_ids(real):
    tok, fixture = real
    marker = "<start_of_turn>" if fixture["model"].startswith("gemma") else "<|im_start|>"
    ids = tok.encode(marker, add_special=False)
    assert len(ids) == 1 and tok.token_text(ids[0]) == marker
    assert len(tok.encode(marker, add_special=False, parse_special=False)) > 1
    assert tok.eos_id in tok.eos_ids


@pytest.mark.real_model
def test_real_eos_sets(real_model_path):
    expected = {"smollm2-135m": {"<|im_end|>", "<|endoftext|>"},
                "gemma3-270m": {"<eos>", "<end_of_turn>"},
                "qwen2.5-coder-0.5b": {"<|im_end|>", "<|endoftext|>"}}
    for name, texts in expected.items():
        tok = _loaded.get(name) or Tokenizer.from_gguf(real_model_path(name))
        assert {tok.token_text(i) for i in tok.eos_ids} == texts


@pytest.mark.real_model
def test_gemma_builds_fast(real_model_path):
    from tsspec.gguf_file import read_metadata

    meta = read_metadata(real_model_path("gemma3-270m"))
    start = time.perf_counter()
    tok = Tokenizer.from_metadata(meta)
    assert time.perf_counter() - start < 10  # 262144 tokens; about 1.5 s here
    assert tok.vocab_size == 262144


@pytest.mark.parametrize("make", [bpe_meta, spm_meta])
def test_min_tokens_never_exceeds_the_encoding(make):
    import random

    tok = Tokenizer.from_metadata(make())
    rng = random.Random(1)
    alphabet = "ab cd\u00e9\u4e2d\U0001f600\n\t<>"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 60)))
        assert tok.min_tokens(text) <= len(tok.encode(text, add_special=False)), text
