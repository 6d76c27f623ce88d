"""The load-time validator: pure checks fed hand-written metadata and tensor records, and the files
the CLI refuses by name (``tsspec info`` included) instead of failing inside a forward."""

from __future__ import annotations

import math
import time

import pytest
from clirun import run
from tiny import rewrite_metadata, write_tiny_model
from tsspec.errors import ModelFileError
from tsspec.models import ARCHITECTURES, arch_module
from tsspec.validate import TensorRecord, check_hparams, check_layout, check_tensors, expected_tensors

F = "m.gguf"


def tables(arch):
    """The architecture's own tables (``TABLES`` in its ``tsspec/models`` file)."""
    return arch_module(arch).TABLES


def check(arch, hp, ts):
    """``check_tensors`` against what an ``arch`` trunk loads, as ``validate.check_model`` runs it."""
    check_tensors(F, hp, ts, expected_tensors(tables(arch), hp, set(ts)))


def rec(name, shape, offset, n_bytes=None, type_name="F32"):
    return TensorRecord(name, shape, type_name, offset, n_bytes if n_bytes is not None else 4 * math.prod(shape))


# ----------------------------------------------------------------------------- layout


def test_layout_accepts_aligned_back_to_back_tensors():
    check_layout(F, [rec("a", (8,), 0), rec("b", (4, 4), 32), rec("c", (3,), 96)], 100, 100 + 96 + 32, 32)


@pytest.mark.parametrize("tensors, size, needle", [
    ([rec("a", (8,), 0), rec("b", (8,), 0)], 132, "a .*overlaps tensor b at offset 0"),
    ([rec("a", (8,), 0), rec("b", (8,), 96)], 228, "a is F32 .*32 bytes.* but the next tensor starts 96 bytes after it"),
    ([rec("a", (8,), 0), rec("b", (8,), (1 << 64) - 32)], 164, "b .*ends at byte .*past the end of the file"),
    ([rec("a", (8,), 0), rec("b", (8,), 33)], 200, "b starts at data offset 33, not a multiple"),
    ([rec("a", (8,), 0), rec("b", (0, 8), 32)], 164, r"b has shape \(0, 8\)"),
    ([rec("a", (8,), 0), rec("b", (8,), 32)], 100 + 64 + 64, "b is F32 .*64 more bytes"),
])
def test_layout_refuses(tensors, size, needle):
    with pytest.raises(ModelFileError, match=needle):
        check_layout(F, tensors, 100, size, 32)


def test_layout_padding_must_be_zeros():
    # a 4-element F32 tensor relabelled F16: 8 bytes of its data land in what is now padding
    data = bytes(100) + bytes(range(1, 17)) + bytes(16) + bytes(32)
    tensors = [rec("a", (4,), 0, n_bytes=8, type_name="F16"), rec("b", (8,), 32)]
    with pytest.raises(ModelFileError, match="a is F16"):
        check_layout(F, tensors, 100, len(data), 32, data)
    clean = bytes(100) + bytes(range(1, 9)) + bytes(24) + bytes(32)
    check_layout(F, tensors, 100, len(clean), 32, clean)


# ----------------------------------------------------------------------------- hyper-parameters


def meta(**over):
    m = {"llama.block_count": 2, "llama.embedding_length": 64, "llama.feed_forward_length": 128,
         "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2, "llama.vocab_size": 300,
         "llama.rope.freq_base": 10000.0, "llama.attention.layer_norm_rms_epsilon": 1e-5}
    for k, v in over.items():
        key = "llama." + k.replace("__", ".")
        if v is None:
            m.pop(key)
        else:
            m[key] = v
    return m


def test_hparams_of_a_good_file():
    hp = check_hparams(F, tables("llama"), meta(), 20)
    assert (hp["n_layers"], hp["d"], hp["q"], hp["kv"], hp["hd"], hp["ffn"], hp["vocab"]) == (2, 64, 64, 32, 16, 128, 300)


@pytest.mark.parametrize("over, needle", [
    ({"block_count": "four"}, "block_count should be an integer, found str 'four'"),
    ({"block_count": [1, 2]}, "block_count should be an integer, found list"),
    ({"block_count": True}, "block_count should be an integer, found bool"),
    ({"block_count": 0}, r"block_count should be in \[1,"),
    ({"embedding_length": -64}, "embedding_length should be in"),
    ({"attention__head_count": 0}, "head_count should be in"),
    ({"attention__head_count_kv": 3}, "4 attention heads do not divide into 3 KV heads"),
    ({"attention__head_count_kv": [2, 1]}, "differs between layers"),
    ({"attention__key_length": 0}, "key_length should be in"),
    ({"embedding_length": 2, "attention__head_count": 4}, "smaller than the head count"),
    ({"attention__layer_norm_rms_epsilon": 0.0}, "epsilon should be in"),
    ({"attention__layer_norm_rms_epsilon": float("nan")}, "epsilon should be a finite number"),
    ({"rope__freq_base": float("inf")}, "freq_base should be a finite number"),
    ({"rope__freq_base": -1.0}, "freq_base should be in"),
    ({"rope__freq_base": "1e4"}, "freq_base should be a number, found str"),
    ({"rope__dimension_count": 7}, "dimension_count should be even"),
    ({"rope__dimension_count": 0}, "dimension_count should be in"),
    ({"rope__dimension_count": 32}, r"dimension_count should be in \[2, 16\]"),
    ({"feed_forward_length": None}, "missing metadata key 'llama.feed_forward_length'"),
    ({"vocab_size": 299}, "vocab_size is 299, but the tokenizer has 300 tokens"),
])
def test_hparams_refused_by_key(over, needle):
    m = meta(**over)
    m["tokenizer.ggml.tokens"] = ["t"] * 300
    with pytest.raises(ModelFileError, match=needle):
        check_hparams(F, tables("llama"), m, 20)


