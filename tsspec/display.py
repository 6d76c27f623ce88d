"""What a person sees: streamed text, a live speculation panel in a terminal, a summary line.

Plain text only when stdout is not a terminal or with --quiet; --json prints one object at the end.
The display reads ``SpecStats`` and the governor; it decides nothing.
"""

from __future__ import annotations

import os
import sys
import time

from rich.console import Console, Group
from rich.markup import escape
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from .errors import TsspecError
from .spec.stats import SpecStats, member_line

LIVE_LINES = 24  # text lines kept on screen while the panel is live


def human_bytes(n: int) -> str:
    """``n`` bytes in B, KB, MB or GB (decimal), three significant figures at most."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


class OutputError(TsspecError):
    """Standard output refused a write: a full disk (``> /dev/full``), a reader gone (EPIPE into
    ``head``), or no stdout at all (``>&-``)."""


class GuardedStdout:
    """``sys.stdout`` for the command line: a write the OS refuses becomes one ``OutputError`` (one
    ``error:`` line and exit 1 through ``user_errors``) instead of an OSError traceback from whichever
    print met it, and every later write is dropped, so the exit's own flush adds no second one."""

    def __init__(self, stream):
        self._stream = stream  # None: stdout was closed before we started
        self._broken = stream is None

    def _fail(self, e: OSError | None):
        if self._stream is not None and not self._broken:
            self._broken = True
            try:  # what is still buffered would fail again at exit
                os.dup2(os.open(os.devnull, os.O_WRONLY), self._stream.fileno())
            except (OSError, ValueError, AttributeError):
                pass
        raise OutputError("cannot write the output: " + ("stdout is closed" if e is None else (e.strerror or str(e))))

    def write(self, s: str) -> int:
        if self._broken:
            self._fail(None) if self._stream is None else None
            return len(s)
        try:
            return self._stream.write(s)
        except OSError as e:
            self._fail(e)

    def flush(self) -> None:
        if self._broken:
            return
        try:
            self._stream.flush()
        except OSError as e:
            self._fail(e)

    def isatty(self) -> bool:
        return self._stream is not None and not self._broken and self._stream.isatty()

    @property
    def encoding(self) -> str:
        return getattr(self._stream, "encoding", None) or "utf-8"

    def __getattr__(self, name):
        if self._stream is None:
            raise AttributeError(name)
        return getattr(self._stream, name)


def guard_stdout() -> None:
    """Install ``GuardedStdout`` (the ``tsspec`` command does, before any command runs)."""
    if not isinstance(sys.stdout, GuardedStdout):
        sys.stdout = GuardedStdout(sys.stdout)


def summary_line(result, load_ms: float | None = None, first_token_ms: float | None = None) -> str:
    """One line after a run; ``load_ms``/``first_token_ms``: the start-up figures (``generate``)."""
    s: SpecStats = result.stats
    parts = [
        f"prompt {result.prompt_tokens} tok",
        f"generated {len(result.token_ids)} tok",
        f"prefill {s.prefill_tok_s:.1f} tok/s",
        f"decode {s.decode_tok_s:.1f} tok/s",
    ]
    if load_ms is not None:
        parts.append(f"load {load_ms / 1000:.2f} s" + (f", first token {first_token_ms / 1000:.2f} s after start"
                                                      if first_token_ms is not None else ""))
    if s.speculator:
        acc = s.acceptance_rate
        tpv = s.tokens_per_verify
        parts.append(
            f"spec {s.speculator}: window {s.window}, accept "
            + (f"{acc:.0%}" if acc is not None else "-")
            + ", "
            + (f"{tpv:.2f} tok/verify" if tpv is not None else "no verifies")
            + (f", trees {s.nodes_per_tree:.1f} nodes, depth {s.accepted_depth:.2f}" if s.tree_verifies else "")
            + "".join(f", {n} {c['accepted']}/{c['drafted']} in {c['won']} steps" for n, c in s.members.items())
            + f", governor {s.governor_state} (parks {s.governor_parks})"
            + (f", rollback memory {human_bytes(s.rollback_bytes)}" if s.rollback_bytes else "")
        )
    return " | ".join(parts)


