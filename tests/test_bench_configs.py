"""tsspec.bench.configs: command-line specs, TOML files, baseline resolution, one-line errors."""

from __future__ import annotations

import re

import pytest

from tsspec.bench.configs import (
    BenchConfig,
    load_config_file,
    parse_config,
    parse_configs,
    resolve_configs,
)
from tsspec.errors import BadInput


def test_plain():
    assert parse_config("plain") == BenchConfig(name="plain", algo="plain")


def test_ngram_with_draft():
    c = parse_config("ngram:draft=4")
    assert (c.name, c.algo, c.draft) == ("ngram:draft=4", "ngram", 4)
    assert parse_config("ngram").name == "ngram"


def test_named_spec():
    c = parse_config("ng4=ngram:draft=4")
    assert (c.name, c.algo, c.draft) == ("ng4", "ngram", 4)


def test_draft_model_full():
    c = parse_config("draft-model:path=/x.gguf,draft=3,pmin=0.5")
    assert c.algo == "draft-model"
    assert c.draft_model == "/x.gguf"
    assert c.draft == 3
    assert c.pmin == 0.5
    # the '=' inside path= is never taken as NAME=
    assert c.name == "draft-model:path=/x.gguf,draft=3,pmin=0.5"


def test_named_draft_model_with_model_key_and_options():
    c = parse_config("dm=draft-model:model=/m/small.gguf,accept=residual,adaptive=true")
    assert c.name == "dm"
    assert c.draft_model == "/m/small.gguf"
    assert c.accept == "residual"
    assert c.adaptive is True


@pytest.mark.parametrize("spec,needle", [
    ("ngram:drfat=4", "unknown option 'drfat' (did you mean draft?)"),
    ("draft-model:model=/m/d.gguf,temp=0.7", "unknown option 'temp'"),
    ("ngram:PMIN=0.5,bogus=1", "unknown option 'bogus'"),
])
def test_unknown_option_is_refused(spec, needle):
    """A typo must not silently run the defaults (it did: ngram:drfat=4 ran draft=8)."""
    with pytest.raises(BadInput, match=re.escape(needle)):
        parse_config(spec)


def test_draft_head_and_block():
    assert parse_config("draft-head").algo == "draft-head"
    b = parse_config("block:draft=8")
    assert (b.algo, b.draft) == ("block", 8)
    assert parse_config("draft_head").algo == "draft-head"  # underscores tolerated


@pytest.mark.parametrize("value,expected", [("0", False), ("1", True), ("false", False), ("True", True)])
def test_adaptive_bool(value, expected):
    assert parse_config(f"ngram:adaptive={value}").adaptive is expected


def test_spec_round_trip():
    c = parse_config("x=draft-model:path=/x.gguf,draft=3,pmin=0.5,accept=match,adaptive=0")
    again = parse_config(f"x={c.spec()}")
    assert again == c


@pytest.mark.parametrize(
    "spec,needle",
    [
        ("", "empty"),
        ("warp", "unknown algorithm"),
        ("ngram:draft=0", "draft"),
        ("ngram:draft=65", "draft"),
        ("ngram:draft=four", "draft"),
        ("ngram:pmin=1.5", "pmin"),
        ("ngram:pmin=x", "pmin"),
        ("ngram:accept=maybe", "accept"),
        ("ngram:adaptive=perhaps", "adaptive"),
        ("ngram:draft", "key=value"),
        ("ngram:draft=", "draft"),
        ("ngram:", "nothing after"),
        ("ngram:draft=2,draft=3", "twice"),
        ("draft-model:path=/a,model=/b", "twice"),
        ("plain:draft=4", "plain takes no drafting options"),
        ("x y=ngram", "bad config name"),
        ("ngram,adaptive=0", "options go after a ':' (ngram:adaptive=0)"),
        ("draft_head,path=h.gguf,pmin=0.5", "options go after a ':' (draft_head:path=h.gguf,pmin=0.5)"),
        ("a,b=ngram", "bad config name"),  # not an algorithm before the comma: a bad name
        ("fast=ngram,draft=4", "options go after a ':' (fast=ngram:draft=4)"),
        ("fast=", "nothing after"),
        ("0\n=", "nothing after '0\\n='"),  # a name with a newline: quoted, the message stays one line
    ],
)
def test_bad_specs_raise_one_line_bad_input(spec, needle):
    with pytest.raises(BadInput) as exc:
        parse_config(spec)
    msg = str(exc.value)
    assert needle in msg
    assert "\n" not in msg


def test_duplicate_names_rejected():
    with pytest.raises(BadInput, match="twice"):
        parse_configs(["ngram", "ngram"])
    assert [c.name for c in parse_configs(["a=ngram", "b=ngram"])] == ["a", "b"]


def test_baseline_defaults_to_plain():
    out = resolve_configs(parse_configs(["ngram", "block:draft=8"]))
    assert out[0] == BenchConfig(name="plain", algo="plain")
    assert [c.name for c in out] == ["plain", "ngram", "block:draft=8"]


def test_baseline_plain_moved_first_not_duplicated():
    out = resolve_configs(parse_configs(["ngram", "plain"]))
    assert [c.name for c in out] == ["plain", "ngram"]


def test_baseline_by_name_or_spec():
    cs = parse_configs(["a=ngram", "b=ngram:draft=4"])
    assert [c.name for c in resolve_configs(cs, "b")] == ["b", "a"]
    out = resolve_configs(cs, "ref=draft-head")
    assert out[0].name == "ref" and out[0].algo == "draft-head"


def test_toml_file(tmp_path):
    p = tmp_path / "bench.toml"
    p.write_text(
        'baseline = "plain"\n'
        "[configs.plain]\n"
        'algo = "plain"\n'
        "[configs.ng4]\n"
        'algo = "ngram"\n'
        "draft = 4\n"
        "adaptive = true\n"
        "[configs.dm]\n"
        'algo = "draft-model"\n'
        'path = "/m/d.gguf"\n'
        "pmin = 0.5\n"
        "",
        encoding="utf-8",
    )
    f = load_config_file(p)
    assert f.baseline == "plain"
    assert [c.name for c in f.configs] == ["plain", "ng4", "dm"]
    ng4, dm = f.configs[1], f.configs[2]
    assert (ng4.algo, ng4.draft, ng4.adaptive) == ("ngram", 4, True)
    assert (dm.draft_model, dm.pmin) == ("/m/d.gguf", 0.5)


@pytest.mark.parametrize(
    "body,needle",
    [
        ("[configs.a]\nalgo = 'ngram'\ndraft = 100\n", "draft"),
        ("[configs.a]\ndraft = 4\n", "missing algo"),
        ("[configs.a]\nalgo = 'nope'\n", "unknown algorithm"),
        ("[configs.a]\nalgo = 'ngram'\ndraft = true\n", "draft"),
        ("[configs.a\n", "invalid TOML"),
        ("x = 1\n", "unknown top-level"),
        ("baseline = 'zzz'\n[configs.a]\nalgo = 'ngram'\n", "baseline"),
        ("", "no [configs"),
    ],
)
def test_bad_toml(tmp_path, body, needle):
    p = tmp_path / "c.toml"
    p.write_text(body, encoding="utf-8")
    with pytest.raises(BadInput) as exc:
        load_config_file(p)
    assert needle in str(exc.value)
    assert "c.toml" in str(exc.value)


def test_missing_toml(tmp_path):
    with pytest.raises(BadInput, match="no such file or directory"):
        load_config_file(tmp_path / "nope.toml")