def test_padding_rows_beyond_the_token_list_are_allowed():
    m = meta(vocab_size=304)
    m["tokenizer.ggml.tokens"] = ["t"] * 300
    assert check_hparams(F, tables("llama"), m, 20)["vocab"] == 304  # token_embd must then have 304 rows


def test_huge_block_count_is_refused_before_any_per_layer_list():
    t = time.perf_counter()
    with pytest.raises(ModelFileError, match="block_count is 4194304, but the file holds only 20 tensors"):
        check_hparams(F, tables("llama"), meta(block_count=1 << 22), 20)
    with pytest.raises(ModelFileError, match="block_count should be in .* found 1099511627776"):
        check_hparams(F, tables("llama"), meta(block_count=1 << 40), 20)
    assert time.perf_counter() - t < 0.5


def test_gemma_window_and_hybrid_sizes():
    g = {k.replace("llama.", "gemma3."): v for k, v in meta().items()}
    with pytest.raises(ModelFileError, match="sliding_window should be in"):
        check_hparams(F, tables("gemma3"), {**g, "gemma3.attention.sliding_window": 0}, 20)
    with pytest.raises(ModelFileError, match="sliding_window_pattern should be in"):
        check_hparams(F, tables("gemma3"), {**g, "gemma3.attention.sliding_window_pattern": 0}, 20)
    h = {k.replace("llama.", "qwen35."): v for k, v in meta().items()}
    h.update({"qwen35.ssm.conv_kernel": 4, "qwen35.ssm.state_size": 16, "qwen35.ssm.group_count": 2,
              "qwen35.ssm.time_step_rank": 4, "qwen35.ssm.inner_size": 64})
    assert check_hparams(F, tables("qwen35"), h, 40)["conv_dim"] == 2 * 2 * 16 + 64
    with pytest.raises(ModelFileError, match="4 value heads .* do not divide into 3 key heads"):
        check_hparams(F, tables("qwen35"), {**h, "qwen35.ssm.group_count": 3}, 40)
    with pytest.raises(ModelFileError, match="inner_size 66 is not a multiple"):
        check_hparams(F, tables("qwen35"), {**h, "qwen35.ssm.inner_size": 66}, 40)
    with pytest.raises(ModelFileError, match="leaves no layers beside 2 NextN"):
        check_hparams(F, tables("qwen35"), {**h, "qwen35.nextn_predict_layers": 2}, 40)


# ----------------------------------------------------------------------------- tensors


def good_tensors(arch="llama"):
    hp = check_hparams(F, tables(arch), meta(), 20) if arch == "llama" else None
    return hp, {n: rec(n, shape, 0) for n, (shape, optional) in expected_tensors(tables(arch), hp, set()).items()
                if not optional}


def test_tensor_table_of_a_good_file_passes():
    hp, ts = good_tensors()
    check("llama", hp, ts)


@pytest.mark.parametrize("name, shape, needle", [
    ("output.weight", (64, 300), r"output.weight is \(64, 300\), expected \(300, 64\)"),  # transposed head
    ("token_embd.weight", (301, 64), r"token_embd.weight is \(301, 64\), expected \(300, 64\)"),
    ("blk.1.attn_k.weight", (64, 64), r"blk.1.attn_k.weight is \(64, 64\), expected \(32, 64\)"),
    ("blk.0.ffn_down.weight", (64, 256), r"ffn_down.weight is \(64, 256\), expected \(64, 128\)"),
    ("blk.0.attn_norm.weight", (63,), r"attn_norm.weight is \(63,\), expected \(64,\)"),
])
def test_tensor_shape_disagreeing_with_metadata(name, shape, needle):
    hp, ts = good_tensors()
    ts[name] = rec(name, shape, 0)
    with pytest.raises(ModelFileError, match=needle):
        check("llama", hp, ts)


def test_tensor_type_and_presence():
    hp, ts = good_tensors()
    ts["blk.0.attn_q.weight"] = rec("blk.0.attn_q.weight", (64, 64), 0, type_name="I32")
    with pytest.raises(ModelFileError, match="attn_q.weight has type I32"):
        check("llama", hp, ts)
    hp, ts = good_tensors()
    del ts["blk.1.ffn_up.weight"]
    with pytest.raises(ModelFileError, match="missing tensor 'blk.1.ffn_up.weight'"):
        check("llama", hp, ts)


