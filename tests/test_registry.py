"""A speculator is chosen by name in one place: its ``REGISTRY.register`` line. What the operator
sees of the registry (``--spec-type``'s help, the names ``options`` accepts, ``auto``'s order) is
read from it, or checked against it here."""

from __future__ import annotations

import re

import pytest

from tsspec.errors import BadInput
from tsspec.spec.registry import REGISTRY, SpeculatorRegistry


def test_spec_type_help_lists_every_registered_speculator():
    from tsspec.cli import SPEC_TYPE_OPTION

    listed = set(re.findall(r"[a-z][a-z-]+", SPEC_TYPE_OPTION.help.split(".")[0])) - {"default"}
    assert listed == {"auto", *REGISTRY.names()}


def test_auto_tries_the_entries_registered_for_it_after_a_drafters_own():
    class Drafter:
        speculator_name = "block"

    assert REGISTRY.auto_order(None) == ["draft-head", "ngram"]
    assert REGISTRY.auto_order(Drafter()) == ["block", "draft-head", "ngram"]
    # a server (an engine that lives for many sequences) takes suffix in n-gram's place
    assert REGISTRY.auto_order(None, long_lived=True) == ["draft-head", "suffix"]
    assert REGISTRY.auto_order(Drafter(), long_lived=True) == ["block", "draft-head", "suffix"]
    r = SpeculatorRegistry()
    r.register("a", lambda *_: "no", "first")
    r.register("b", lambda *_: "no", "second", auto=True)
    r.register("c", lambda *_: "no", "third", auto=True)
    assert r.auto_order(None) == ["b", "c"]
    r.register("d", lambda *_: "no", "c's stand-in", long_lived_for="c")
    assert r.auto_order(None) == ["b", "c"] and r.auto_order(None, long_lived=True) == ["b", "d"]
    with pytest.raises(BadInput, match="no speculator can serve this model \\(b: no; c: no\\)"):
        r.create("auto", None, None)
