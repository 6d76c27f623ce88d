"""The target side: one module per architecture, picked by GGUF ``general.architecture``.

Each module holds every fact of its architecture and exposes:

* ``TABLES``: a ``validate.ArchTables``, its ``{arch}.*`` keys with their defaults, the tensors of
  each block and any sizes it derives, which ``validate_model`` checks a file against;
* ``TRITON``: whether its trunk runs on the GPU path (``load_model(device="cuda")``);
* ``config(GGUFFile) -> ArchConfig`` and ``load(GGUFFile, fmt, n_ctx)``.

A new architecture is that module and one line in ``ARCHITECTURES``.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from typing import Any

from ..errors import BadInput, ModelFileError
from ..gguf_file import GGUFFile
from ..validate import check_model

ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3": "gemma3",
    "qwen35": "qwen35",
    "qwen3next": "qwen3next",
}
# Files whose architecture is a drafter, not a language model on its own.
DRAFTER_ARCHITECTURES = {"dflash", "tsspec-eagle"}


def arch_module(arch: str, name: str | None = None):
    """The module of a language-model architecture; a drafter's file or an unknown architecture is
    one ``ModelFileError`` (naming the file ``name`` when given)."""
    mod = ARCHITECTURES.get(arch)
    if mod is None:
        who = f"{name}: " if name else ""
        if arch in DRAFTER_ARCHITECTURES:
            raise ModelFileError(f"{who}a {arch} drafter, not a language model; attach it with --draft-model")
        known = ", ".join(sorted(ARCHITECTURES))
        raise ModelFileError(f"{who}unknown architecture {arch!r} (supported: {known})")
    return importlib.import_module(f"{__name__}.{mod}")


def triton_architectures() -> list[str]:
    """The architectures whose trunk runs on the GPU path (their module's ``TRITON``), sorted."""
    return sorted(a for a in ARCHITECTURES if arch_module(a).TRITON)


def validate_model(g: GGUFFile) -> dict[str, Any]:
    """Hyper-parameters and tensors of a language-model ``GGUFFile`` against its architecture's
    ``TABLES``; returns the checked hyper-parameters (``validate.check_hparams``), or {} for a file
    that is no language model of a known architecture (``arch_module`` names those)."""
    if g.arch not in ARCHITECTURES:
        return {}
    return check_model(g.path.name, arch_module(g.arch).TABLES, g.metadata, g.records)


def load_model(path: str | Path | GGUFFile, *, fmt: str | None = None, n_ctx: int | None = None,
               verify_snapshots: bool | None = None, device: str | None = None, triton: bool | None = None):
    """Load a GGUF language model as a ``SpecTarget`` (weights only: sequences get ``make_cache()``).

    ``verify_snapshots`` (hybrid trunks): how their caches undo a verify, per-row slots (True, the
    default) or copies and replay (False); see ``cache.HybridCache``. Ignored by attention trunks.
    ``device``: None or "cpu" for the CPU formats; "cuda" puts the trunk on the GPU with the Triton
    kernels over its GGUF blocks (``fmt`` "auto"). ``triton=True`` with device "cpu" runs those
    kernels on CPU tensors, which only Triton's interpreter can do (the tests' way to run them)."""
    import torch

    g = path if isinstance(path, GGUFFile) else GGUFFile(path)
    mod = arch_module(g.arch, g.path.name)
    dev = torch.device(device or "cpu")
    use_triton = dev.type == "cuda" if triton is None else triton
    if use_triton and not mod.TRITON:
        raise BadInput(f"{g.path.name}: {g.arch} trunks run on the CPU only for now (--device cpu); "
                       f"the GPU path takes {', '.join(triton_architectures())}")
    if use_triton and (fmt or "auto") not in ("auto", "gguf"):
        raise BadInput(f"the GPU path runs the file's own GGUF blocks (--weights auto), not --weights {fmt}")
    validate_model(g)
    try:
        model = mod.load(g, fmt=fmt, n_ctx=n_ctx, **({"device": dev} if use_triton else {}))
    except ModelFileError:
        raise
    except (KeyError, ValueError) as e:
        raise ModelFileError(f"{g.path.name}: inconsistent {g.arch} model: {e}") from None
    if verify_snapshots is not None and hasattr(model, "verify_snapshots"):
        model.verify_snapshots = verify_snapshots
    g.release_pages()  # the model holds its own copies now: the map's pages need not count as ours
    return model
