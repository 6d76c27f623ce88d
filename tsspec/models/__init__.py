"""The target side: one module per architecture, picked by GGUF ``general.architecture``.

Each module exposes ``config(GGUFFile) -> ArchConfig`` and ``load(GGUFFile, fmt, n_ctx)``.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from ..errors import BadInput, ModelFileError
from ..gguf_file import GGUFFile
from ..validate import validate_model

ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3": "gemma3",
    "qwen35": "qwen35",
    "qwen3next": "qwen3next",
}
# Architectures whose trunk runs on the Triton backend (``device`` in ``load_model``): the
# llama-family transformer of ``base``. The hybrid trunks' recurrence has no Triton kernel yet.
TRITON_ARCHITECTURES = {"llama", "qwen2", "qwen3", "gemma3"}
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
    if use_triton and g.arch not in TRITON_ARCHITECTURES:
        raise BadInput(f"{g.path.name}: {g.arch} trunks run on the CPU only for now (--device cpu); "
                       f"the GPU path takes {', '.join(sorted(TRITON_ARCHITECTURES))}")
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
    return model
