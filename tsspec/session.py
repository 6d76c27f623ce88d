"""The one composition point: a run's trunk, drafters and speculation, built from a ``RunConfig``.

``Session.open(config)`` loads the trunk (model + tokenizer) once; ``speculation(options)`` attaches
the drafter the options name (if any), has the registry build the speculator and sizes its window
(flag > the drafter's measured preference > the trunk's > the default), with a cost governor;
``engine(options)`` wraps both for ``generate``. ``tsspec generate``, ``info`` and ``bench`` (one
engine per configuration over one loaded trunk) all compose runs here; the command line only
parses, resolves settings (``tsspec.settings``) and displays.

Layers point one way: cli -> session -> spec (registry, governor) -> models, drafters -> weights.
Nothing here prints: ``console`` and ``loading`` are the caller's, for download progress and a
loading indicator; ``warn`` receives what a drafter found worth warning about.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, ContextManager

from .options import ATTACH_ARCHS, ATTACH_DFLASH, SpecOptions, with_window, without_attach
from .settings import ENV_DFLASH_CONV, ENV_DFLASH_SELECTOR, RunConfig
from .spec.plan import PLAIN, PlanFactory, SpecPlan


@dataclass(frozen=True)
class Speculation:
    """A run's speculation: the plan the loop runs (``PLAIN`` when speculation is off), how to make
    another for each further sequence, and what the operator is shown about it."""

    plan: SpecPlan = PLAIN
    # the settings as they run: the window after the model's preference and the speculator's cap
    # (what ``tsspec.settings.publish_spec`` publishes as TS_SPEC_DRAFT / TS_MTP_DRAFT)
    options: SpecOptions = field(default_factory=SpecOptions)
    notes: tuple[str, ...] = ()  # what the drafter's checks allowed or found, for the operator
    # a fresh plan (own speculator and governor) over the same loaded weights, for each sequence
    # decoded at the same time as others (a speculator's state belongs to one sequence); None when off
    new_plan: PlanFactory | None = None
    # what the speculators keep across this engine's sequences (the suffix store), by name
    shared: dict = field(default_factory=dict)


class Session:
    """One loaded trunk and how runs over it are composed (see the module docstring)."""

    def __init__(self, config: RunConfig, gguf, target, tokenizer, *, console: Any = None,
                 warn: Callable[[str], None] | None = None):
        self.config = config
        self.gguf = gguf
        self.target = target
        self.tokenizer = tokenizer
        self.console = console
        self._warn = warn

    @classmethod
    def open(
        cls,
        config: RunConfig,
        *,
        gguf=None,
        console: Any = None,
        progress: bool = True,
        loading: Callable[[Path], ContextManager] | None = None,
        warn: Callable[[str], None] | None = None,
        lean: bool = False,
    ) -> "Session":
        """Apply the thread count, find the model (pulling a known one on first use, with
        ``progress`` on ``console``), and load it with its tokenizer. ``gguf``: an already opened
        file (``config.model`` is then not looked up); ``loading(path)``: a context around the load.
        ``lean``: the caller decodes plainly and greedily (``models.lean.declines`` found nothing
        against its run): a trunk the lean path takes is loaded without torch (``Session.lean``
        then says so), any other as always."""
        from . import kernels
        from .gguf_file import GGUFFile
        from .hub import resolve_model
        from .models import arch_module, validate_model
        from .tokenizer import Tokenizer

        if config.threads is not None:
            kernels.set_threads(config.threads)
        if gguf is None:
            path = resolve_model(config.model, progress=progress, console=console)
        else:
            path = gguf.path
        with loading(path) if loading is not None else contextlib.nullcontext():
            g = GGUFFile(path) if gguf is None else gguf
            # the file's architecture and tensors checked first (a file that is no model says so,
            # not that its tokenizer is missing), then the tokenizer: what its build frees goes back
            # before the weights come in, so the peak is the weights plus the built tokenizer
            arch_module(g.arch, g.path.name)
            validate_model(g)
            tokenizer = Tokenizer.from_metadata(g.metadata)
            target = _lean_target(g, config) if lean else None
            if target is None:
                target = _torch_target(g, config)
        if config.ctx_size and config.ctx_size > target.max_context and warn is not None:
            warn(f"--ctx-size {config.ctx_size} is above {path.name}'s trained context "
                 f"({target.max_context} tokens); using {target.max_context}")
        return cls(config, g, target, tokenizer, console=console, warn=warn)

    @property
    def path(self) -> Path:
        return self.gguf.path

    @property
    def lean(self) -> bool:
        """Whether the trunk is the lean one (``models.lean``: plain greedy decoding, no torch)."""
        return bool(getattr(self.target, "lean", False))

    # ------------------------------------------------------------------------- drafters

    def load_drafter(self, draft_model: str | Path):
        """A drafter file (or a known model name, pulled on first use) bound to this trunk, loaded
        as the configuration says (weights only: each speculator built on it holds its own state)."""
        from .drafters import DrafterOptions, load_drafter
        from .hub import KNOWN_MODELS, resolve_model
        from .paths import exists

        path = draft_model
        if not exists(path) and path in KNOWN_MODELS:
            path = str(resolve_model(path, console=self.console))
        cfg = self.config
        drafter = load_drafter(path, self.target, DrafterOptions(
            weights=cfg.draft_weights, dflash_conv=cfg.dflash_conv, dflash_selector=cfg.dflash_selector,
            draft_vocab=cfg.draft_vocab))
        switches = {"conv": (ENV_DFLASH_CONV, "convolution"), "selector": (ENV_DFLASH_SELECTOR, "candidate selector")}
        for piece in getattr(drafter, "switched_off", lambda: [])():
            env, what = switches[piece]
            drafter.warnings.append(f"{env}=0: the DFlash2 {what} is off (for attribution only; "
                                    "the weights were trained with it)")
        return drafter

    # ------------------------------------------------------------------------- speculation

    def speculation(self, options: SpecOptions | None = None, *, long_lived: bool = False) -> Speculation:
        """The speculator (built by the registry), governor, window and acceptance rule for
        ``options`` (default: the configuration's), or ``SpeculatorDeclined`` with the reason.
        ``long_lived``: the engine serves requests for its lifetime (``tsspec serve``): ``auto``
        takes the suffix speculator where it would take n-gram."""
        opts = self.for_this_trunk(self.config.spec if options is None else options)
        if not opts.enabled:
            return Speculation(options=opts)
        if self.lean:
            raise ValueError("a lean trunk decodes plainly: open the session without lean to speculate")
        from .spec.governor import SharedParks, SpeculationCostGovernor
        from .spec.registry import REGISTRY

        drafter = None
        notes: list[str] = []
        if opts.draft_model:
            drafter = self.load_drafter(opts.draft_model)
            notes += drafter.notes
            for w in drafter.warnings:
                if self._warn is not None:
                    self._warn(w)
        opts = self.with_preferred_window(opts)
        accept_rule = None if opts.accept == "auto" else opts.accept

        shared: dict = {}  # what a speculator keeps across this engine's sequences (the suffix store)
        parks = SharedParks()  # and what their governors do: a park holds for the engine's new sequences

        def new_plan(o: SpecOptions = opts) -> SpecPlan:
            speculator = REGISTRY.create(o.type, self.target, o, drafter, shared, long_lived=long_lived)
            window = min(o.draft, speculator.max_draft_tokens) if speculator.max_draft_tokens else o.draft
            governor = SpeculationCostGovernor(enabled=o.adaptive, shared_parks=parks)
            return SpecPlan(speculator, governor, window, accept_rule)

        plan = new_plan()  # this sequence's; a server makes one per request
        return Speculation(plan=plan, options=replace(opts, draft=plan.window), notes=tuple(notes), new_plan=new_plan,
                           shared=shared)

    def for_this_trunk(self, options: SpecOptions) -> SpecOptions:
        """``options``, less a drafter ``TS_QWEN35_DFLASH`` named for a trunk it is not for (said
        once, through ``warn``): the variable belongs to the Qwen 3.5 trunks, and one exported for
        them must not refuse a run of another model."""
        if not options.attached or self.gguf.arch in ATTACH_ARCHS:
            return options
        if self._warn is not None:
            self._warn(f"{ATTACH_DFLASH} names a drafter for {', '.join(ATTACH_ARCHS)} trunks; "
                       f"{self.path.name} is {self.gguf.arch}: not attached")
        return without_attach(options)

    def with_preferred_window(self, options: SpecOptions) -> SpecOptions:
        """``options`` with the window the trunk prefers (a hybrid's, for its rollback memory); a
        window the user chose (``--spec-draft``, ``TS_SPEC_DRAFT``) wins. A drafter's own preference
        bounds its speculator's drafts where the registry builds it (``SpeculatorRegistry.try_create``),
        and the plan's window follows the speculator's."""
        return with_window(options, getattr(self.target, "preferred_window", None))

    def rollback_memory(self, window: int) -> int:
        """Bytes one sequence holds to undo a verify of ``window`` drafts (0 on a KV-cache trunk)."""
        from .spec.loop import rollback_memory_bytes

        return rollback_memory_bytes(self.target, window)

    def engine(self, speculation: Speculation | None = None):
        """A ``tsspec.generate.Engine`` over this trunk (plain when ``speculation`` is None/empty)."""
        from .generate import Engine

        s = speculation or Speculation()
        decoder = None
        if self.lean:
            from .spec.plain import LeanDecode as decoder
        return Engine(self.target, self.tokenizer, s.plan, new_plan=s.new_plan, shared=s.shared, decoder=decoder)

    def sampler(self, params):
        """What draws this session's tokens for ``params`` (``SamplingParams``): a ``Sampler``, or on a
        lean trunk the settings themselves (it draws greedily itself, and a Sampler imports torch)."""
        if self.lean:
            return params
        from .sampling import Sampler

        return Sampler(params)

    def explain(self, drafter=None) -> list[tuple[str, bool, str]]:
        """For ``tsspec info``: (speculator, would serve, why) for this trunk and ``drafter``."""
        from .spec.registry import REGISTRY

        return REGISTRY.explain(self.target, SpecOptions(enabled=True), drafter)

    def auto_order(self, drafter=None) -> list[str]:
        from .spec.registry import REGISTRY

        return REGISTRY.auto_order(drafter)


def _torch_target(g, config: RunConfig):
    """The trunk as the torch model (every run but a lean one), with the thread count set in torch."""
    from .models import load_model

    if config.threads is not None:
        import torch

        torch.set_num_threads(config.threads)
    return load_model(g, fmt=config.weights, n_ctx=config.ctx_size, verify_snapshots=config.verify_snapshots,
                      device=config.device)


def _lean_target(g, config: RunConfig):
    """The lean trunk of ``g`` (``models.lean``), or None where its file is not for it (the torch model
    then loads it)."""
    from . import kernels
    from .models import lean

    try:
        return lean.load(g, config.ctx_size, kernels.thread_count())
    except lean.Declined:
        return None
