"""Speculator registry: the only place that knows which algorithms exist.

A factory takes ``(target, options, drafter)`` and returns a ``Speculator`` or a *decline reason*:
one sentence an operator can act on. ``auto`` asks the attached drafter file first (its
``general.architecture`` decides what it is), then a draft head the checkpoint carries, then
n-gram, which works on every model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..errors import BadInput

# factory(target, options, drafter) -> Speculator | str (decline reason)
Factory = Callable[[Any, Any, Any], Any]


@dataclass(frozen=True)
class Entry:
    name: str
    factory: Factory
    description: str
    requires_draft_head: bool = False


class SpeculatorDeclined(BadInput):
    """--spec-type NAME cannot serve this model; the message says why."""


class SpeculatorRegistry:
    def __init__(self) -> None:
        self._entries: dict[str, Entry] = {}

    def register(self, name: str, factory: Factory, description: str, *, requires_draft_head: bool = False) -> None:
        self._entries[name] = Entry(name, factory, description, requires_draft_head)

    def names(self) -> list[str]:
        return list(self._entries)

    def entry(self, name: str) -> Entry:
        if name not in self._entries:
            raise BadInput(f"--spec-type {name!r}: unknown (choose from auto, {', '.join(self._entries)})")
        return self._entries[name]

    def try_create(self, name: str, target, options, drafter=None):
        """-> (speculator or None, decline reason or None)."""
        made = self.entry(name).factory(target, options, drafter)
        if isinstance(made, str):
            return None, made
        return made, None

    def create(self, name: str, target, options, drafter=None):
        """The speculator ``name`` (``auto``: the best available) or ``SpeculatorDeclined``."""
        if name == "auto":
            reasons = []
            for cand in self.auto_order(drafter):
                spec, why = self.try_create(cand, target, options, drafter)
                if spec is not None:
                    return spec
                reasons.append(f"{cand}: {why}")
            raise SpeculatorDeclined("no speculator can serve this model (" + "; ".join(reasons) + ")")
        spec, why = self.try_create(name, target, options, drafter)
        if spec is None:
            raise SpeculatorDeclined(f"{name}: {why}")
        return spec

    def auto_order(self, drafter) -> list[str]:
        """What ``auto`` tries, in order: the attached drafter's algorithm, a built-in head, n-gram."""
        order = []
        kind = getattr(drafter, "speculator_name", None)
        if kind:
            order.append(kind)
        for name in ("draft-head", "ngram"):
            if name in self._entries and name not in order:
                order.append(name)
        return order

    def explain(self, target, options, drafter=None) -> list[tuple[str, bool, str]]:
        """For ``tsspec info``: (name, would serve, description or decline reason) per algorithm."""
        rows = []
        for name, e in self._entries.items():
            spec, why = self.try_create(name, target, options, drafter)
            if spec is not None:
                note = e.description
                if not spec.can_arm_after_prefix_reuse:
                    note += " (does not arm after a reused KV prefix)"
                rows.append((name, True, note))
            else:
                rows.append((name, False, why))
        return rows


REGISTRY = SpeculatorRegistry()


# ----------------------------------------------------------------------------- built-in entries


def _ngram(target, options, drafter):
    from .ngram import NGramSpeculator

    return NGramSpeculator(max_draft_tokens=options.draft, min_draft_prob=options.pmin)


def _draft_head(target, options, drafter):
    from ..drafters.nextn import builtin_head

    head = getattr(drafter, "draft_head", None) or builtin_head(target)
    if head is None:
        return ("the model carries no draft head (no NextN/MTP tensors) and no draft-head GGUF "
                "was attached with --spec-draft-model")
    from .protocols import DraftHeadKind

    if getattr(head, "kind", None) is not DraftHeadKind.PER_TOKEN:
        return "the attached drafter is a block drafter, not a per-token head (use --spec-type block)"
    from .draft_head import DraftHeadSpeculator

    return DraftHeadSpeculator.build(target, head, options)


def _block(target, options, drafter):
    if drafter is None or getattr(drafter, "speculator_name", None) != "block":
        return "no block drafter attached (--draft-model PATH with general.architecture = dflash)"
    return drafter.make_speculator(target, options)


def _draft_model(target, options, drafter):
    from .draft_model import registry_factory

    return registry_factory(target, options, drafter)


REGISTRY.register("ngram", _ngram, "prompt lookup over the sequence's own tokens; no weights")
REGISTRY.register("draft-model", _draft_model, "a separate small language model with the same vocabulary")
REGISTRY.register("draft-head", _draft_head, "per-token NextN/MTP draft head", requires_draft_head=True)
REGISTRY.register("block", _block, "DFlash/DFlash2 block drafter", requires_draft_head=True)
