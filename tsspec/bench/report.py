"""Presenting a ``BenchResult``: Rich tables, JSON for scripts, CSV, and a PNG plot.

* ``render_table(result, console)``: one table per workload (config, median tok/s [IQR],
  ratio vs baseline [95 % CI], verdict, acceptance, tokens/verify, parks, text-identical),
  the noise floor under each table; with a peer engine (``--peer``) a second table per workload,
  each engine against its own plain decoding; and, before everything, a loud red panel when any
  configuration's tokens differed from the baseline's (a correctness bug: its speed is void).
* ``to_json(result)``: a JSON-ready dict with everything (summaries, every measurement, the run
  schedule, mismatches, metadata). Non-finite floats become ``None``.
* ``write_csv(result, path)``: one row per workload x configuration.
* ``plot(result, path)``: per workload, each configuration's ratio with its CI as an error bar,
  a line at 1.0 and the noise band shaded; ~900x500 px PNG. matplotlib is imported lazily, Agg
  canvas only (no pyplot, no global backend switch); missing matplotlib is a ``TsspecError``.
"""

from __future__ import annotations

import csv
import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.text import Text
from rich.panel import Panel
from rich.table import Table

from tsspec.bench import stats
from tsspec.bench.runner import BenchResult, ConfigResult, WorkloadResult
from tsspec.errors import TsspecError

# counter names the engine reports (see tsspec.bench.runner); first present wins
ACCEPT_KEYS = ("acceptance_rate", "accept_rate", "acceptance")
TPV_KEYS = ("tokens_per_verify",)
PARKS_KEYS = ("governor_parks", "parks")

_VERDICT_STYLE = {
    stats.FASTER: "bold green",
    stats.SLOWER: "bold red",
    stats.WITHIN_NOISE: "yellow",
    "baseline": "dim",
}


def _counter(counters: dict[str, Any], keys: tuple[str, ...]) -> float | int | None:
    for k in keys:
        v = counters.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return v
    return None


def acceptance(cr: ConfigResult) -> float | None:
    """Acceptance rate: accepted/drafted from summed counts when present, else the mean rate."""
    acc, drafted = cr.counters.get("accepted"), cr.counters.get("drafted")
    if isinstance(acc, int) and isinstance(drafted, int) and drafted > 0:
        return acc / drafted
    v = _counter(cr.counters, ACCEPT_KEYS)
    return None if v is None else float(v)


def tokens_per_verify(cr: ConfigResult) -> float | None:
    v = _counter(cr.counters, TPV_KEYS)
    return None if v is None else float(v)


def parks(cr: ConfigResult) -> int | None:
    v = _counter(cr.counters, PARKS_KEYS)
    return None if v is None else int(v)


def _fmt_ratio(r: stats.RatioSummary) -> str:
    hi = "inf" if not math.isfinite(r.ci_high) else f"{r.ci_high:.3f}"
    return f"{r.estimate:.3f} [{r.ci_low:.3f}, {hi}]"


def _verdict_text(cr: ConfigResult) -> tuple[str, str]:
    if cr.mismatches:
        return "OUTPUT MISMATCH", "bold white on red"
    v = cr.verdict
    return v, _VERDICT_STYLE.get(v, "")


def _identical_text(cr: ConfigResult) -> tuple[str, str]:
    if cr.identical is None:
        return "-", "dim"
    return ("✓", "green") if cr.identical else (f"✗ ({len(cr.mismatches)})", "bold red")


