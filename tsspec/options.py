"""The operator surface for speculation: flags, legacy spellings and environment variables.

Every setting has a flag and an environment variable published under two families, ``TS_SPEC_*``
and ``TS_MTP_*`` (the second is a cross-language contract, not only a legacy alias). Resolution is a
pure function of the flags and an environment *mapping*: a flag beats the environment; if the two
families disagree, ``TS_SPEC_*`` wins and a warning says so. The resolved values are published back
under both names for child processes. This module never touches ``os.environ`` itself:
``tsspec.env`` is the one way to the process environment, which ``tsspec.settings`` passes in.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from difflib import get_close_matches
from typing import Any, Mapping, MutableMapping, Sequence

from .env import FALSE_WORDS, TRUE_WORDS, bool_word, parse_bool  # noqa: F401 (the words are env's; re-exported)
from .errors import BadInput

ACCEPT_RULES = ("auto", "match", "residual")
DRAFT_MIN, DRAFT_MAX, DRAFT_DEFAULT = 1, 64, 8
TREE_MAX = 64  # nodes of a token tree (0: chains)
FAMILIES = ("TS_SPEC_", "TS_MTP_")

# setting -> (environment suffix, flag name used in messages)
SETTINGS = {
    "enabled": ("SPEC", "--spec"),
    "type": ("TYPE", "--spec-type"),
    "draft": ("DRAFT", "--spec-draft"),
    "pmin": ("PMIN", "--spec-pmin"),
    "draft_model": ("DRAFT_MODEL", "--spec-draft-model"),
    "accept": ("ACCEPT", "--spec-accept"),
    "adaptive": ("ADAPTIVE", "--spec-adaptive"),
    "tree": ("TREE", "--spec-tree"),
}


@dataclass(frozen=True)
class SpecOptions:
    enabled: bool = False
    type: str = "auto"
    draft: int = DRAFT_DEFAULT
    draft_explicit: bool = False  # the user chose the window (a model's preference yields to it)
    pmin: float | None = None  # None: the algorithm's own default
    draft_model: str | None = None  # a drafter file or known model name
    accept: str = "auto"
    adaptive: bool = True  # the cost governor
    tree: int = 0  # node budget of a token-tree draft (0: chains); speculators that build trees take it
    attached: bool = False  # draft_model came from TS_QWEN35_DFLASH (for the trunks ATTACH_ARCHS names)
    attach_enabled: bool = False  # ... and so did ``enabled`` (no flag or variable set it)


def _parse(setting: str, name: str, raw: Any, speculators: Sequence[str] = ()) -> Any:
    """Validate one value (from a flag or the environment); errors name where it came from.
    ``speculators``: the names a ``type`` may take besides ``auto`` (the caller's registry)."""
    if setting in ("enabled", "adaptive"):
        return raw if isinstance(raw, bool) else parse_bool(name, str(raw))
    if setting == "draft":
        try:
            n = int(str(raw).strip())
        except ValueError:
            raise BadInput(f"{name}={raw!r}: expected an integer in [{DRAFT_MIN}, {DRAFT_MAX}]") from None
        if not DRAFT_MIN <= n <= DRAFT_MAX:
            raise BadInput(f"{name}={n}: out of range [{DRAFT_MIN}, {DRAFT_MAX}]")
        return n
    if setting == "tree":
        try:
            n = int(str(raw).strip())
        except ValueError:
            raise BadInput(f"{name}={raw!r}: expected a node count in [0, {TREE_MAX}] (0: chains)") from None
        if not 0 <= n <= TREE_MAX:
            raise BadInput(f"{name}={n}: out of range [0, {TREE_MAX}] (0: chains)")
        return n
    if setting == "pmin":
        try:
            f = float(str(raw).strip())
        except ValueError:
            raise BadInput(f"{name}={raw!r}: expected a number in [0, 1]") from None
        if not 0.0 <= f <= 1.0:
            raise BadInput(f"{name}={f}: out of range [0, 1]")
        return f
    if setting == "type":
        v = str(raw).strip()
        known = ["auto", *speculators]
        if "," in v:  # a cascade of named speculators, asked in order
            parts = [p.strip() for p in v.split(",")]
            bad = [p for p in parts if p not in speculators or p == "cascade"]
            if bad:
                raise BadInput(f"{name}={raw!r}: {bad[0]!r} cannot be a cascade member (choose from "
                               f"{', '.join(x for x in speculators if x != 'cascade')})")
            if len(set(parts)) != len(parts):
                raise BadInput(f"{name}={raw!r}: a cascade names each speculator once")
            return ",".join(parts)
        if v not in known:
            raise BadInput(f"{name}={raw!r}: unknown speculator (choose from {', '.join(known)}, "
                           "or a comma list such as ngram,draft-model)")
        return v
    if setting == "accept":
        v = str(raw).strip()
        if v not in ACCEPT_RULES:
            raise BadInput(f"{name}={raw!r}: expected one of {', '.join(ACCEPT_RULES)}")
        return v
    if setting == "draft_model":
        v = str(raw).strip()
        if not v:
            raise BadInput(f"{name}: empty path")
        return v
    raise AssertionError(setting)


# names of the two families that other engines of the same contract read and tsspec does not, and why
NOT_READ = {
    "FOLD_CATCHUP": "tsspec always folds a draft head's catch-up into its first draft step",
}
# the design's per-model way to attach a DFlash drafter (as ``--draft-model`` does): read, with the
# lowest precedence among the drafter's names, for the trunks it names (the session ignores it, with
# a warning, for any other: ``without_attach``)
ATTACH_DFLASH = "TS_QWEN35_DFLASH"
ATTACH_ARCHS = ("qwen35",)
# the same contract's names for models tsspec has no architecture for: warned about, never read
NOT_READ_ATTACH = {
    "TS_MUSE_GLIMMER_DFLASH": "tsspec has no Muse-Glimmer architecture; attach a drafter with --draft-model",
}


def unknown_env(env: Mapping[str, str]) -> list[str]:
    """One warning per set variable of the two families that is not a setting (a typo is otherwise
    silently ignored), naming the nearest setting where one is close."""
    suffixes = [suffix for suffix, _flag in SETTINGS.values()]
    out = []
    for name in sorted(env):
        fam = next((f for f in FAMILIES if name.startswith(f)), None)
        if fam is None or name[len(fam):] in suffixes or env[name] == "":
            continue
        why = NOT_READ.get(name[len(fam):])
        if why:
            out.append(f"{name} is not read by tsspec ({why}); ignored")
            continue
        near = get_close_matches(name[len(fam):], suffixes, n=1, cutoff=0.6)  # the shared prefix says nothing
        hint = f"did you mean {fam}{near[0]}?" if near else f"the settings are {', '.join(fam + s for s in suffixes)}"
        out.append(f"{name} is not a tsspec setting; ignored ({hint})")
    return out


def read_env(env: Mapping[str, str], warnings: list[str], speculators: Sequence[str]) -> dict[str, Any]:
    """Settings found in the environment, validated; TS_SPEC_* wins over a disagreeing TS_MTP_*; a
    variable of either family that is no setting is warned about (``unknown_env``), and so is an
    attach variable of a model tsspec does not have (``NOT_READ_ATTACH``)."""
    warnings.extend(unknown_env(env))
    warnings.extend(f"{name} is not read by tsspec ({why}); ignored"
                    for name, why in NOT_READ_ATTACH.items() if env.get(name, "") != "")
    out: dict[str, Any] = {}
    for setting, (suffix, _flag) in SETTINGS.items():
        vals = {fam + suffix: env[fam + suffix] for fam in FAMILIES if env.get(fam + suffix, "") != ""}
        if not vals:
            continue
        parsed = {k: _parse(setting, k, v, speculators) for k, v in vals.items()}
        spec_key, mtp_key = FAMILIES[0] + suffix, FAMILIES[1] + suffix
        if len(parsed) == 2 and parsed[spec_key] != parsed[mtp_key]:
            warnings.append(
                f"{spec_key}={vals[spec_key]} and {mtp_key}={vals[mtp_key]} disagree; using {spec_key}"
            )
        out[setting] = parsed.get(spec_key, parsed.get(mtp_key))
    return out


def resolve(flags: Mapping[str, Any], env: Mapping[str, str], *,
            speculators: Sequence[str]) -> tuple[SpecOptions, list[str]]:
    """Flags (None = not given) over environment over defaults. -> (options, warnings).

    ``flags`` keys: enabled, type, draft, pmin, draft_model, accept, adaptive, and
    ``block_drafter`` (``--draft-model``, which implies ``--spec`` unless ``--no-spec``).
    ``speculators``: the names ``--spec-type`` may take besides ``auto``; the caller asks the
    registry (``tsspec.settings.resolve_run``), so this surface sits below the algorithms it names.
    ``TS_QWEN35_DFLASH`` in ``env`` names a drafter as ``--draft-model`` does (speculation on unless
    a flag or variable turns it off), below every other way of naming one.
    """
    warnings: list[str] = []
    envv = read_env(env, warnings, speculators)
    vals: dict[str, Any] = {}
    for setting, (_suffix, flag) in SETTINGS.items():
        f = flags.get(setting)
        if f is not None:
            vals[setting] = _parse(setting, flag, f, speculators)
        elif setting in envv:
            vals[setting] = envv[setting]
    block = flags.get("block_drafter")
    attach = env.get(ATTACH_DFLASH, "")
    attached = attach_enabled = False
    if attach != "":
        attach = _parse("draft_model", ATTACH_DFLASH, attach)
        if block is None and "draft_model" not in vals:  # like --draft-model, named in the environment
            vals["draft_model"] = attach
            attached = True
            if "enabled" not in vals:
                vals["enabled"] = attach_enabled = True
        elif (block if block is not None else vals["draft_model"]) != attach:
            warnings.append(f"{ATTACH_DFLASH}={attach} is not used: a flag or TS_SPEC_DRAFT_MODEL / "
                            "TS_MTP_DRAFT_MODEL names another drafter")
    if block is not None:
        block = _parse("draft_model", "--draft-model", block)
        if vals.get("draft_model") and vals["draft_model"] != block and flags.get("draft_model") is not None:
            raise BadInput("--draft-model and --spec-draft-model name different files; give one")
        vals["draft_model"] = block
        if flags.get("enabled") is None:
            vals["enabled"] = True  # --draft-model implies --spec unless --no-spec
    opts = SpecOptions(
        enabled=vals.get("enabled", False),
        type=vals.get("type", "auto"),
        draft=vals.get("draft", DRAFT_DEFAULT),
        draft_explicit="draft" in vals,
        pmin=vals.get("pmin"),
        draft_model=vals.get("draft_model"),
        accept=vals.get("accept", "auto"),
        adaptive=vals.get("adaptive", True),
        tree=vals.get("tree", 0),
        attached=attached,
        attach_enabled=attach_enabled,
    )
    if not opts.enabled:
        tuned = [SETTINGS[s][1] for s in ("type", "draft", "pmin", "draft_model", "accept", "adaptive", "tree")
                 if flags.get(s) is not None]
        if block is not None:
            tuned.append("--draft-model")
        if tuned:
            warnings.append(f"{', '.join(tuned)} {'is' if len(tuned) == 1 else 'are'} inert with speculation off (--no-spec)")
    return opts, warnings


def publish(opts: SpecOptions, env: MutableMapping[str, str]) -> None:
    """Write the resolved settings under both families into ``env`` (``tsspec.settings.publish_spec``
    passes the process environment, for child processes)."""
    values = {
        "SPEC": "1" if opts.enabled else "0",
        "TYPE": opts.type,
        "DRAFT": str(opts.draft),
        "ACCEPT": opts.accept,
        "ADAPTIVE": "1" if opts.adaptive else "0",
        "TREE": str(opts.tree),
    }
    if opts.pmin is not None:
        values["PMIN"] = repr(opts.pmin)
    if opts.draft_model:
        values["DRAFT_MODEL"] = opts.draft_model
    for fam in FAMILIES:
        for suffix, v in values.items():
            env[fam + suffix] = v


def without_attach(opts: SpecOptions) -> SpecOptions:
    """``opts`` without the drafter ``TS_QWEN35_DFLASH`` named (and the speculation it turned on)."""
    if not opts.attached:
        return opts
    return replace(opts, draft_model=None, attached=False, attach_enabled=False,
                   enabled=opts.enabled and not opts.attach_enabled)


def with_window(opts: SpecOptions, preferred: int | None) -> SpecOptions:
    """A model's preferred window applies unless the user chose one."""
    if preferred is None or opts.draft_explicit:
        return opts
    return replace(opts, draft=min(opts.draft, preferred))
