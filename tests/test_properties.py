"""Property-based tests (hypothesis) of the two grammars users type: bench configurations and the
speculation settings from flags and ``TS_SPEC_*``/``TS_MTP_*`` variables.

Properties: a configuration prints to a spec that parses back to itself; any text either parses or
is refused with ``BadInput`` (never another exception); any environment either resolves to options
inside their documented ranges or is refused with ``BadInput``; what ``publish`` writes resolves
back to the same options.
"""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from tsspec.bench.configs import ACCEPT_RULES, BenchConfig, algos, parse_config
from tsspec.errors import BadInput
from tsspec import options
from tsspec.options import DRAFT_MAX, DRAFT_MIN, FAMILIES, SETTINGS, publish
from tsspec.settings import speculator_names


def resolve(flags, env):
    """``options.resolve`` with the registry's speculator names, as ``settings.resolve_run`` calls it."""
    return options.resolve(flags, env, speculators=speculator_names())


SPEC_ALGOS = [a for a in algos() if a != "plain"]
# a drafter path as a user would type one: no separators of the grammar, no surrounding blanks
paths = st.text(alphabet=st.characters(whitelist_categories=("L", "N"), whitelist_characters="/._-"),
                min_size=1, max_size=30)


@st.composite
def configs(draw) -> BenchConfig:
    algo = draw(st.sampled_from(SPEC_ALGOS))
    return BenchConfig(
        name="x",
        algo=algo,
        draft=draw(st.none() | st.integers(DRAFT_MIN, DRAFT_MAX)),
        pmin=draw(st.none() | st.sampled_from([0.0, 0.25, 0.5, 0.9, 1.0])),
        draft_model=draw(st.none() | paths),
        accept=draw(st.none() | st.sampled_from(ACCEPT_RULES)),
        adaptive=draw(st.none() | st.booleans()),
    )


@settings(max_examples=300, deadline=None)
@given(configs())
def test_a_config_parses_back_from_its_spec(c):
    again = parse_config(f"x={c.spec()}")
    assert again == c
    unnamed = parse_config(c.spec())
    assert unnamed.spec() == c.spec()


@settings(max_examples=500, deadline=None)
@given(st.text(max_size=60))
def test_any_config_text_parses_or_is_one_bad_input(text):
    try:
        c = parse_config(text)
    except BadInput as e:
        assert str(e) and "\n" not in str(e)
        return
    assert c.algo in algos()
    assert c.draft is None or DRAFT_MIN <= c.draft <= DRAFT_MAX
    assert c.pmin is None or 0.0 <= c.pmin <= 1.0


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="abcdefgnmrptu:=,0123456789.-_ ", max_size=40))
def test_config_texts_near_the_grammar_parse_or_refuse(text):
    # the alphabet of real specs, so most examples reach deep into the parser
    try:
        parse_config(text)
    except BadInput:
        pass


env_keys = st.sampled_from([fam + suffix for fam in FAMILIES for suffix, _ in SETTINGS.values()])
env_values = st.one_of(st.text(max_size=12), st.integers(-100, 200).map(str),
                       st.floats(allow_nan=True, allow_infinity=True).map(repr),
                       st.sampled_from(["on", "off", "yes", "no", "ngram", "draft-model", "residual", "match",
                                        "auto", "1", "0", "8", "64", "65", "0.5", "nan", "inf", " "]))


@settings(max_examples=500, deadline=None)
@given(st.dictionaries(env_keys, env_values, max_size=6))
def test_any_environment_resolves_in_range_or_is_one_bad_input(env):
    try:
        opts, warnings = resolve({}, env)
    except BadInput as e:
        assert str(e) and "\n" not in str(e)
        return
    assert DRAFT_MIN <= opts.draft <= DRAFT_MAX
    assert opts.pmin is None or (math.isfinite(opts.pmin) and 0.0 <= opts.pmin <= 1.0)
    assert opts.accept in ("auto", "match", "residual")
    assert isinstance(opts.enabled, bool) and isinstance(opts.adaptive, bool)
    assert all(isinstance(w, str) for w in warnings)
    # what a parent publishes for its children resolves to the same options
    child: dict[str, str] = {}
    publish(opts, child)
    again, _ = resolve({}, child)
    assert (again.enabled, again.type, again.draft, again.pmin, again.draft_model, again.accept, again.adaptive) == (
        opts.enabled, opts.type, opts.draft, opts.pmin, opts.draft_model, opts.accept, opts.adaptive)
