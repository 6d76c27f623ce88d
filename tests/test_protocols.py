"""The loop's protocols are what the parts it drives provide: every registered speculator class
and the cost governor satisfy them (a renamed or dropped member fails here, not mid-run)."""

from __future__ import annotations

import inspect

from tsspec.spec.governor import GovernorConfig, SpeculationCostGovernor
from tsspec.spec.protocols import Governor


def test_the_cost_governor_is_a_governor():
    gov = SpeculationCostGovernor(GovernorConfig())
    assert isinstance(gov, Governor)
    for name in ("begin_sequence", "should_draft", "draft_length", "min_draft_prob", "record"):
        want = inspect.signature(getattr(Governor, name))
        got = inspect.signature(getattr(SpeculationCostGovernor, name))
        assert list(got.parameters) == list(want.parameters), name


def test_something_else_is_not_a_governor():
    class Half:
        def should_draft(self):
            return True

    assert not isinstance(Half(), Governor)
