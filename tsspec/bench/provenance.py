"""Where a measurement came from: enough to trace every published number to its code, settings and
machine (recorded in ``tsspec bench``'s JSON and by ``scripts/bench_vs_llamacpp.py``).

* ``git_state()``: the tsspec checkout's commit and its changed paths (untracked ones too: a new
  kernel file changes the numbers); ``None`` fields outside a git checkout.
* ``cpu()``: model name and the SIMD flags the kernels care about.
* ``spec_env()``: every ``TSSPEC_*``, ``TS_SPEC_*``, ``TS_MTP_*``, ``TS_DFLASH_*`` and ``TS_Q35_*``
  variable in force (the resolved settings themselves are recorded by the caller, from
  ``tsspec.settings.RunConfig``).
* ``weight_formats(model)``: the formats a loaded model's products actually use, counted (not the
  format that was asked for: ``auto`` resolves per tensor, and that is what a reader needs).
* ``machine_info()``: platform, core counts and library versions.

Pure parsers (``cpu_model``, ``cpu_flags``, ``parse_porcelain``) are split from the readers so
tests feed them text.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..settings import RECORDED_PREFIXES, recorded_env

ENV_PREFIXES = RECORDED_PREFIXES
# the CPU features the native kernels test for, or whose absence explains a slow run
SIMD_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni")
REPO = Path(__file__).resolve().parents[2]


def _run(argv: Sequence[str], cwd: Path | None = None) -> str | None:
    """stdout of a command that succeeded, else None."""
    try:
        r = subprocess.run(list(argv), cwd=cwd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


def parse_porcelain(text: str) -> list[str]:
    """``git status --porcelain`` text -> its ``XY path`` entries."""
    return [line.rstrip() for line in text.splitlines() if len(line) > 3]


def git_state(repo: Path = REPO) -> dict[str, Any]:
    if not (repo / ".git").exists():
        return {"commit": None, "dirty": None, "dirty_files": []}
    commit = _run(["git", "rev-parse", "HEAD"], repo)
    changed = parse_porcelain(_run(["git", "status", "--porcelain"], repo) or "")
    return {"commit": commit.strip() if commit else None, "dirty": bool(changed), "dirty_files": changed}


def cpu_model(cpuinfo: str) -> str:
    """The first ``model name`` of a /proc/cpuinfo text ('' if none)."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "model name":
            return value.strip()
    return ""


def cpu_flags(cpuinfo: str) -> list[str]:
    """The ``SIMD_FLAGS`` present in the first ``flags`` line of a /proc/cpuinfo text."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            have = set(value.split())
            return [f for f in SIMD_FLAGS if f in have]
    return []


def cpu() -> dict[str, Any]:
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        text = ""
    return {"model": cpu_model(text) or platform.processor() or None, "simd_flags": cpu_flags(text)}


def spec_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Every tsspec variable in ``environ`` (default: the process's, read by ``tsspec.settings``)."""
    return recorded_env(environ)


def weight_formats(model: Any) -> dict[str, int]:
    """How many of a loaded model's products run in each format: ``gguf:<type>`` for the native
    kernels (one count per GGUF part), else the ``Linear``'s format (``int4``, ``bf16``, ``f32``).
    Walks the model's attributes, lists and dicts; tensors and arrays are not entered."""
    import torch

    from ..weights import Linear

    counts: Counter[str] = Counter()
    seen: set[int] = set()
    stack = [model]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (torch.Tensor, np.ndarray, str, bytes, int, float, type(None))):
            continue
        seen.add(id(obj))
        if isinstance(obj, Linear):
            if obj.fmt == "gguf":
                counts.update(f"gguf:{p.type_name}" for p in obj.parts)
            else:
                counts[obj.fmt] += 1
            continue
        if isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
        elif hasattr(obj, "__slots__"):
            stack.extend(getattr(obj, s) for s in obj.__slots__ if hasattr(obj, s))
    return dict(sorted(counts.items()))


def _version(dist: str) -> str | None:
    # metadata only: importing torch just to print its version costs seconds
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": cpu(),
        "cpu_count": os.cpu_count(),
        "cpu_usable": usable,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": _version("torch"),
        "tsspec": _version("tsspec"),
    }


def kernels_info() -> dict[str, Any]:
    """Whether the native kernels ran, and if not, why."""
    from .. import kernels

    return {"native": kernels.available(), "simd": kernels.simd(), "isa": kernels.level(), "unavailable": kernels.unavailable_reason(),
            "amx": kernels.amx_status(), "prompt_tiles": kernels.prompt_tiles_status()}
