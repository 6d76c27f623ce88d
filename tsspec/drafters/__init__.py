"""Draft weights: thin, model-specific adapters over trained drafters, attached by file.

The attached file's ``general.architecture`` decides what it is, never its name:

* a full language model (``llama``, ``qwen2``, ...) -> a separate draft model (``draft-model``);
* ``dflash`` -> a block drafter (``block``);
* a file holding only NextN/MTP tensors -> a per-token draft head (``draft-head``);
* ``tsspec-eagle`` (written by ``tsspec distill --kind head``) -> a trained per-token head (``draft-head``).

Adapters only load and validate weights: each module exposes
``load(g: GGUFFile, target, options: DrafterOptions) -> Drafter``, and ``tsspec.spec.registry``
builds the speculator that drives a drafter. Every ``Drafter`` has the attributes of the
``Drafter`` protocol below. Nothing here reads the environment: ``DrafterOptions`` comes from the
resolved run configuration (``tsspec.settings.RunConfig``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..errors import BadInput, ModelFileError
from ..gguf_file import GGUFFile

ADAPTERS = {
    "dflash": "tsspec.drafters.dflash",
    "nextn": "tsspec.drafters.nextn",
    "tsspec-eagle": "tsspec.drafters.eagle",
}
LANGUAGE_MODEL_ADAPTER = "tsspec.drafters.draft_model"


@dataclass(frozen=True)
class DrafterOptions:
    """How to load a drafter. Every kind (a draft model, a draft head, a block drafter) holds its
    own matrices in ``weights`` (None: the trunk's format); what a head or a block drafter borrows
    from the trunk (its embedding, its LM head) stays as the trunk holds it. The two DFlash2
    switches exist for attribution only (the weights were trained with both)."""

    weights: str | None = None
    dflash_conv: bool = True
    dflash_selector: bool = True
    # a draft model's LM head cut to its first ids and its sequence's (``TSSPEC_DRAFT_VOCAB``; 0: the
    # whole head; None: the speculator's default, ``spec.draft_model.DEFAULT_HEAD_PREFIX``)
    draft_vocab: int | None = None


def drafter_format(options: DrafterOptions | None, target) -> str:
    """The format a drafter's own matrices load in: ``options.weights``, else the trunk's."""
    from ..weights import load_format

    chosen = options.weights if options is not None else None
    return load_format(chosen or getattr(target, "weight_format", None))


class Drafter(Protocol):
    """What every adapter's ``load`` returns."""

    speculator_name: str  # the registry entry that serves it ("draft-model", "block", "draft-head")
    draft_head: Any  # a ``DraftHead`` (layer 3) the speculator drives, or None (a draft model)
    path: Any  # the file it was loaded from
    notes: list[str]  # what was allowed or found, for the operator
    warnings: list[str]  # what is likely to go badly
    preferred_window: int | None  # a measured best draft window, or None (the trunk's or the default)


def load_drafter(path: str | Path, target, options: DrafterOptions | None = None) -> Drafter:
    """Open a drafter file and bind it to ``target``; incompatibility is one clear error."""
    from ..models import ARCHITECTURES

    g = GGUFFile(path)
    arch = g.arch
    names = g.tensor_names()
    # llama.cpp writes MTP-only files under the trunk's architecture name: tensors decide
    head_only = any(n.endswith(".nextn.eh_proj.weight") for n in names) and "blk.0.attn_norm.weight" not in names
    if arch in ADAPTERS:
        module = ADAPTERS[arch]
    elif head_only:
        module = ADAPTERS["nextn"]
    elif arch in ARCHITECTURES:
        module = LANGUAGE_MODEL_ADAPTER
    else:
        raise ModelFileError(
            f"{g.path.name}: architecture {arch!r} is not a drafter this tool can use "
            "(a language model, a dflash drafter, a NextN/MTP head, or a head tsspec distill wrote)"
        )
    if getattr(target, "triton", False) and module != LANGUAGE_MODEL_ADAPTER:
        # heads and block drafters borrow the trunk's embedding and head and read its activations
        # on the host; the GPU path has no kernels for them yet
        raise BadInput(f"{g.path.name}: a {arch} drafter runs with --device cpu only for now "
                       "(on the GPU, --spec-type ngram or a separate draft model)")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError:
        raise ModelFileError(f"{g.path.name}: {arch} drafters are not supported yet") from None
    return mod.load(g, target, options or DrafterOptions())
