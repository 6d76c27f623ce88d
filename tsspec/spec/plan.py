"""A sequence's speculation as one value: which speculator drafts, which governor prices it, how
many tokens a verify may hold and how drafts are accepted.

``Session.speculation`` builds a ``SpecPlan``; the engine, the server's scheduler and
``DecodeState`` hand that same object on untouched, so a reader can follow ``--spec-draft`` from
the flag to the loop through one name. ``PLAIN`` is the plan of a run that does not speculate.

A speculator and a governor hold one sequence's state, so a plan serves one sequence at a time;
several sequences decoded together each take their own from a ``PlanFactory`` (a fresh plan over
the same loaded drafter weights).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # annotations only: a plain run imports no speculator (nor torch) through its plan
    from .protocols import Governor, Speculator

RULES = ("match", "residual")  # how a verify accepts drafts (``spec.verify``)


@dataclass(frozen=True)
class SpecPlan:
    speculator: Speculator | None = None
    governor: Governor | None = None  # None: draft every step (no cost governor)
    window: int = 8  # the most draft tokens one verify holds
    accept_rule: str | None = None  # None: the speculator's own ``default_accept_rule``

    def __post_init__(self):
        if self.window < 0:
            raise ValueError(f"a speculation window is at least 0, not {self.window}")
        if self.accept_rule is not None and self.accept_rule not in RULES:
            raise ValueError(f"unknown acceptance rule {self.accept_rule!r} (one of {', '.join(RULES)})")

    @property
    def speculates(self) -> bool:
        return self.speculator is not None

    def rule(self) -> str:
        """The acceptance rule this plan runs: its own, else the speculator's default, else match."""
        if self.accept_rule is not None:
            return self.accept_rule
        return self.speculator.default_accept_rule if self.speculator is not None else "match"


PLAIN = SpecPlan()

PlanFactory = Callable[[], SpecPlan]  # a fresh plan (own speculator and governor state) per sequence