def test_qwen2_bias_of_the_wrong_length():
    m = {k.replace("llama.", "qwen2."): v for k, v in meta().items()}
    hp = check_hparams(F, tables("qwen2"), m, 40)
    ts = {n: rec(n, shape, 0) for n, (shape, _) in expected_tensors(tables("qwen2"), hp, set()).items()}
    check("qwen2", hp, ts)
    ts["blk.0.attn_k.bias"] = rec("blk.0.attn_k.bias", (64,), 0)
    with pytest.raises(ModelFileError, match=r"attn_k.bias is \(64,\), expected \(32,\)"):
        check("qwen2", hp, ts)


# ----------------------------------------------------------------------------- through the CLI


def one_error(r, needle):
    assert r.exit_code == 3, r.output
    lines = [x for x in r.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], r.stderr


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("validate") / "good.gguf", "qwen3")


def _set(key, value):
    def edit(kv):
        _, vtype, sub = kv[key]
        kv[key] = (value, vtype, sub)
    return edit


@pytest.mark.parametrize("key, value, needle", [
    ("qwen3.attention.key_length", 8, "blk.0.attn_q.weight is (64, 64), expected (32, 64)"),
    ("qwen3.attention.head_count", 0, "qwen3.attention.head_count should be in"),
    ("qwen3.rope.freq_base", float("nan"), "qwen3.rope.freq_base should be a finite number"),
    ("qwen3.attention.layer_norm_rms_epsilon", -1.0, "epsilon should be in"),
])
def test_info_and_generate_say_what_is_wrong(good, tmp_path, key, value, needle):
    bad = rewrite_metadata(good, tmp_path / "bad.gguf", _set(key, value))
    for args in (["info", str(bad)], ["info", str(bad), "--no-load"],
                 ["generate", "-m", str(bad), "-p", "hi", "-n", "2"]):
        one_error(run(*args), needle)


# ----------------------------------------------------------------------------- the architectures' own tables


def test_every_architecture_declares_its_facts_in_its_file():
    """A new architecture is its module and one registry line: the module carries its tables, its
    backend eligibility and its loader, and the tables name the architecture they describe."""
    for arch in ARCHITECTURES:
        mod = arch_module(arch)
        assert mod.TABLES.arch == arch and isinstance(mod.TRITON, bool), arch
        assert callable(mod.config) and callable(mod.load), arch


def _tiny_file(tmp_path, arch, mtp=False):
    """The tiny writer's file of ``arch`` (a new architecture adds its writer here)."""
    if arch in ("qwen35", "qwen3next"):
        from tiny_hybrid import write_hybrid

        return write_hybrid(tmp_path / f"{arch}.gguf", arch, mtp=mtp)[0]
    return write_tiny_model(tmp_path / f"{arch}.gguf", arch)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_the_loader_assumes_the_defaults_validate_checks(tmp_path, arch):
    """Every key with a default, left out of a file, configures the trunk exactly as the file that
    states the default (``Key.default``) does: the loader and the checker read one set of facts."""
    import gguf

    from tsspec.gguf_file import GGUFFile
    from tsspec.validate import TRUNK_KEYS

    mod = arch_module(arch)
    defaulted = [k for k in TRUNK_KEYS + mod.TABLES.keys if k.default is not None]
    src = _tiny_file(tmp_path, arch)

    def without(kv):
        for k in defaulted:
            kv.pop(f"{arch}.{k.suffix}", None)

    def stated(kv):
        for k in defaulted:
            vtype = gguf.GGUFValueType.FLOAT64 if k.kind is float else gguf.GGUFValueType.UINT32
            kv[f"{arch}.{k.suffix}"] = (k.default, vtype, vtype)

    configs = []
    for name, edit in (("without", without), ("stated", stated)):
        g = GGUFFile(rewrite_metadata(src, tmp_path / f"{name}.gguf", edit))
        assert all((f"{arch}.{k.suffix}" in g.metadata) == (name == "stated") for k in defaulted)
        configs.append(mod.config(g))
    assert configs[0] == configs[1]


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_the_tiny_writer_and_the_tables_agree(tmp_path, arch):
    """Each architecture has a tiny writer (``tiny.py``, ``tiny_hybrid.py``), and every tensor it
    writes, as the real converter does, is one its tables check: none is loaded unchecked."""
    from tsspec.gguf_file import GGUFFile
    from tsspec.models import validate_model

    g = GGUFFile(_tiny_file(tmp_path, arch, mtp=True))
    hp = validate_model(g)
    expected = expected_tensors(tables(arch), hp, set(g.tensor_names()))
    assert set(g.tensor_names()) <= set(expected)
    assert {n for n, (_, optional) in expected.items() if not optional} <= set(g.tensor_names())
