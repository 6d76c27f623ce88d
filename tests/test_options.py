"""The operator surface: flags, legacy spellings, both environment families, errors, publishing."""

from __future__ import annotations

import pytest

from tsspec.errors import BadInput
from tsspec import options
from tsspec.options import SpecOptions, publish, with_window, without_attach
from tsspec.settings import speculator_names

NONE = dict(enabled=None, type=None, draft=None, pmin=None, draft_model=None, accept=None, adaptive=None, block_drafter=None)


def resolve(flags, env):
    """``options.resolve`` with the registry's speculator names, as ``settings.resolve_run`` calls it."""
    return options.resolve(flags, env, speculators=speculator_names())


def flags(**kw):
    return {**NONE, **kw}


def test_defaults():
    opts, warnings = resolve(flags(), {})
    assert opts == SpecOptions()
    assert not opts.enabled and opts.type == "auto" and opts.draft == 8 and opts.pmin is None
    assert opts.adaptive and warnings == []


@pytest.mark.parametrize("family", ["TS_SPEC_", "TS_MTP_"])
def test_each_environment_family_is_read(family):
    env = {family + "SPEC": "1", family + "TYPE": "ngram", family + "DRAFT": "5", family + "PMIN": "0.5",
           family + "DRAFT_MODEL": "x.gguf", family + "ACCEPT": "residual", family + "ADAPTIVE": "0"}
    opts, warnings = resolve(flags(), env)
    assert opts == SpecOptions(enabled=True, type="ngram", draft=5, draft_explicit=True, pmin=0.5,
                               draft_model="x.gguf", accept="residual", adaptive=False)
    assert warnings == []


def test_flag_beats_environment():
    opts, _ = resolve(flags(enabled=True, draft=3, pmin=0.1), {"TS_SPEC_DRAFT": "9", "TS_MTP_PMIN": "0.9"})
    assert opts.draft == 3 and opts.pmin == 0.1


def test_families_disagree_spec_wins_with_warning():
    opts, warnings = resolve(flags(), {"TS_SPEC_DRAFT": "4", "TS_MTP_DRAFT": "6"})
    assert opts.draft == 4
    assert len(warnings) == 1 and "TS_SPEC_DRAFT" in warnings[0] and "TS_MTP_DRAFT" in warnings[0]


def test_unknown_family_variable_is_warned_with_the_nearest_setting():
    opts, warnings = resolve(flags(), {"TS_SPEC_DRAFTS": "abc", "TS_MTP_PMN": "0.2", "TS_SPEC_QUANTUM_FLUX": "1"})
    assert opts == SpecOptions()  # none of them is read
    assert len(warnings) == 3
    by_name = {w.split()[0]: w for w in warnings}
    assert "did you mean TS_SPEC_DRAFT?" in by_name["TS_SPEC_DRAFTS"]
    assert "did you mean TS_MTP_PMIN?" in by_name["TS_MTP_PMN"]
    assert "TS_SPEC_ADAPTIVE" in by_name["TS_SPEC_QUANTUM_FLUX"]  # nothing close: the list of settings


def test_other_engines_variable_says_why_it_is_not_read():
    _, warnings = resolve(flags(), {"TS_MTP_FOLD_CATCHUP": "0"})
    assert len(warnings) == 1 and "not read by tsspec" in warnings[0] and "folds" in warnings[0]


def test_empty_unknown_variable_counts_as_unset():
    _, warnings = resolve(flags(), {"TS_SPEC_NOPE": "", "TSSPEC_OTHER": "1", "TS_SPECX": "1"})
    assert warnings == []


def test_families_agree_no_warning():
    _, warnings = resolve(flags(), {"TS_SPEC_DRAFT": "4", "TS_MTP_DRAFT": "4"})
    assert warnings == []


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(draft=0), "--spec-draft=0"),
        (dict(draft=65), "out of range"),
        (dict(pmin=1.5), "--spec-pmin"),
        (dict(pmin=-0.1), "out of range"),
        (dict(type="medusa"), "unknown speculator"),
        (dict(accept="always"), "--spec-accept"),
    ],
)
def test_bad_flag_values(kw, needle):
    with pytest.raises(BadInput, match=needle):
        resolve(flags(**kw), {})


@pytest.mark.parametrize(
    "env, needle",
    [
        ({"TS_SPEC_DRAFT": "abc"}, "TS_SPEC_DRAFT"),
        ({"TS_MTP_DRAFT": "100"}, "TS_MTP_DRAFT=100"),
        ({"TS_SPEC_PMIN": "x"}, "TS_SPEC_PMIN"),
        ({"TS_SPEC_SPEC": "maybe"}, "TS_SPEC_SPEC"),
        ({"TS_SPEC_ADAPTIVE": "2"}, "TS_SPEC_ADAPTIVE"),
        ({"TS_MTP_TYPE": "nope"}, "TS_MTP_TYPE"),
    ],
)
def test_bad_environment_values_name_the_variable(env, needle):
    with pytest.raises(BadInput, match=needle):
        resolve(flags(), env)


def test_empty_environment_value_is_unset():
    opts, _ = resolve(flags(), {"TS_SPEC_DRAFT": ""})
    assert opts.draft == 8


