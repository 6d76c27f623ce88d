"""Benchmark configurations: what ``tsspec bench --config`` accepts, parsed into ``BenchConfig``.

Command-line form: ``[NAME=]ALGO[:key=value,...]``, for example::

    plain
    ngram
    ngram:draft=4
    ng4=ngram:draft=4
    draft-model:path=/x.gguf,draft=3,pmin=0.5
    draft-head
    block:draft=8

``NAME=`` is recognised only when the text before the first ``=`` has no ``:`` (so the
``=`` inside ``path=...`` is never taken for a name); without it the name is the spec text.

Known keys and their types: ``draft`` (int 1-64), ``pmin`` (float 0-1), ``path``/``model``
(str: the draft model), ``tree`` (int 0-64: token-tree nodes), ``accept`` (``match``|``residual``), ``adaptive`` (bool: 0/1/true/false/
yes/no/on/off). Any other key is refused, with the nearest known one suggested.
``None`` in a field means "the engine's default".

File form (TOML, ``tomllib``)::

    baseline = "plain"            # optional: the name of one of the configs below

    [configs.plain]
    algo = "plain"

    [configs.ng4]
    algo = "ngram"
    draft = 4

Every error raises ``tsspec.errors.BadInput`` with one line naming the bad spec or key.
The baseline defaults to ``plain`` (named "plain") when none is given.
"""

from __future__ import annotations

import difflib
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from tsspec.errors import BadInput
from tsspec.paths import MAX_CONFIG_BYTES, read_user_file
from tsspec.options import ACCEPT_RULES as _OPT_ACCEPT_RULES, DRAFT_MAX, DRAFT_MIN, bool_word

def algos() -> tuple[str, ...]:
    """``plain`` plus every registered speculator: the registry is the one list of algorithms."""
    from tsspec.spec.registry import REGISTRY

    return ("plain", *REGISTRY.names())
# the engine's own ranges and words (``tsspec.options``), so a config means what the flag means
ACCEPT_RULES = tuple(r for r in _OPT_ACCEPT_RULES if r != "auto")
DEFAULT_BASELINE = "plain"

# the options a config takes (anything else is refused: a typo must not run the defaults)
_TYPED_KEYS = {"draft", "pmin", "path", "model", "accept", "adaptive", "tree"}
_NAME_FORBIDDEN = set(":,= \t\n")


@dataclass(frozen=True)
class BenchConfig:
    """One configuration to measure. Fields left ``None`` take the engine's defaults."""

    name: str
    algo: str
    draft: int | None = None
    pmin: float | None = None
    draft_model: str | None = None
    accept: str | None = None
    adaptive: bool | None = None
    tree: int | None = None  # token-tree node budget (0: chains)
    # who runs it: tsspec itself, or a peer engine started beside it (``tsspec.bench.llama_server``)
    engine: str = "tsspec"

    def spec(self) -> str:
        """The canonical ``ALGO[:key=value,...]`` text (``ENGINE/ALGO`` for a peer's); a tsspec config's
        parses back to an equal config."""
        opts: list[str] = []
        if self.draft is not None:
            opts.append(f"draft={self.draft}")
        if self.pmin is not None:
            opts.append(f"pmin={self.pmin:g}")
        if self.draft_model is not None:
            opts.append(f"path={self.draft_model}")
        if self.accept is not None:
            opts.append(f"accept={self.accept}")
        if self.adaptive is not None:
            opts.append(f"adaptive={'1' if self.adaptive else '0'}")
        if self.tree is not None:
            opts.append(f"tree={self.tree}")
        prefix = "" if self.engine == "tsspec" else self.engine + "/"
        return prefix + self.algo + (":" + ",".join(opts) if opts else "")

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "engine": self.engine,
            "algo": self.algo,
            "spec": self.spec(),
            "draft": self.draft,
            "pmin": self.pmin,
            "draft_model": self.draft_model,
            "accept": self.accept,
            "adaptive": self.adaptive,
            "tree": self.tree,
        }


def plain_config(name: str = DEFAULT_BASELINE) -> BenchConfig:
    return BenchConfig(name=name, algo="plain")


# ----------------------------------------------------------------------------- value parsing


def _algo_key(text: str) -> str:
    return text.strip().lower().replace("_", "-")


def _algo(text: str, where: str) -> str:
    algo = _algo_key(text)
    known = algos()
    if algo not in known:
        raise BadInput(f"{where}: unknown algorithm {text.strip()!r} (known: {', '.join(known)})")
    return algo


