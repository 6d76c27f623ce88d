"""What building a tokenizer costs in Python, its ranked merges, is cached by a hash of the file's
tokenizer metadata (issue 51): a hit gives the tokenizer a build gives, and an entry that is
damaged, foreign or unreadable is computed again, never trusted."""

from __future__ import annotations

import warnings

import pytest

from tsspec import tokenizer as tk
from tsspec.tokenizer import Tokenizer, metadata_key, tokenizer_cache_dir

from test_tokenizer import bpe_meta, spm_meta

TEXTS = ["hello world 12", "<|im_start|>hello<think>", "ab bc hi\n\nhi", "", "héllo ✓ 12 12"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TSSPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "tokenizers"


@pytest.fixture
def builds(monkeypatch):
    """How many times the merges were computed rather than read from the cache."""
    count = [0]
    real = tk.compute_merges

    def counting(*a, **k):
        count[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(tk, "compute_merges", counting)
    return count


def same(a: Tokenizer, b: Tokenizer) -> bool:
    for text in TEXTS:
        for special in (False, True):
            ids = a.encode(text, parse_special=special)
            if ids != b.encode(text, parse_special=special) or a.decode(ids) != b.decode(ids):
                return False
    return (a.eos_ids, a._strip_prefix_space, a.bos_id, a.vocab_size) == (b.eos_ids, b._strip_prefix_space,
                                                                           b.bos_id, b.vocab_size)


@pytest.mark.parametrize("meta", [bpe_meta(), spm_meta(), spm_meta(**{"tokenizer.ggml.add_space_prefix": True})],
                         ids=["bpe", "spm", "spm-space-prefix"])
def test_a_cache_hit_is_the_tokenizer_a_build_gives(cache, builds, meta):
    first = Tokenizer.from_metadata(meta)
    assert builds[0] == 1 and tokenizer_cache_dir() == cache
    assert [p.name for p in cache.iterdir()] == [f"{metadata_key(meta)}.merges"]
    again = Tokenizer.from_metadata(meta)
    assert builds[0] == 1  # read, not built
    assert same(first, again)


def test_other_metadata_is_another_entry(cache, builds):
    Tokenizer.from_metadata(bpe_meta())
    other = bpe_meta(**{"tokenizer.ggml.merges": ["h e", "l l", "he ll", "Ġ w", "Ġw o", "1 2"]})  # no "hell o"
    assert metadata_key(other) != metadata_key(bpe_meta())
    tok = Tokenizer.from_metadata(other)
    assert builds[0] == 2 and len(list(cache.iterdir())) == 2
    assert len(tok.encode("hello")) == 2 and len(Tokenizer.from_metadata(bpe_meta()).encode("hello")) == 1


@pytest.mark.parametrize("damage", ["flip", "truncate", "header", "empty", "foreign"])
def test_a_damaged_entry_is_built_again(cache, builds, damage):
    meta = bpe_meta()
    fresh = Tokenizer.from_metadata(meta)
    path = cache / f"{metadata_key(meta)}.merges"
    text = path.read_bytes()
    head, _, body = text.partition(b"\n")
    if damage == "flip":  # still pairs of ids, but not the merges computed: its hash says so
        damaged = head + b"\n" + bytes([body[0] ^ 1]) + body[1:]
    elif damage == "truncate":
        damaged = text[: len(text) // 2]
    elif damage == "header":
        damaged = b"{not json\n" + body
    elif damage == "empty":
        damaged = b""
    else:  # an entry of other metadata under this name
        other = Tokenizer.from_metadata(spm_meta())
        assert other is not None
        damaged = (cache / f"{metadata_key(spm_meta())}.merges").read_bytes()
    assert damaged != text
    path.write_bytes(damaged)
    n = builds[0]
    again = Tokenizer.from_metadata(meta)
    assert builds[0] == n + 1  # rebuilt, not trusted
    assert same(fresh, again)
    assert path.read_bytes() == text  # and the entry rewritten whole


def test_a_cache_that_cannot_be_written_costs_the_build_only(tmp_path, monkeypatch, builds):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    monkeypatch.setenv("TSSPEC_CACHE", str(blocker))
    a, b = Tokenizer.from_metadata(bpe_meta()), Tokenizer.from_metadata(bpe_meta())
    assert builds[0] == 2 and same(a, b)


def test_a_files_warning_is_said_on_every_load(cache):
    meta = bpe_meta(**{"tokenizer.ggml.pre": "mystery"})
    for _ in range(2):  # built, then read from the cache
        with pytest.warns(UserWarning, match="unknown tokenizer.ggml.pre 'mystery'"):
            Tokenizer.from_metadata(meta)


def test_the_cache_keeps_its_newest_entries(cache, monkeypatch):
    monkeypatch.setattr(tk, "CACHE_ENTRIES", 2)
    metas = [bpe_meta(**{"tokenizer.chat_template": "x", "tokenizer.ggml.eos_token_id": i}) for i in (256, 257, 258)]
    with warnings.catch_warnings():
        for m in metas:
            Tokenizer.from_metadata(m)
    assert len(list(cache.glob("*.merges"))) == 2
