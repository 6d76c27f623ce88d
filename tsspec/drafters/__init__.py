"""Draft weights: thin, model-specific adapters over trained drafters, attached by file.

The attached file's ``general.architecture`` decides what it is, never its name:

* a full language model (``llama``, ``qwen2``, ...) -> a separate draft model (``draft-model``);
* ``dflash`` -> a block drafter (``block``);
* a file holding only NextN/MTP tensors -> a per-token draft head (``draft-head``).

Each adapter module exposes ``load(g: GGUFFile, target, options) -> Drafter``; a ``Drafter`` has a
``speculator_name`` (which registry entry serves it) and ``make_speculator(target, options)``, and
may carry a ``draft_head`` (layer 3) for the speculators that drive one.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from ..errors import ModelFileError
from ..gguf_file import GGUFFile

ADAPTERS = {
    "dflash": "tsspec.drafters.dflash",
    "nextn": "tsspec.drafters.nextn",
}
LANGUAGE_MODEL_ADAPTER = "tsspec.drafters.draft_model"


def load_drafter(path: str | Path, target, options):
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
            "(a language model, a dflash drafter, or a NextN/MTP head)"
        )
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError:
        raise ModelFileError(f"{g.path.name}: {arch} drafters are not supported yet") from None
    return mod.load(g, target, options)