def _opt(v: float | int | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _noise_caption(w: WorkloadResult, reps: int, kept: bool = False) -> str:
    n = w.headline_noise
    if n.self_ratio is None:
        floor = "no self-pair"
    elif not math.isfinite(n.log_floor):
        floor = "unbounded (too few pairs)"
    else:
        floor = f"±{n.relative * 100:.1f}%"
    return (f"{len(w.prompt_ids)} prompts x {reps} reps, paired; intervals resample prompts; "
            f"noise floor (baseline vs itself) {floor}"
            + ("; each configuration kept its last prompt's cache (--keep-cache)" if kept else ""))


def _mismatch_panel(mismatches) -> Panel:
    """The runs whose tokens differ from the baseline's, in red: they void the speed numbers."""
    lines = [
        "Token ids differ from the baseline's under the same settings. This is a correctness "
        "bug in speculation, not a speed result: the affected rows' numbers mean nothing.",
        "",
    ]
    for m in mismatches[:12]:
        lines.append(
            f"  {m.workload}/{m.prompt_id} config {m.config} rep {m.rep + 1}: first difference "
            f"at token {m.first_diff} (baseline {m.baseline_excerpt} vs {m.config_excerpt}; "
            f"lengths {m.baseline_len}/{m.config_len})"
        )
    if len(mismatches) > 12:
        lines.append(f"  ... and {len(mismatches) - 12} more (see --json)")
    return Panel(escape("\n".join(lines)), title=f"OUTPUT MISMATCH: {len(mismatches)} run(s)",
                 border_style="bold red", style="red")


def _row_cells(cr, timed_prefill: bool) -> list[str]:
    """One configuration's cells, in the order of ``render_table``'s headers."""
    verdict, vstyle = _verdict_text(cr)
    ident, istyle = _identical_text(cr)
    acc = acceptance(cr)
    head = cr.headline.ratio
    ratio = f"(self {_fmt_ratio(head)})" if cr.is_baseline else _fmt_ratio(head)
    if timed_prefill:
        ratios = [ratio, _prompt_range(cr.per_prompt_e2e or cr.per_prompt),
                  _fmt_ratio(cr.comparison.ratio),
                  "-" if cr.first_token is None else f"{cr.first_token.ratio.estimate:.3f}"]
    else:
        ratios = [ratio, _prompt_range(cr.per_prompt)]
    return [
        f"{cr.spread.median:.2f} [{cr.spread.iqr:.2f}]",
        *ratios,
        f"[{vstyle}]{verdict}[/]" if vstyle else verdict,
        "-" if acc is None else f"{acc * 100:.1f}%",
        _opt(tokens_per_verify(cr), ".2f"),
        _opt(parks(cr), "d"),
        f"[{istyle}]{ident}[/]",
    ]


def render_table(result: BenchResult, console: Console) -> None:
    """Print the result; mismatches first, in red, because they void the speed numbers."""
    if result.mismatches:
        console.print(_mismatch_panel(result.mismatches))
    kept = bool(result.metadata.get("keep_cache"))
    for w in result.workloads:
        title = escape(f"workload: {w.name}  (baseline: {result.baseline})")
        timed_prefill = any(cr.end_to_end is not None for cr in w.configs)
        headers = ["decode tok/s median [IQR]"]
        if timed_prefill:
            headers += [f"end-to-end ratio [{_conf(result)}% CI]", "per prompt", "decode-only ratio", "first token"]
        else:
            headers += [f"ratio vs baseline [{_conf(result)}% CI]", "per prompt min-max"]
        headers += ["verdict", "accept", "tok/verify", "parks", "identical"]
        rows = [(escape(cr.config.name), _row_cells(cr, timed_prefill)) for cr in w.configs]
        # the width the rows need unwrapped (headers may wrap; the config name does not)
        need = 1 + 3 * (len(headers) + 1) + max(Text.from_markup(n).cell_len for n, _ in rows) + sum(
            max(Text.from_markup(cells[i]).cell_len for _, cells in rows) for i in range(len(headers)))
        if need > console.width:
            # a terminal too narrow for the table (ten columns, and a drafter's path in a config
            # name can fill 80 alone; rich then printed the other columns empty): one block per
            # configuration, its figures labelled
            console.print(f"[bold]{title}[/]")
            for name, cells in rows:
                console.print(f"  [bold]{name}[/]")
                console.print("    " + "; ".join(f"{h} {v}" for h, v in zip(headers, cells)))
            console.print(_noise_caption(w, result.reps, kept))
            continue
        table = Table(title=title, caption=_noise_caption(w, result.reps, kept), title_justify="left",
                      caption_justify="left")
        table.add_column("config", no_wrap=True)
        for h in headers:
            table.add_column(h, justify="center" if h == "identical" else "left" if h == "verdict" else "right")
        for name, cells in rows:
            table.add_row(name, *cells)
        console.print(table)
    render_engines(result, console)
    if result.mismatches:
        # again at the end: the panel above may have scrolled away behind long tables
        bad = sorted({m.config for m in result.mismatches})
        console.print(
            f"[bold white on red] OUTPUT MISMATCH [/] {len(result.mismatches)} run(s) of "
            f"{escape(', '.join(bad))} differ from the baseline: a correctness bug, see above."
        )


def render_engines(result: BenchResult, console: Console) -> None:
    """With a peer engine in the run: each engine's configurations against that engine's own plain
    decoding (same rounds), their acceptance, and how many prompts' text equals the engine's plain text."""
    for w in result.workloads:
        if len({cr.config.engine for cr in w.configs}) < 2:
            continue
        table = Table(title=escape(f"workload: {w.name}  each engine against its own plain decoding"),
                      caption="text = plain: prompts whose every run's tokens equal the engine's own plain "
                              "run (greedy); tsspec must be all, a peer need not be",
                      title_justify="left", caption_justify="left")
        for col, just in (("config", "left"), ("decode tok/s", "right"),
                          ("end-to-end tok/s", "right"), (f"vs own plain, end-to-end [{_conf(result)}% CI]", "right"),
                          ("decode-only", "right"), ("accept", "right"), ("text = plain", "right")):
            table.add_column(col, justify=just)
        for engine in dict.fromkeys(cr.config.engine for cr in w.configs):
            for cr in (c for c in w.configs if c.config.engine == engine):
                e2e = [m.e2e_tok_s for m in result.measurements
                       if m.workload == w.name and m.slot == cr.config.name and m.e2e_tok_s is not None]
                acc = acceptance(cr)
                same = "-" if cr.same_text is None else f"{cr.same_text[0]}/{cr.same_text[1]}"
                table.add_row(
                    escape(cr.config.name), f"{cr.spread.median:.2f}",
                    f"{float(np.median(e2e)):.2f}" if e2e else "-",
                    "(reference)" if cr.vs_reference is None else _fmt_ratio(cr.vs_reference.ratio),
                    "-" if cr.vs_reference_decode is None else f"{cr.vs_reference_decode.ratio.estimate:.3f}",
                    "-" if acc is None else f"{acc * 100:.1f}%", same)
        console.print(table)


def _prompt_range(per_prompt: dict[str, float]) -> str:
    vals = list(per_prompt.values())
    return f"{min(vals):.2f}-{max(vals):.2f}" if vals else "-"


def _conf(result: BenchResult) -> str:
    return f"{float(result.metadata.get('confidence', stats.DEFAULT_CONFIDENCE)) * 100:g}"


# ----------------------------------------------------------------------------- JSON / CSV


def _clean(obj: Any) -> Any:
    """JSON-safe: dataclasses to dicts, non-finite floats to None, tuples to lists."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _clean(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if hasattr(obj, "item") and callable(obj.item):  # numpy scalars
        return _clean(obj.item())
    return obj


def _ratio_dict(r: stats.RatioSummary | None) -> dict[str, Any] | None:
    if r is None:
        return None
    return _clean(dataclasses.asdict(r))


def _noise_dict(n: stats.NoiseFloor) -> dict[str, Any]:
    return {
        "relative": n.relative if math.isfinite(n.log_floor) else None,
        "log": n.log_floor,
        "self_ratio": _ratio_dict(n.self_ratio),
    }


def _config_dict(cr: ConfigResult, w: WorkloadResult) -> dict[str, Any]:
    comp = cr.comparison
    return _clean(
        {
            "config": cr.config.to_dict(),
            "is_baseline": cr.is_baseline,
            "tok_s": dataclasses.asdict(cr.spread) | {"iqr": cr.spread.iqr},
            "ratio": _ratio_dict(comp.ratio),  # decode-only; for the baseline: its self-pair A'/A
            "per_prompt_ratio": dict(cr.per_prompt),
            # prefill (and any drafter's own) plus decode, and time to the first token (as a speed)
            "ratio_end_to_end": None if cr.end_to_end is None else _ratio_dict(cr.end_to_end.ratio),
            "per_prompt_ratio_end_to_end": dict(cr.per_prompt_e2e),
            "ratio_first_token": None if cr.first_token is None else _ratio_dict(cr.first_token.ratio),
            "verdict": cr.verdict,
            "reason": cr.headline.reason,
            "acceptance_rate": acceptance(cr),
            "tokens_per_verify": tokens_per_verify(cr),
            "governor_parks": parks(cr),
            "counters": cr.counters,
            "identical": cr.identical,
            "mismatches": [dataclasses.asdict(m) for m in cr.mismatches],
            # against the config's own engine's plain decoding (the baseline for tsspec's configs)
            "reference": cr.reference,
            "ratio_vs_reference": None if cr.vs_reference is None else _ratio_dict(cr.vs_reference.ratio),
            "ratio_vs_reference_decode": None if cr.vs_reference_decode is None
            else _ratio_dict(cr.vs_reference_decode.ratio),
            "same_text_as_reference": None if cr.same_text is None
            else {"prompts_equal": cr.same_text[0], "prompts": cr.same_text[1]},
        }
    )


def to_json(result: BenchResult) -> dict[str, Any]:
    """Everything, JSON-serialisable (``json.dumps`` works on it as is)."""
    return _clean(
        {
            "ok": result.ok,
            "baseline": result.baseline,
            "reps": result.reps,
            "warmup": result.warmup,
            "metadata": result.metadata,
            "workloads": [
                {
                    "name": w.name,
                    "prompt_ids": w.prompt_ids,
                    "noise_floor": _noise_dict(w.noise),  # decode-only
                    "noise_floor_end_to_end": None if w.noise_e2e is None else _noise_dict(w.noise_e2e),
                    "configs": [_config_dict(cr, w) for cr in w.configs],
                }
                for w in result.workloads
            ],
            "mismatches": [dataclasses.asdict(m) for m in result.mismatches],
            "measurements": [dataclasses.asdict(m) for m in result.measurements],
            "schedule": [dataclasses.asdict(s) for s in result.schedule],
        }
    )


CSV_COLUMNS = (
    "workload",
    "engine",
    "config",
    "spec",
    "is_baseline",
    "n_runs",
    "median_tok_s",
    "q1_tok_s",
    "q3_tok_s",
    "ratio",
    "ci_low",
    "ci_high",
    "n_pairs",
    "n_prompts",
    "e2e_ratio",
    "e2e_ci_low",
    "e2e_ci_high",
    "first_token_ratio",
    "noise_floor",
    "verdict",
    "identical",
    "n_mismatches",
    "acceptance_rate",
    "tokens_per_verify",
    "governor_parks",
    "reference",
    "ratio_vs_reference",
    "prompts_same_text_as_reference",
)


def write_csv(result: BenchResult, path: str | Path) -> None:
    """One row per workload x configuration (raw runs are in ``to_json``'s ``measurements``)."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for w in result.workloads:
            floor = w.noise.relative if math.isfinite(w.noise.log_floor) else None
            for cr in w.configs:
                r = cr.comparison.ratio
                row = {
                    "workload": w.name,
                    "engine": cr.config.engine,
                    "config": cr.config.name,
                    "spec": cr.config.spec(),
                    "is_baseline": cr.is_baseline,
                    "n_runs": cr.spread.n,
                    "median_tok_s": cr.spread.median,
                    "q1_tok_s": cr.spread.q1,
                    "q3_tok_s": cr.spread.q3,
                    "ratio": r.estimate,
                    "ci_low": r.ci_low,
                    "ci_high": r.ci_high,
                    "n_pairs": r.n_pairs,
                    "n_prompts": r.n_groups,
                    "e2e_ratio": None if cr.end_to_end is None else cr.end_to_end.ratio.estimate,
                    "e2e_ci_low": None if cr.end_to_end is None else cr.end_to_end.ratio.ci_low,
                    "e2e_ci_high": None if cr.end_to_end is None else cr.end_to_end.ratio.ci_high,
                    "first_token_ratio": None if cr.first_token is None else cr.first_token.ratio.estimate,
                    "noise_floor": floor,
                    "verdict": "mismatch" if cr.mismatches else cr.verdict,
                    "identical": "" if cr.identical is None else cr.identical,
                    "n_mismatches": len(cr.mismatches),
                    "acceptance_rate": acceptance(cr),
                    "tokens_per_verify": tokens_per_verify(cr),
                    "governor_parks": parks(cr),
                    "reference": cr.reference,
                    "ratio_vs_reference": None if cr.vs_reference is None else cr.vs_reference.ratio.estimate,
                    "prompts_same_text_as_reference": None if cr.same_text is None else cr.same_text[0],
                }
                writer.writerow({k: ("" if v is None else _clean(v)) for k, v in row.items()})


# ----------------------------------------------------------------------------- plot


def check_plot() -> None:
    """Refuse ``--plot`` before the run when matplotlib is missing, not after it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise TsspecError("--plot needs matplotlib: pip install tsspec[plot]") from None


def save_outputs(result: BenchResult, *, json_path: Path | None = None, csv_path: Path | None = None,
                 plot_path: Path | None = None) -> None:
    """Write every file asked for, each tried even when another fails (a full disk under --json
    lost the CSV and the plot too, and the whole run with a traceback); then one line naming what
    could not be written. The table is already on the terminal by then."""
    import json

    failed = []
    for flag, path, write in (
            ("--json", json_path, lambda p: Path(p).write_text(json.dumps(to_json(result), indent=2) + "\n")),
            ("--csv", csv_path, lambda p: write_csv(result, p)),
            ("--plot", plot_path, lambda p: plot(result, p))):
        if path is None:
            continue
        try:
            write(path)
        except OSError as e:
            failed.append(f"{flag} {path}: {e.strerror or e}")
    if failed:
        raise TsspecError("cannot write " + "; ".join(failed) + " (the table above holds the results)")


def plot(result: BenchResult, path: str | Path) -> None:
    """Ratio vs baseline with CI per configuration, one panel per workload; writes a PNG."""
    check_plot()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    n = max(1, len(result.workloads))
    fig = Figure(figsize=(9, 5), dpi=100)  # 900 x 500 px
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, n, sharey=True, squeeze=False)[0]
    for ax, w in zip(axes, result.workloads, strict=True):
        rows = [cr for cr in w.configs if not cr.is_baseline]
        nf = w.headline_noise
        if math.isfinite(nf.log_floor) and nf.log_floor > 0:
            lo, hi = nf.band
            ax.axhspan(lo, hi, color="0.85", zorder=0, label="noise floor")
        ax.axhline(1.0, color="0.3", linewidth=1, zorder=1)
        for i, cr in enumerate(rows):
            r = cr.headline.ratio  # end-to-end where measured, as the verdict
            ci_hi = r.ci_high if math.isfinite(r.ci_high) else r.estimate
            color = (
                "magenta"
                if cr.mismatches
                else {
                    stats.FASTER: "tab:green",
                    stats.SLOWER: "tab:red",
                }.get(cr.verdict, "tab:gray")
            )
            ax.errorbar(
                [i],
                [r.estimate],
                yerr=[[max(0.0, r.estimate - r.ci_low)], [max(0.0, ci_hi - r.estimate)]],
                fmt="o" if not cr.mismatches else "x",
                color=color,
                capsize=4,
                zorder=2,
            )
            if cr.mismatches:
                ax.annotate(
                    "OUTPUT\nMISMATCH",
                    (i, r.estimate),
                    xytext=(6, 0),
                    textcoords="offset points",
                    color="magenta",
                    fontsize=7,
                    fontweight="bold",
                    va="center",
                )
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels([cr.config.name for cr in rows], rotation=30, ha="right", fontsize=8)
        ax.set_xlim(-0.6, max(0.6, len(rows) - 0.4))
        ax.set_title(w.name, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel(f"tok/s ratio vs {result.baseline} ({_conf(result)}% CI)")
    fig.suptitle("tsspec bench: paired speed ratio (shaded: baseline vs itself)", fontsize=10)
    fig.tight_layout()
    fig.savefig(str(path), format="png")
