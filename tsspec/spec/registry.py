"""Speculator registry: the only place that knows which algorithms exist, and the one place that
builds speculators (drafter adapters in ``tsspec.drafters`` only load and validate weights).

A factory takes ``(target, options, drafter)`` and returns a ``Speculator`` or a *decline reason*:
one sentence an operator can act on. ``auto`` asks the attached drafter first (its
``speculator_name``, decided by its file's ``general.architecture``), then a draft head the
checkpoint carries, then n-gram, which works on every model. ``drafter`` is None or has the
attributes of ``tsspec.drafters.Drafter``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..errors import BadInput
from .protocols import arms_after_prefix_reuse

# factory(target, options, drafter) -> Speculator | str (decline reason)
Factory = Callable[[Any, Any, Any], Any]


@dataclass(frozen=True)
class Entry:
    name: str
    factory: Factory
    description: str
    auto: bool = False  # ``auto`` tries it (in registration order) after an attached drafter's own
    # the factory takes a fourth argument: a dict shared by every sequence of one engine (where a
    # speculator keeps what outlives a sequence, such as the suffix store)
    shared: bool = False


class SpeculatorDeclined(BadInput):
    """--spec-type NAME cannot serve this model; the message says why."""


class SpeculatorRegistry:
    def __init__(self) -> None:
        self._entries: dict[str, Entry] = {}
        self._long_lived: dict[str, str] = {}  # auto entry -> what ``auto`` takes instead on a server

    def register(self, name: str, factory: Factory, description: str, *, auto: bool = False,
                 shared: bool = False, long_lived_for: str | None = None) -> None:
        """Everything a speculator needs to be chosen by name: its factory (the speculator, or a
        sentence saying why it declines), what ``tsspec info`` says of it, whether ``auto`` tries
        it when no drafter names its own algorithm, whether its factory takes the engine's shared
        dict (``Entry.shared``), and which ``auto`` entry it replaces on a long-lived engine
        (``long_lived_for``)."""
        self._entries[name] = Entry(name, factory, description, auto, shared)
        if long_lived_for is not None:
            self._long_lived[long_lived_for] = name

    def names(self) -> list[str]:
        return list(self._entries)

    def members(self, name: str) -> list[str] | None:
        """The member names of a cascade spelled as a comma list (``ngram,draft-model``), checked;
        None for a single name."""
        if "," not in name:
            return None
        parts = [p.strip() for p in name.split(",")]
        for p in parts:
            if p == "cascade" or p == "auto":
                raise BadInput(f"--spec-type {name!r}: {p!r} cannot be a cascade member")
            self.entry(p)
        if len(set(parts)) != len(parts):
            raise BadInput(f"--spec-type {name!r}: a cascade names each speculator once")
        return parts

    def try_cascade(self, names: list[str], target, options, drafter=None, shared: dict | None = None):
        """-> (a cascade of ``names``, in order, or None, decline reason or None)."""
        from .cascade import CascadeSpeculator

        built = []
        for n in names:
            spec, why = self.try_create(n, target, options, drafter, shared)
            if spec is None:
                return None, f"member {n}: {why}"
            built.append(spec)
        return CascadeSpeculator(built), None

    def entry(self, name: str) -> Entry:
        if name not in self._entries:
            raise BadInput(f"--spec-type {name!r}: unknown (choose from auto, {', '.join(self._entries)})")
        return self._entries[name]

    def try_create(self, name: str, target, options, drafter=None, shared: dict | None = None):
        """-> (speculator or None, decline reason or None). ``shared``: the engine's dict, kept
        across its sequences (None: a fresh one, shared with nothing)."""
        members = self.members(name)
        if members is not None:
            return self.try_cascade(members, target, options, drafter, shared)
        e = self.entry(name)
        if drafter is not None and name == drafter.speculator_name:
            # the drafter's preferred window (measured for it alone) bounds its own drafts, here and
            # as a cascade's member; the others keep the run's (the 0.5B draft model's 4 held n-gram
            # inside a cascade to 4 tokens a verify on quoted text: 2.12x plain on code edits against
            # n-gram alone's 2.46x, docs/RESULTS.md)
            from ..options import with_window

            options = with_window(options, drafter.preferred_window)
        if e.shared:
            made = e.factory(target, options, drafter, {} if shared is None else shared)
        else:
            made = e.factory(target, options, drafter)
        if isinstance(made, str):
            return None, made
        return made, None

    def create(self, name: str, target, options, drafter=None, shared: dict | None = None, *,
               long_lived: bool = False):
        """The speculator ``name`` (``auto``: the best available, ``auto_order``) or
        ``SpeculatorDeclined``."""
        if name == "auto":
            reasons = []
            for cand in self.auto_order(drafter, long_lived=long_lived):
                spec, why = self.try_create(cand, target, options, drafter, shared)
                if spec is not None:
                    return spec
                reasons.append(f"{cand}: {why}")
            raise SpeculatorDeclined("no speculator can serve this model (" + "; ".join(reasons) + ")")
        spec, why = self.try_create(name, target, options, drafter, shared)
        if spec is None:
            raise SpeculatorDeclined(f"{name}: {why}")
        return spec

    def auto_order(self, drafter, *, long_lived: bool = False) -> list[str]:
        """What ``auto`` tries, in order: the attached drafter's algorithm, then the entries
        registered with ``auto`` (a built-in head, n-gram). ``long_lived``: the engine serves many
        sequences over its lifetime (``tsspec serve``), so an entry registered as ``auto``'s choice
        there (``suffix``, which also drafts from the earlier ones) takes the place of the one it
        stands in for (n-gram)."""
        order = []
        if drafter is not None:
            order.append(drafter.speculator_name)
        for e in self._entries.values():
            if not e.auto or e.name in order:
                continue
            name = self._long_lived.get(e.name, e.name) if long_lived else e.name
            if name not in order:
                order.append(name)
        return order

    def explain(self, target, options, drafter=None) -> list[tuple[str, bool, str]]:
        """For ``tsspec info``: (name, would serve, description or decline reason) per algorithm."""
        rows = []
        for name, e in self._entries.items():
            spec, why = self.try_create(name, target, options, drafter)
            if spec is not None:
                note = e.description
                if not arms_after_prefix_reuse(spec):
                    note += " (does not arm after a reused KV prefix)"
                rows.append((name, True, note))
            else:
                rows.append((name, False, why))
        return rows


REGISTRY = SpeculatorRegistry()


# ----------------------------------------------------------------------------- built-in entries


def _attached(drafter, name: str) -> bool:
    return drafter is not None and drafter.speculator_name == name


def _other_attached(drafter, wanted: str) -> str:
    """The end of a decline reason when a drafter for another algorithm is attached: what it is and
    the --spec-type that takes it ('' when none is attached)."""
    if drafter is None:
        return ""
    path = getattr(drafter, "path", None)
    what = f"{getattr(path, 'name', path)} " if path else ""
    return (f"; the attached drafter {what}is for --spec-type {drafter.speculator_name}, "
            f"not {wanted}")


def _ngram(target, options, drafter):
    from .ngram import NGramSpeculator

    # its drafts carry no distribution: the residual rule verifies them by match, trees included
    return NGramSpeculator(max_draft_tokens=options.draft, min_draft_prob=options.pmin,
                           tree=_tree_budget(target, options, residual=False))


def _draft_head(target, options, drafter):
    from ..drafters.nextn import builtin_head

    # an attached head file first, else one the checkpoint carries (a draft model has no head)
    head = (drafter.draft_head if drafter is not None else None) or builtin_head(target)
    if head is None:
        return ("the model carries no draft head (no NextN/MTP tensors) and no draft-head GGUF "
                "was attached with --spec-draft-model")
    from .protocols import DraftHeadKind

    if head.kind is not DraftHeadKind.PER_TOKEN:
        return "the attached drafter is a block drafter, not a per-token head (use --spec-type block)"
    from .draft_head import DraftHeadSpeculator

    tree = _tree_budget(target, options, residual=options.accept == "residual")
    return DraftHeadSpeculator.build(target, head, options, tree=tree)


def _block(target, options, drafter):
    if not _attached(drafter, "block"):
        return ("no block drafter attached (--draft-model PATH with general.architecture = dflash)"
                + _other_attached(drafter, "block"))
    shape, bound = (target.hidden_size, target.n_layers, target.vocab_size), drafter.target_shape
    if shape != bound:
        return (f"the dflash drafter was bound to a trunk with hidden {bound[0]}, {bound[1]} layers, "
                f"vocab {bound[2]}; this one has {shape[0]}, {shape[1]}, {shape[2]}")
    from .block import BlockSpeculator

    return BlockSpeculator(
        drafter.draft_head,
        taps=drafter.taps,
        max_draft_tokens=options.draft,
        min_draft_prob=options.pmin,
        sample_drafts=options.accept == "residual",
        tree=_tree_budget(target, options, residual=options.accept == "residual"),
    )


def _draft_model(target, options, drafter):
    if not _attached(drafter, "draft-model"):
        return ("no draft model attached (--draft-model PATH or a known model name whose "
                "architecture is a language model)" + _other_attached(drafter, "draft-model"))
    from .draft_model import DEFAULT_HEAD_PREFIX, DraftModelSpeculator

    return DraftModelSpeculator(
        drafter.model,
        vocab_size=drafter.trunk_vocab,  # drafts and their probabilities live in the trunk's vocabulary
        max_draft_tokens=options.draft,
        min_draft_prob=options.pmin,
        # its trees carry each node's proposal distribution: the residual rule verifies them too
        tree=_tree_budget(target, options, residual=False),
        residual=options.accept == "residual",
        head_prefix=DEFAULT_HEAD_PREFIX if (cut := getattr(drafter, "head_prefix", None)) is None else cut,
    )


def _tree_budget(target, options, *, residual: bool) -> int:
    """The node budget a drafter may build trees with: 0 (chains) on a recurrent trunk, which cannot
    share one forward among a tree's rows, and for drafts the residual rule would verify without
    each node's proposal distribution (``residual``: a head's or block drafter's sibling leaves)."""
    if not getattr(target, "batches_sequences", False) or residual:
        return 0
    return options.tree