def stats_table(s: SpecStats, governor=None) -> Table:
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold cyan")
    t.add_column()
    t.add_row("tokens/s", f"{s.decode_tok_s:.1f}  ({s.generated} tokens)")
    if s.speculator:
        acc = s.acceptance_rate
        tpv = s.tokens_per_verify
        t.add_row("speculator", f"{s.speculator}, window {s.window}")
        if s.rollback_bytes:
            t.add_row("rollback memory", human_bytes(s.rollback_bytes))
        t.add_row("acceptance", f"{acc:.0%}" if acc is not None else "-")
        t.add_row("tokens/verify", f"{tpv:.2f}" if tpv is not None else "-")
        if s.tree_verifies:
            t.add_row("trees", f"{s.nodes_per_tree:.1f} nodes/verify, accepted depth {s.accepted_depth:.2f}")
        for name, c in s.members.items():
            t.add_row(f"  {name}", member_line(c))
        if governor is not None:
            left = governor.steps_left
            state = governor.state + (f" ({left} steps left)" if left is not None else "")
            t.add_row("governor", f"{state}, parks {governor.parks}")
        phases = ", ".join(f"{k} {v:.0f}ms" for k, v in s.phase_ms.items() if v > 0)
        t.add_row("phases", phases or "-")
    return t


class TextSink:
    """Streams text to stdout as it arrives (no live panel)."""

    def __init__(self, out=None):
        self.out = out or sys.stdout

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.out.flush()
        return False

    def text(self, s: str) -> None:
        self.out.write(s)
        self.out.flush()

    def step(self, stats: SpecStats) -> None:
        pass

    def finish(self) -> None:
        self.out.write("\n")
        self.out.flush()


class LiveSink:
    """A Rich live panel: the text as it streams and the speculation counters, ~8 refreshes/s."""

    def __init__(self, console: Console, governor=None, title: str = "tsspec"):
        self.console = console
        self.governor = governor
        self.title = title
        self.buf: list[str] = []
        self.stats = SpecStats()
        self.live = Live(console=console, auto_refresh=False, transient=True, vertical_overflow="crop")
        self._last = 0.0

    def __enter__(self):
        self.live.__enter__()
        return self

    def __exit__(self, *exc):
        self.live.__exit__(*exc)
        return False

    def _render(self):
        text = "".join(self.buf)
        lines = text.splitlines()[-LIVE_LINES:]
        body = Text("\n".join(lines))
        return Group(body, Panel(stats_table(self.stats, self.governor), title=self.title, expand=False))

    def _refresh(self, force: bool = False) -> None:
        now = time.perf_counter()
        if force or now - self._last > 0.12:
            self.live.update(self._render(), refresh=True)
            self._last = now

    def text(self, s: str) -> None:
        self.buf.append(s)
        self._refresh()

    def step(self, stats: SpecStats) -> None:
        self.stats = stats
        self._refresh()

    def finish(self) -> None:
        self._refresh(force=True)
        self.live.__exit__(None, None, None)
        self.console.print("".join(self.buf), markup=False, highlight=False, soft_wrap=True)
        self.live = _NullLive()


class _NullLive:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, *a, **k):
        pass


def _units(phase: str) -> str:
    """What a distill phase counts."""
    return "steps" if phase == "training" else "tokens"


def error_line(console: Console, message: str) -> None:
    """One ``error:`` line: the message is text, not markup (a path like ``[/]x`` raised rich's
    MarkupError), and not wrapped at the console's width. The CLI's and the chat prompt's errors."""
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)


