"""A load holds one copy of the weights (issue 51): each tensor is read from the file's map as a
view, copied once into what the model keeps, and the map's pages are then let go, so the file's
pages and the model's copy do not both count in the process. None of this may change a value."""

from __future__ import annotations

import numpy as np
import pytest

from tsspec import kernels
from tsspec.gguf_file import GGUFFile, map_span, release_view
from tsspec.models import load_model
from tsspec.weights import GGUFWeight

from tiny import write_tiny_model

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the native kernels hold the file's blocks")


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    """An output head of its own, so the embedding is kept as the file stores it."""
    return write_tiny_model(tmp_path_factory.mktemp("lm") / "u.gguf", "llama", quant="Q4_0", d_model=64,
                            ffn_dim=128, vocab_size=320, tied=False)


def test_a_weight_read_from_the_file_is_a_view_until_it_is_kept(untied):
    g = GGUFFile(untied)
    w = GGUFWeight.from_file(*g.tensor_raw("blk.0.attn_q.weight"), g.tensor_info("blk.0.attn_q.weight").shape)
    assert np.shares_memory(w.raw, g.reader.data) and not w.raw.flags.writeable
    kept = w.for_products()  # repacked into memory of its own
    assert not np.shares_memory(kept.raw, g.reader.data) and kept.packed
    norm = GGUFWeight.from_file(*g.tensor_raw("blk.0.attn_norm.weight"), (1, 64))  # F32: kept as a copy
    mine = norm.for_products()
    assert not np.shares_memory(mine.raw, g.reader.data) and mine.raw.flags.writeable
    np.testing.assert_array_equal(mine.raw, norm.raw)


def test_the_pages_let_go_are_the_tensors_own(untied):
    """A tensor's view is found at its own bytes of the map (a slice of the map is a memmap too: the
    first one met on the way down is not the map's start)."""
    g = GGUFFile(untied)
    for name in ("blk.1.attn_q.weight", "token_embd.weight", "output_norm.weight"):
        t = g._t(name)
        m, start, end = map_span(g.tensor_raw(name)[1])
        assert (start, end) == (int(t.data_offset), int(t.data_offset) + int(t.n_bytes)) and m is g.reader.data.base
    assert map_span(g.reader.data)[1:] == (0, len(g.reader.data.base))
    assert map_span(np.array(g.tensor_raw("blk.1.attn_q.weight")[1])) is None


def test_letting_the_pages_go_changes_no_value(untied):
    g = GGUFFile(untied)
    before = {n: g.tensor(n).copy() for n in g.tensor_names()}
    assert g.release_pages(["blk.0.attn_q.weight", "token_embd.weight"]) and g.release_pages()
    for n, v in before.items():
        np.testing.assert_array_equal(g.tensor(n), v)  # faulted back in from the file, same bytes


def test_the_embedding_read_through_the_released_map_is_the_dense_table(untied):
    m = load_model(untied)  # releases the map's pages at the end of the load
    assert m.lm_head.fmt == "gguf" and m.embed.gguf is not None and not m.embed.gguf.packed
    dense = GGUFFile(untied).tensor("token_embd.weight")
    rows = [0, 5, 17, 319, 5]
    np.testing.assert_array_equal(m.embed[rows].numpy(), dense[rows])


def test_a_model_loaded_with_its_pages_let_go_decodes_as_one_that_kept_them(untied, monkeypatch):
    from tsspec.sampling import Sampler
    from tsspec.spec.loop import decode

    released = decode(load_model(untied), Sampler(), [1, 2, 3, 4], 12)
    monkeypatch.setattr(GGUFFile, "release_pages", lambda self, names=None: False)
    kept = load_model(untied)
    assert decode(kept, Sampler(), [1, 2, 3, 4], 12) == released


def test_a_repack_in_stretches_gives_the_repack_whole(untied, monkeypatch):
    """The loader's repack reports each stretch of rows as it is copied (and the file's pages behind
    it are let go); done in stretches, it gives the same bytes as in one piece."""
    g = GGUFFile(untied)
    kind, flat = g.tensor_raw("token_embd.weight")
    rows = flat.reshape(g.tensor_info("token_embd.weight").shape[0], -1)
    whole = kernels.repack(kind, np.array(rows), 64)
    monkeypatch.setattr(kernels, "REPACK_CHUNK_BYTES", rows.shape[1] * 7)  # 7 rows a stretch
    seen = []
    parts = kernels.repack(kind, rows, 64, done=lambda r: (seen.append(len(r)), release_view(r)))
    np.testing.assert_array_equal(parts, whole)
    assert sum(seen) == rows.shape[0] and max(seen) == 7 and len(seen) == -(-rows.shape[0] // 7)
    assert not release_view(np.array(rows))  # never memory of our own: released, it would read as zeros
