"""The run configuration: a command's flags and the environment, resolved once into a ``RunConfig``.

* **The run configuration.** ``resolve_run`` turns a command's flags and the environment into a
  frozen, fully-resolved ``RunConfig``: flags > ``TS_SPEC_*`` > ``TS_MTP_*`` > defaults (the
  speculation surface itself is ``tsspec.options``, a pure function of flags, an environment
  mapping and the speculator names the registry knows); a model's preferred draft window is applied
  later, by ``tsspec.session.Session``, since it needs the loaded model. Everything below the
  session takes explicit parameters: a weight loader gets its format, a drafter its switches, a
  hybrid trunk its rollback mode.
* **The device** (``--device``, ``TSSPEC_DEVICE``): auto, cpu or cuda, resolved in ``RunConfig``
  to the one the run computes on; ``cuda`` where torch sees no GPU or triton is missing is refused
  here, in one line, before anything loads.
* **Process-wide switches** (the cache root, the native kernels, the llama.cpp peer build) are
  ``tsspec.env``'s, below every layer, so the kernels, the hub and the llama.cpp runner read them
  without importing the run configuration. ``tsspec.env`` is also the one way to the process
  environment: this module resolves from the mapping it gives.

One rule for every variable: set to the empty string (the shell's ``VAR= tsspec ...``) it counts as
unset; any other value must be valid (blanks around it are ignored), or the run stops with one
``BadInput`` line naming the variable (or the flag), as documented in README.md and man/tsspec.1.
A switch takes only the boolean words (``0``/``1``, ``true``/``false``, ``yes``/``no``,
``on``/``off``): a typo is refused, not read as "on".
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, MutableMapping

# the process-wide accessors live in ``env`` (the kernels read them there); re-exported beside the
# run configuration for the callers that compose a run
from .env import (  # noqa: F401
    ENV_CACHE, ENV_CC, ENV_KERNELS, ENV_LLAMA_CPP_DIR, ENV_OMP_THREADS, MAX_THREADS_PER_CPU, c_compilers, cache_root,
    check_omp_threads, kernels_enabled, llama_cpp_dir,
)
from .env import environ as _env  # the process environment, unless a mapping is passed
from .env import draft_vocab, max_threads, parse_bool
from .env import value as _value
from .errors import BadInput
from .options import SpecOptions, publish, resolve

# the run configuration
ENV_WEIGHTS = "TSSPEC_WEIGHTS"  # the trunk's in-memory weight format (``--weights`` wins)
ENV_DRAFT_WEIGHTS = "TSSPEC_DRAFT_WEIGHTS"  # every drafter's own matrices (``--draft-weights`` wins)
ENV_DFLASH_CONV = "TS_DFLASH_CONV"  # =0: DFlash2's convolution off (attribution only)
ENV_DFLASH_SELECTOR = "TS_DFLASH_SELECTOR"  # =0: DFlash2's candidate selector off (attribution only)
ENV_VERIFY_SNAPSHOTS = "TS_Q35_VERIFY_SNAPSHOTS"  # =0: hybrid trunks restore and re-forward
ENV_DEVICE = "TSSPEC_DEVICE"  # auto | cpu | cuda (``--device`` wins)
# what a measurement records of the environment (``tsspec.bench.provenance``)
RECORDED_PREFIXES = ("TSSPEC_", "TS_SPEC_", "TS_MTP_", "TS_DFLASH_", "TS_Q35_", "TS_QWEN35_")

DEFAULT_WEIGHTS = "auto"  # the file's own GGUF blocks on the native kernels (pure torch without them)
DEFAULT_DEVICE = "auto"  # CUDA (the Triton kernels) when torch sees a GPU and triton imports, else the CPU
MIN_CTX = 16


def _switch(env: Mapping[str, str], name: str) -> bool:
    """An attribution switch: on unless set to a false word (``=0`` is the documented spelling)."""
    raw = _value(env, name)
    return True if raw is None else parse_bool(name, raw)


def _weight_format(env: Mapping[str, str], name: str, default: str) -> str:
    from .gguf_weight import FORMATS

    raw = _value(env, name)
    if raw is None:
        return default
    fmt = raw.strip().lower()
    if fmt not in FORMATS:
        raise BadInput(f"{name}={raw!r}: expected one of {', '.join(FORMATS)}")
    return fmt


def _device(flag: str | None, env: Mapping[str, str], weights: str) -> str:
    """The device the run computes on, resolved: "cpu" or "cuda". ``--device`` > ``TSSPEC_DEVICE`` >
    auto. "cuda" where it cannot run, or with a weight format other than auto (the Triton kernels
    read the file's own blocks), is one BadInput line; "auto" then quietly means the CPU."""
    from .kernels.device import DEVICES, cuda_unusable, resolve

    if flag is not None:
        name, raw = "--device", flag
    else:
        name, raw = ENV_DEVICE, _value(env, ENV_DEVICE)
    if raw is None:
        requested = DEFAULT_DEVICE
    else:
        requested = raw.strip().lower()
        if requested not in DEVICES:
            sep = " " if name.startswith("--") else "="
            raise BadInput(f"{name}{sep}{raw!r}: expected one of {', '.join(DEVICES)}")
    if requested == "cuda":
        said = f"{name} cuda" if name.startswith("--") else f"{name}={raw!r}"
        why = cuda_unusable()
        if why is not None:
            raise BadInput(f"{said}: {why}")
        if weights != "auto":
            raise BadInput(f"{said}: the GPU path runs the file's own GGUF blocks (weights auto), not weights {weights}")
    if requested == "auto" and weights != "auto":
        return "cpu"
    return resolve(requested)


# ----------------------------------------------------------------------------- the run configuration


@dataclass(frozen=True)
class RunConfig:
    """One run, fully resolved: what ``Session`` loads and how it speculates."""

    model: str | None = None  # a GGUF path or known model name; None: the default model
    weights: str = DEFAULT_WEIGHTS  # the trunk's format: --weights > TSSPEC_WEIGHTS > auto
    # every drafter's own matrices (a draft model, a head, a block drafter; what a head borrows
    # from the trunk stays the trunk's): --draft-weights > TSSPEC_DRAFT_WEIGHTS > the trunk's format
    draft_weights: str = DEFAULT_WEIGHTS
    ctx_size: int | None = None  # None: the model's default (4096, capped at its trained context)
    device: str = "cpu"  # resolved: "cpu" or "cuda" (--device > TSSPEC_DEVICE > auto)
    threads: int | None = None  # None: torch's choice
    spec: SpecOptions = field(default_factory=SpecOptions)  # flags > TS_SPEC_* > TS_MTP_* > defaults
    dflash_conv: bool = True  # TS_DFLASH_CONV
    dflash_selector: bool = True  # TS_DFLASH_SELECTOR
    verify_snapshots: bool = True  # TS_Q35_VERIFY_SNAPSHOTS
    draft_vocab: int | None = None  # TSSPEC_DRAFT_VOCAB (None: the draft model's default cut)
    warnings: tuple[str, ...] = ()  # what resolving found worth saying (disagreeing families, inert flags)

    def provenance(self) -> dict[str, Any]:
        """The resolved settings, for a measurement's metadata."""
        d = asdict(self)
        d.pop("warnings")
        return d


def check_threads(threads: int | None) -> int | None:
    if threads is not None:
        most = max_threads()
        if not 1 <= threads <= most:
            raise BadInput(f"--threads must be between 1 and {most} ({MAX_THREADS_PER_CPU} per CPU), got {threads}")
    return threads


def speculator_names() -> list[str]:
    """What ``--spec-type`` may name besides ``auto``: the registry's speculators, asked here, where
    the run is composed, so ``tsspec.options`` need not import the algorithm layer."""
    from .spec.registry import REGISTRY

    return REGISTRY.names()


class _SpeculatorNames(Sequence):
    """``speculator_names()`` asked only when read: a run that names no speculator (``--no-spec``,
    ``auto``) does not import the algorithm layer, nor torch through it, to resolve its settings."""

    @functools.cached_property
    def _names(self) -> list[str]:
        return speculator_names()

    def __getitem__(self, i):
        return self._names[i]

    def __len__(self) -> int:
        return len(self._names)


def resolve_run(
    *,
    model: str | None = None,
    weights: str | None = None,
    ctx_size: int | None = None,
    threads: int | None = None,
    speculation: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    device: str | None = None,
    draft_weights: str | None = None,
) -> RunConfig:
    """Flags (None = not given) and the environment -> a ``RunConfig``, or one ``BadInput`` line.

    ``speculation``: the speculation flags (see ``tsspec.options.resolve``); None for a command
    that takes no speculation from flags or the environment (``bench``: its configurations say it),
    which then runs with speculation off and does not read ``TS_SPEC_*``/``TS_MTP_*``.
    """
    from .gguf_weight import FORMATS

    env = _env(env)
    spec, warnings = (SpecOptions(), []) if speculation is None else resolve(
        speculation, env, speculators=_SpeculatorNames())
    check_threads(threads)
    for flag, value in (("--weights", weights), ("--draft-weights", draft_weights)):
        if value is not None and value not in FORMATS:
            raise BadInput(f"{flag} {value!r}: expected one of {', '.join(FORMATS)}")
    if ctx_size is not None and ctx_size < MIN_CTX:
        raise BadInput(f"--ctx-size must be >= {MIN_CTX}")
    weights = weights if weights is not None else _weight_format(env, ENV_WEIGHTS, DEFAULT_WEIGHTS)
    if draft_weights is None:
        draft_weights = _weight_format(env, ENV_DRAFT_WEIGHTS, weights)
    return RunConfig(
        model=model,
        weights=weights,
        draft_weights=draft_weights,
        ctx_size=ctx_size,
        device=_device(device, env, weights),
        threads=threads,
        spec=spec,
        dflash_conv=_switch(env, ENV_DFLASH_CONV),
        dflash_selector=_switch(env, ENV_DFLASH_SELECTOR),
        verify_snapshots=_switch(env, ENV_VERIFY_SNAPSHOTS),
        draft_vocab=draft_vocab(env),
        warnings=tuple(warnings),
    )


def speculation_variables(env: Mapping[str, str] | None = None) -> list[str]:
    """The speculation variables set (non-empty): both families and ``TS_QWEN35_DFLASH``. For a
    command that reads none of them (``bench``: its configurations say what each one runs) to name
    them as ignored."""
    from .options import ATTACH_DFLASH, FAMILIES

    env = _env(env)
    return [k for k in sorted(env) if (k.startswith(FAMILIES) or k == ATTACH_DFLASH) and env[k] != ""]


def publish_spec(opts: SpecOptions, env: MutableMapping[str, str] | None = None) -> None:
    """Write the resolved speculation settings under both families, for child processes."""
    publish(opts, _env(env))


# ----------------------------------------------------------------------------- provenance


def recorded_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Every tsspec variable in force (``RECORDED_PREFIXES``), sorted, for provenance."""
    env = _env(env)
    return {k: env[k] for k in sorted(env) if k.startswith(RECORDED_PREFIXES)}