def _suffix(target, options, drafter, shared):
    from .suffix import SuffixSpeculator, SuffixStore

    store = shared.setdefault("suffix-store", SuffixStore())  # every sequence of this engine
    return SuffixSpeculator(store, max_draft_tokens=options.draft, min_draft_prob=options.pmin,
                            tree=_tree_budget(target, options, residual=False))


def _cascade(target, options, drafter):
    # n-gram first; then the attached drafter's algorithm, else a head the checkpoint carries
    model = drafter.speculator_name if drafter is not None else "draft-head"
    spec, why = REGISTRY.try_cascade(["ngram", model], target, options, drafter)
    if spec is None:
        return (f"it needs a model drafter after n-gram ({why}; attach one with --spec-draft-model, "
                "or use a model that carries a draft head)")
    return spec


# registration order is ``auto``'s order among the entries it tries: a model's own head before n-gram
REGISTRY.register("draft-head", _draft_head, "per-token NextN/MTP draft head", auto=True)
REGISTRY.register("ngram", _ngram, "prompt lookup over the sequence's own tokens; no weights", auto=True)
REGISTRY.register("draft-model", _draft_model, "a separate small language model with the same vocabulary")
REGISTRY.register("block", _block, "DFlash/DFlash2 block drafter")
REGISTRY.register("suffix", _suffix, "n-gram over this sequence and over the earlier sequences of the same "
                  "engine (a chat, a prompts file, a server's lifetime); no weights; auto's choice in "
                  "place of n-gram on a server", shared=True, long_lived_for="ngram")
REGISTRY.register("cascade", _cascade, "n-gram first, the model drafter (attached, or the model's own head) "
                  "where n-gram has nothing; or a comma list, e.g. ngram,draft-model")