class DistillProgress:
    """The live view of ``tsspec distill``: one progress bar per phase (trunk features, training)
    with tokens/s or steps/s, the running loss and the latest held-out acceptance."""

    def __init__(self, console: Console):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TextColumn("eta"),
                                 TimeRemainingColumn(), TextColumn("{task.fields[info]}"), console=console,
                                 transient=False)
        self.task = None
        self.unit = "tok"
        self.loss: float | None = None
        self.held = ""
        self.console = console
        self.live = console.is_terminal  # else (a log file, a pipe): one line per phase and measurement,
        # and a line of progress at most every LOG_EVERY_S seconds inside a phase
        self.clock = time.monotonic
        self._phase: tuple[str, int, float] | None = None  # (name, total, start) of the logged phase
        self._done = 0
        self._done_at_start = 0  # units a resumed phase had done before this run (not in its rate)
        self._logged_at = 0.0

    def __enter__(self) -> "DistillProgress":
        if self.live:
            self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self.live:  # a Progress never started still prints an empty line when stopped
            self.progress.stop()

    def _info(self) -> str:
        parts = []
        if self.loss is not None:
            parts.append(f"loss {self.loss:.3f}")
        if self.held:
            parts.append(self.held)
        return "  ".join(parts)

    LOG_EVERY_S = 60.0

    def _log_progress(self, n: int) -> None:
        """Not live: count ``n`` more units of the phase and, a minute after the last line, say how far
        it is, with the time so far and a linear estimate of what is left."""
        if self._phase is None:
            return
        name, total, start = self._phase
        self._done += n
        now = self.clock()
        if now - self._logged_at < self.LOG_EVERY_S or self._done >= total:
            return
        self._logged_at = now
        spent = now - start
        ran = self._done - self._done_at_start  # this run's units: a resumed phase's earlier ones took no time here
        left = spent * (total - self._done) / ran if ran > 0 else float("nan")
        loss = f", loss {self.loss:.3f}" if self.loss is not None and name == "training" else ""
        self.console.print(f"{name}: {self._done}/{total} {_units(name)}{loss}, {spent / 60:.1f} min, "
                           f"~{left / 60:.1f} min left")

    def event(self, kind: str, **d) -> None:
        p = self.progress
        if not self.live:
            if kind == "phase":
                self.console.print(f"{d['name']}: {d['total']} {_units(d['name'])}")
                now = self.clock()
                self._phase, self._done, self._logged_at = (d["name"], int(d["total"]), now), int(d.get("completed", 0)), now
                self._done_at_start = self._done
            elif kind == "advance":
                if "loss" in d:
                    self.loss = d["loss"] if self.loss is None else 0.95 * self.loss + 0.05 * d["loss"]
                self._log_progress(int(d.get("n", 0)))
            elif kind == "metrics":
                loss = f", loss {self.loss:.3f}" if self.loss is not None else ""
                self.console.print(f"step {d['step']}{loss}, held-out: first {d['first']:.1%}, "
                                   f"{d['tokens_per_verify']:.2f} tok/verify")
            elif kind == "resumed":
                self.console.print(f"resuming from step {d['step']}")
            return
        if kind == "phase":
            if self.task is not None:
                p.update(self.task, info=self._info())
            self.unit = "step" if d["name"] == "training" else "tok"
            self.task = p.add_task(d["name"], total=d["total"], completed=d.get("completed", 0), rate="", info="")
        elif kind == "advance" and self.task is not None:
            if "loss" in d:
                self.loss = d["loss"] if self.loss is None else 0.95 * self.loss + 0.05 * d["loss"]
            p.advance(self.task, d["n"])
            speed = p.tasks[self.task].speed
            p.update(self.task, rate=f"{speed:,.1f} {self.unit}/s" if speed else "", info=self._info())
        elif kind == "metrics":
            self.held = f"held-out: first {d['first']:.1%}, {d['tokens_per_verify']:.2f} tok/verify"
            if self.task is not None:
                p.update(self.task, info=self._info())
        elif kind == "resumed":
            self.console.print(f"resuming from step {d['step']}")
