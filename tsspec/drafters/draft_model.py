"""A full language model attached as a drafter (``draft-model``): checked against the trunk, then loaded.

Contract:

* ``load(g, target, options)`` checks compatibility from metadata alone, before any weight is
  read, against the *trunk's file* (``target.path``): the token ids must mean the same thing in
  both files, because the drafter's ids go straight into the trunk and back.

  - ``tokenizer.ggml.model`` must agree; the token lists must agree on every id they share;
  - a longer list is allowed only when its extra ids are padding (type UNUSED, or spelled like
    ``[PAD151643]`` / ``<|extra_0|>`` / ``<unused3>``), at most ``MAX_PADDING_TOKENS`` of them,
    which is how real sibling files differ;
  - ``bos``/``eos``/``eot`` ids must agree where both files define them;
  - the embedding matrix may be larger than the token list (both Qwen2.5 files pad to 151936);
    the speculator cuts (or pads with -inf) the drafter's logits to the trunk's width.

  Anything else is one ``BadInput`` naming the first difference. What was allowed is listed in
  ``drafter.notes``; ``drafter.warnings`` says when the drafter is heavier than the trunk or has a
  shorter context (drafting then stops where the drafter's context ends).
* The drafter is loaded with ``load_model(g, n_ctx=target.max_context, fmt=...)``: its own KV
  cache, in the drafter format the run configuration resolved (``--draft-weights`` >
  ``TSSPEC_DRAFT_WEIGHTS`` > the trunk's format, ``auto`` by default). The ``draft-model`` registry entry builds its speculator.

Why ``auto`` by default: a drafter only guesses, so its precision costs some acceptance, never
correctness; its speed relative to the trunk is what decides the win, and since the native kernels
``int4`` (torch's kernel) is the slower one: qwen2.5-coder-0.5b drafting for 1.5b, decode-only
0.78x -> 0.89x on prose and 0.81x -> 0.97x on grounded prompts (12 prompts each).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..errors import BadInput, ModelFileError
from ..gguf_file import GGUFFile
from . import DrafterOptions, drafter_format

MAX_PADDING_TOKENS = 128  # llama.cpp's SPEC_VOCAB_MAX_SIZE_DIFFERENCE
UNUSED = 5  # gguf TokenType.UNUSED
_PADDING_RE = re.compile(r"^(\[PAD\d*\]|<\|?(pad|extra|unused|reserved)[_a-z0-9]*\|?>)$", re.IGNORECASE)
SPECIAL_IDS = ("bos", "eos", "eot")


@dataclass
class DraftModelDrafter:
    """A loaded draft model bound to a trunk (served by the registry's ``draft-model`` entry)."""

    model: Any  # TransformerModel with its own KV cache
    path: Any
    trunk_vocab: int  # the trunk's logit width: drafts and draft probabilities live in it
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    speculator_name: str = "draft-model"
    # measured best window (scripts/bench_draft_model.py, Qwen2.5-Coder 0.5B -> 1.5B, code);
    # the caller applies it with ``options.with_window`` unless the user chose a window
    preferred_window: int | None = 4
    draft_head: Any = None  # a whole language model drafts; there is no head to drive
    head_prefix: int | None = None  # ``DrafterOptions.draft_vocab``: the cut of its LM head (None: the default)


def _is_padding(text: str, ttype: int | None) -> bool:
    return ttype == UNUSED or bool(_PADDING_RE.match(text))


def _show(tok: str) -> str:
    return repr(tok) if len(tok) <= 40 else repr(tok[:37] + "...")


def _token_list(meta: Mapping[str, Any], who: str) -> list[str]:
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is None:
        return []
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise ModelFileError(f"{who} metadata tokenizer.ggml.tokens is not a list of strings")
    return tokens


def check_vocab(trunk: Mapping[str, Any], draft: Mapping[str, Any]) -> list[str]:
    """Compare two files' tokenizer metadata; -> notes on what was allowed, or ``BadInput``.

    Pure: takes the two metadata dicts, so tests can feed it hand-made ones.
    """
    notes: list[str] = []
    tm, dm = trunk.get("tokenizer.ggml.model"), draft.get("tokenizer.ggml.model")
    if tm != dm:
        raise BadInput(f"draft model tokenizer type differs from the trunk's: {dm!r} vs {tm!r}")
    tt: list[str] = _token_list(trunk, "trunk")
    dt: list[str] = _token_list(draft, "draft model")
    if not tt or not dt:
        raise BadInput("draft model and trunk must both carry a token list (tokenizer.ggml.tokens) to be compared")
    shared = min(len(tt), len(dt))
    if tt[:shared] != dt[:shared]:
        i = next(i for i in range(shared) if tt[i] != dt[i])
        raise BadInput(
            f"draft model vocabulary differs from the trunk's at token {i}: {_show(dt[i])} vs {_show(tt[i])}"
        )
    if len(tt) != len(dt):
        longer, who = (dt, "draft model") if len(dt) > len(tt) else (tt, "trunk")
        key = "tokenizer.ggml.token_type"
        types = (draft if longer is dt else trunk).get(key) or []
        extra = range(shared, len(longer))
        for i in extra:
            if not _is_padding(longer[i], types[i] if i < len(types) else None):
                raise BadInput(
                    f"draft model vocabulary differs from the trunk's at token {i}: the draft model has "
                    f"{len(dt)} tokens, the trunk {len(tt)}, and the {who}'s token {i} {_show(longer[i])} "
                    "is not padding"
                )
        if len(extra) > MAX_PADDING_TOKENS:
            raise BadInput(
                f"draft model vocabulary differs from the trunk's in size: {len(dt)} vs {len(tt)} tokens "
                f"(more than {MAX_PADDING_TOKENS} padding tokens apart)"
            )
        notes.append(f"the {who} has {len(extra)} trailing padding token(s) beyond the shared {shared}")
    for name in SPECIAL_IDS:
        key = f"tokenizer.ggml.{name}_token_id"
        a, b = draft.get(key), trunk.get(key)
        for who, v in (("draft model", a), ("trunk", b)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
                raise ModelFileError(f"{who} metadata {key} should be a token id, found {_show(str(v))}")
        if a is not None and b is not None and a != b:
            raise BadInput(f"draft model {name} token id differs from the trunk's: {a} vs {b}")
        if (a is None) != (b is None):
            notes.append(f"only the {'draft model' if a is not None else 'trunk'} defines a {name} token id")
    if trunk.get("tokenizer.ggml.pre") != draft.get("tokenizer.ggml.pre"):
        # ids flow between the models; only the trunk's tokenizer ever splits text
        notes.append(
            f"pre-tokenizers differ ({draft.get('tokenizer.ggml.pre')!r} vs {trunk.get('tokenizer.ggml.pre')!r}); "
            "only the trunk's is used"
        )
    return notes


def _file_bytes(g: GGUFFile) -> int:
    return sum(g.tensor_info(n).n_bytes for n in g.tensor_names())


def load(g: GGUFFile, target, options: DrafterOptions) -> DraftModelDrafter:
    from ..models import ARCHITECTURES, load_model

    if g.arch not in ARCHITECTURES:
        raise ModelFileError(
            f"{g.path.name}: architecture {g.arch!r} is not a language model; a draft model must be one "
            f"({', '.join(sorted(ARCHITECTURES))})"
        )
    trunk_path = getattr(target, "path", None)
    notes: list[str] = []
    warnings: list[str] = []
    trunk_file = None
    if trunk_path is not None:
        trunk_file = GGUFFile(trunk_path)
        notes += check_vocab(trunk_file.metadata, g.metadata)
    else:
        notes.append("the trunk has no file to compare token lists with; only vocabulary sizes were checked")

    # on the trunk's device when it runs on the GPU and the drafter's format is the file's own blocks
    fmt = drafter_format(options, target)
    on_gpu = getattr(target, "triton", False) and fmt == "auto"
    model = load_model(g, n_ctx=target.max_context, fmt=fmt,
                       device=target.device if on_gpu else None, triton=True if on_gpu else None)
    tv, dv = int(target.vocab_size), int(model.vocab_size)
    n_tokens = len(g.get("tokenizer.ggml.tokens") or [])
    if trunk_file is None and tv != dv:
        raise BadInput(f"draft model vocabulary size differs from the trunk's: {dv} vs {tv}")
    if n_tokens and dv > n_tokens:
        notes.append(f"the draft model's embedding has {dv} rows for {n_tokens} tokens (padding rows)")
    if dv != tv:
        notes.append(f"logit widths differ ({dv} vs the trunk's {tv}); drafts are cut to the trunk's vocabulary")

    trunk_bytes = target.weight_bytes() if hasattr(target, "weight_bytes") else (
        _file_bytes(trunk_file) if trunk_file is not None else None)
    draft_bytes = model.weight_bytes()
    if trunk_bytes is not None and draft_bytes > trunk_bytes:
        warnings.append(
            f"the draft model has more weight bytes than the trunk ({draft_bytes / 1e6:.0f} MB vs "
            f"{trunk_bytes / 1e6:.0f} MB): drafting will likely cost more than it saves"
        )
    if model.max_context < target.max_context:
        warnings.append(
            f"the draft model's context ({model.max_context}) is shorter than the trunk's "
            f"({target.max_context}); drafting stops beyond it"
        )
    return DraftModelDrafter(model=model, path=g.path, trunk_vocab=tv, notes=notes, warnings=warnings,
                             head_prefix=options.draft_vocab)