def _int_tree(value: Any, where: str) -> int:
    from ..options import TREE_MAX

    try:
        n = int(str(value).strip()) if not isinstance(value, bool) else None
    except ValueError:
        n = None
    if n is None or not 0 <= n <= TREE_MAX:
        raise BadInput(f"{where}: tree must be a node count 0-{TREE_MAX} (0: chains), got {value!r}")
    return n


def _int_draft(value: Any, where: str) -> int:
    if isinstance(value, bool):
        raise BadInput(f"{where}: draft must be an integer {DRAFT_MIN}-{DRAFT_MAX}, got {value!r}")
    try:
        n = int(value) if isinstance(value, int) else int(str(value).strip(), 10)
    except ValueError:
        raise BadInput(f"{where}: draft must be an integer {DRAFT_MIN}-{DRAFT_MAX}, got {value!r}") from None
    if not DRAFT_MIN <= n <= DRAFT_MAX:
        raise BadInput(f"{where}: draft must be {DRAFT_MIN}-{DRAFT_MAX}, got {n}")
    return n


def _float_pmin(value: Any, where: str) -> float:
    if isinstance(value, bool):
        raise BadInput(f"{where}: pmin must be a number 0-1, got {value!r}")
    try:
        p = float(value) if isinstance(value, (int, float)) else float(str(value).strip())
    except ValueError:
        raise BadInput(f"{where}: pmin must be a number 0-1, got {value!r}") from None
    if not 0.0 <= p <= 1.0:  # also rejects nan
        raise BadInput(f"{where}: pmin must be 0-1, got {value!r}")
    return p


def _bool(value: Any, key: str, where: str) -> bool:
    if isinstance(value, bool):
        return value
    v = bool_word(str(value))
    if v is None:
        raise BadInput(f"{where}: {key} must be 0/1/true/false, got {value!r}")
    return v


def _accept(value: Any, where: str) -> str:
    text = str(value).strip().lower()
    if text not in ACCEPT_RULES:
        raise BadInput(f"{where}: accept must be one of {'|'.join(ACCEPT_RULES)}, got {value!r}")
    return text


def _check_name(name: str, where: str) -> str:
    if not name or any(c in _NAME_FORBIDDEN for c in name):
        raise BadInput(f"{where}: bad config name {name!r} (no spaces, ':', ',' or '=')")
    return name