def test_draft_model_implies_spec_unless_no_spec():
    opts, _ = resolve(flags(block_drafter="d.gguf"), {})
    assert opts.enabled and opts.draft_model == "d.gguf"
    opts, warnings = resolve(flags(block_drafter="d.gguf", enabled=False), {})
    assert not opts.enabled and any("--draft-model" in w and "inert" in w for w in warnings)


def test_two_different_drafter_flags_are_an_error():
    with pytest.raises(BadInput, match="different files"):
        resolve(flags(block_drafter="a.gguf", draft_model="b.gguf"), {})


def test_tuning_flags_with_no_spec_warn():
    _, warnings = resolve(flags(enabled=False, draft=4, pmin=0.3), {})
    assert len(warnings) == 1 and "--spec-draft" in warnings[0] and "--spec-pmin" in warnings[0]
    _, warnings = resolve(flags(draft=4), {})  # off by default: still inert
    assert warnings and "inert" in warnings[0]


def test_publish_writes_both_families():
    env: dict[str, str] = {}
    publish(SpecOptions(enabled=True, type="ngram", draft=5, pmin=0.25, draft_model="m.gguf"), env)
    for fam in ("TS_SPEC_", "TS_MTP_"):
        assert env[fam + "SPEC"] == "1" and env[fam + "DRAFT"] == "5" and env[fam + "TYPE"] == "ngram"
        assert env[fam + "PMIN"] == "0.25" and env[fam + "DRAFT_MODEL"] == "m.gguf"
    # what was published reads back to the same options
    opts, _ = resolve(flags(), env)
    assert (opts.enabled, opts.type, opts.draft, opts.pmin, opts.draft_model) == (True, "ngram", 5, 0.25, "m.gguf")


def test_model_preferred_window_yields_to_user_choice():
    assert with_window(SpecOptions(), 3).draft == 3
    assert with_window(SpecOptions(draft=6, draft_explicit=True), 3).draft == 6
    assert with_window(SpecOptions(), None).draft == 8


def test_the_speculator_names_come_from_the_caller():
    """options knows no algorithm: ``--spec-type`` takes what its caller's registry names."""
    opts, _ = options.resolve(flags(type="lookahead"), {}, speculators=("lookahead",))
    assert opts.type == "lookahead"
    with pytest.raises(BadInput, match="choose from auto, lookahead"):
        options.resolve(flags(type="ngram"), {}, speculators=("lookahead",))
    assert resolve(flags(type="ngram"), {})[0].type == "ngram"


def test_ts_qwen35_dflash_attaches_a_drafter():
    """The design names ``TS_QWEN35_DFLASH`` as a way to attach a DFlash drafter: it names the
    drafter as ``--draft-model`` does (speculation on unless turned off), below every other name."""
    opts, warnings = resolve(flags(), {"TS_QWEN35_DFLASH": "d.gguf"})
    assert opts.draft_model == "d.gguf" and opts.enabled and warnings == []
    assert opts.attached and opts.attach_enabled
    assert without_attach(opts) == SpecOptions()  # a trunk it is not for: as if unset
    opts, _ = resolve(flags(), {"TS_QWEN35_DFLASH": "d.gguf", "TS_MTP_SPEC": "0"})
    assert opts.draft_model == "d.gguf" and not opts.enabled
    opts, _ = resolve(flags(enabled=False), {"TS_QWEN35_DFLASH": "d.gguf"})
    assert not opts.enabled
    opts, _ = resolve(flags(enabled=True, type="ngram"), {"TS_QWEN35_DFLASH": "d.gguf"})
    assert opts.attached and not opts.attach_enabled
    assert without_attach(opts) == SpecOptions(enabled=True, type="ngram")  # --spec stays
    for kw, env in ((dict(block_drafter="b.gguf"), {}), (dict(draft_model="b.gguf", enabled=True), {}),
                    ({}, {"TS_SPEC_DRAFT_MODEL": "b.gguf"}), ({}, {"TS_MTP_DRAFT_MODEL": "b.gguf"})):
        opts, warnings = resolve(flags(**kw), {"TS_QWEN35_DFLASH": "d.gguf", **env})
        assert opts.draft_model == "b.gguf" and not opts.attached
        assert len(warnings) == 1 and "TS_QWEN35_DFLASH=d.gguf is not used" in warnings[0]
    _, warnings = resolve(flags(), {"TS_QWEN35_DFLASH": "b.gguf", "TS_SPEC_DRAFT_MODEL": "b.gguf"})
    assert warnings == []  # the same file: nothing to say
    with pytest.raises(BadInput, match="TS_QWEN35_DFLASH: empty path"):
        resolve(flags(), {"TS_QWEN35_DFLASH": "  "})
    assert resolve(flags(), {"TS_QWEN35_DFLASH": ""})[0] == SpecOptions()  # empty: unset


def test_muse_glimmer_dflash_is_warned_about_by_name():
    opts, warnings = resolve(flags(), {"TS_MUSE_GLIMMER_DFLASH": "d.gguf"})
    assert opts == SpecOptions()
    assert len(warnings) == 1 and warnings[0].startswith("TS_MUSE_GLIMMER_DFLASH is not read by tsspec")