def _build(name: str, algo: str, options: Mapping[str, Any], where: str) -> BenchConfig:
    """Typed fields from raw option values (strings from the CLI, native values from TOML)."""
    fields: dict[str, Any] = {}
    for key, value in options.items():
        if key in {"path", "model"}:
            if "draft_model" in fields:
                raise BadInput(f"{where}: give the draft model once (path= or model=)")
            text = str(value).strip()
            if not text:
                raise BadInput(f"{where}: {key} is empty")
            fields["draft_model"] = text
        elif key == "draft":
            fields["draft"] = _int_draft(value, where)
        elif key == "pmin":
            fields["pmin"] = _float_pmin(value, where)
        elif key == "accept":
            fields["accept"] = _accept(value, where)
        elif key == "adaptive":
            fields["adaptive"] = _bool(value, key, where)
        elif key == "tree":
            fields["tree"] = _int_tree(value, where)
        else:  # a typo ran the defaults silently once (ngram:drfat=4): say so instead
            near = difflib.get_close_matches(key, sorted(_TYPED_KEYS), n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise BadInput(f"{where}: unknown option {key!r}{hint}; options are {', '.join(sorted(_TYPED_KEYS))}")
    if algo == "plain":
        # plain decoding drafts nothing: a drafting option on it is a typo for another algo
        given = sorted(k for k in options if k in _TYPED_KEYS)
        if given:
            raise BadInput(f"{where}: plain takes no drafting options (got {', '.join(given)})")
    return BenchConfig(name=name, algo=algo, **fields)


# ----------------------------------------------------------------------------- command line


def _options_after_a_comma(raw: str, where: str) -> None:
    """``ngram,draft=4`` or ``fast=ngram,draft=4``: options written after a comma instead of a ':'
    read as a bad name or an unknown algorithm; say what was meant instead."""
    before, comma, after = raw.partition(",")
    if not comma or ":" in before:
        return
    name, eq, algo_text = before.rpartition("=")
    if _algo_key(algo_text) in algos():
        raise BadInput(f"{where}: options go after a ':' ({name}{eq}{algo_text.strip()}:{after}), "
                       "as in [NAME=]ALGO[:key=value,...]")


def parse_config(text: str) -> BenchConfig:
    """One ``[NAME=]ALGO[:key=value,...]`` spec from the command line."""
    raw = text.strip()
    where = f"config {text!r}"
    if not raw:
        raise BadInput("config: empty spec")
    _options_after_a_comma(raw, where)
    name: str | None = None
    head, eq, rest = raw.partition("=")
    if eq and ":" not in head:
        if not rest.strip():
            raise BadInput(f"{where}: nothing after {(head + '=')!r}")
        name = _check_name(head.strip(), where)
        raw = rest.strip()
    algo_text, colon, opts_text = raw.partition(":")
    algo = _algo(algo_text, where)
    options: dict[str, str] = {}
    if colon:
        if not opts_text.strip():
            raise BadInput(f"{where}: nothing after ':'")
        for item in opts_text.split(","):
            key, eq2, value = item.partition("=")
            key = key.strip().lower()
            if not eq2 or not key:
                raise BadInput(f"{where}: expected key=value, got {item.strip()!r}")
            if not value.strip():
                raise BadInput(f"{where}: {key} has no value")
            if key in options or (key in {"path", "model"} and ({"path", "model"} & options.keys())):
                raise BadInput(f"{where}: {key} given twice")
            options[key] = value.strip()
    # default name: the spec as typed, so "ngram:draft=4" is called just that in the report
    default_name = raw if colon else algo
    return _build(name or default_name, algo, options, where)


def parse_configs(texts: Iterable[str]) -> list[BenchConfig]:
    """Several specs; names must be unique."""
    configs = [parse_config(t) for t in texts]
    _check_unique(configs)
    return configs


def _check_unique(configs: Sequence[BenchConfig]) -> None:
    seen: set[str] = set()
    for c in configs:
        if c.name in seen:
            raise BadInput(f"config: name {c.name!r} given twice (use NAME=SPEC to tell them apart)")
        seen.add(c.name)


# ----------------------------------------------------------------------------- TOML file


@dataclass(frozen=True)
class ConfigFile:
    """What a TOML config file declares: configs in file order and an optional baseline name."""

    configs: list[BenchConfig]
    baseline: str | None = None


def load_config_file(path: str | Path) -> ConfigFile:
    """``[configs.NAME]`` tables (``algo`` plus keys as on the command line) from a TOML file."""
    p = Path(path)
    try:
        data = tomllib.loads(read_user_file(p, "--config-file", max_bytes=MAX_CONFIG_BYTES, encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise BadInput(f"config file {str(p)!r}: invalid TOML ({exc})") from None
    unknown = sorted(set(data) - {"configs", "baseline"})
    if unknown:
        raise BadInput(f"config file {str(p)!r}: unknown top-level key(s) {', '.join(unknown)}")
    tables = data.get("configs")
    if not isinstance(tables, dict) or not tables:
        raise BadInput(f"config file {str(p)!r}: no [configs.NAME] tables")
    configs: list[BenchConfig] = []
    for name, table in tables.items():
        where = f"config file {str(p)!r} [configs.{name}]"
        _check_name(name, where)
        if not isinstance(table, dict):
            raise BadInput(f"{where}: must be a table")
        if "algo" not in table:
            raise BadInput(f"{where}: missing algo")
        if not isinstance(table["algo"], str):
            raise BadInput(f"{where}: algo must be a string")
        algo = _algo(table["algo"], where)
        options = {str(k).lower(): v for k, v in table.items() if k != "algo"}
        configs.append(_build(name, algo, options, where))
    baseline = data.get("baseline")
    if baseline is not None:
        if not isinstance(baseline, str):
            raise BadInput(f"config file {str(p)!r}: baseline must be a config name")
        if baseline not in tables:
            raise BadInput(f"config file {str(p)!r}: baseline {baseline!r} is not one of the configs")
    return ConfigFile(configs=configs, baseline=baseline)


# ----------------------------------------------------------------------------- baseline


def resolve_configs(
    configs: Sequence[BenchConfig], baseline: str | BenchConfig | None = None
) -> list[BenchConfig]:
    """The list to run, baseline first.

    ``baseline`` is a config, the name of one of ``configs``, a spec to parse, or None. None
    picks the config named "plain", else adds ``plain`` (named "plain") in front.
    """
    configs = list(configs)
    _check_unique(configs)
    by_name = {c.name: c for c in configs}
    if baseline is None:
        base = by_name.get(DEFAULT_BASELINE) or plain_config()
    elif isinstance(baseline, BenchConfig):
        base = baseline
    elif baseline in by_name:
        base = by_name[baseline]
    else:
        base = parse_config(baseline)
    rest = [c for c in configs if c.name != base.name]
    if base.name in by_name and by_name[base.name] != base:
        raise BadInput(f"config: baseline name {base.name!r} clashes with a different config")
    return [base, *rest]
