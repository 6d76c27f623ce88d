"""The terminal side of ``tsspec chat``: read a line, stream the reply, report the turn.

Lines starting with ``/`` are commands (``/help`` lists them); anything else is the user's next
message. Ctrl-C during a reply stops that reply and keeps the conversation (the partial reply is
kept as the assistant's message, the cache stays consistent); a second Ctrl-C in the same reply
interrupts at once. Ctrl-C at the prompt leaves with exit code 130, end of input (Ctrl-D) with 0.
"""

from __future__ import annotations

import signal
import sys
from typing import Callable

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .conversation import Conversation, Turn
from .display import error_line
from .errors import BadInput
from .interrupts import StopRequest
from .sampling import Sampler

HELP = """commands:
  /reset          forget the conversation (the system message stays)
  /system [TEXT]  set the system message (no TEXT: none)
  /stats          every turn so far: tokens reused, prefilled and generated, speed, acceptance
  /save FILE      write the conversation as JSON
  /help           this list
  /exit, /quit    leave (so does end of input, Ctrl-D)"""


def turn_line(t: Turn) -> str:
    s = t.stats
    parts = [f"{len(t.token_ids)} tokens", f"{s.decode_tok_s:.1f} tok/s",
             f"prompt {t.prompt_tokens} = {t.reused} reused + {t.prefilled} prefilled"]
    if s.speculator:
        acc = f"{100 * s.acceptance_rate:.0f}%" if s.acceptance_rate is not None else "-"
        parts.append(f"{s.speculator}: {s.verify_calls} verifies, acceptance {acc}")
    else:
        parts.append("plain")
    if t.stop_reason == "interrupted":
        parts.append("interrupted")
    return "[" + ", ".join(parts) + "]"


def stats_table(conv: Conversation) -> Table:
    table = Table(title="turns", show_edge=False)
    for col in ("turn", "prompt", "reused", "prefilled", "generated", "tok/s", "speculator", "acceptance", "stop"):
        table.add_column(col, justify="right" if col not in ("speculator", "stop") else "left")
    for i, t in enumerate(conv.turns, 1):
        s = t.stats
        acc = f"{100 * s.acceptance_rate:.0f}%" if s.acceptance_rate is not None else "-"
        table.add_row(str(i), str(t.prompt_tokens), str(t.reused), str(t.prefilled), str(len(t.token_ids)),
                      f"{s.decode_tok_s:.1f}", s.speculator or "plain", acc, t.stop_reason)
    return table


def run(conv: Conversation, *, sampler: Sampler, max_tokens: int, stop=(), out: Console | None = None,
        err: Console | None = None, read: Callable[[str], str] | None = None, interactive: bool = True) -> int:
    """The read-reply loop; -> the exit code: 0 at end of input or /exit, 1 when the input was a
    script (not a terminal) and none of its turns succeeded though some failed (piped random bytes
    exited 0 with every turn refused, and a script could not tell)."""
    failed, replied = 0, 0

    def code() -> int:
        return 1 if not interactive and failed and not replied else 0

    out = out or Console(highlight=False)
    err = err or Console(stderr=True, highlight=False)
    if read is None:
        read = (lambda p: out.input(p)) if interactive else _read_stdin
    if interactive:
        err.print("[dim]tsspec chat: /help for commands, Ctrl-C stops a reply, Ctrl-D leaves[/]")
    while True:
        try:
            line = read("> " if interactive else "")
        except EOFError:
            return code()
        line = line.rstrip("\n")
        if not line.strip():
            continue
        if line.startswith("/"):
            if command(conv, line, out=out, err=err):
                return code()
            continue
        try:
            with StopRequest() as intr:  # a first Ctrl-C (or SIGTERM) ends the reply, keeping it
                turn = conv.reply(line, sampler=sampler, max_tokens=max_tokens, stop=stop,
                                  on_text=lambda s: (sys.stdout.write(s), sys.stdout.flush()),
                                  interrupted=intr.is_set)
        except BadInput as e:
            error_line(err, str(e))
            failed += 1
            continue
        replied += 1
        sys.stdout.write("\n")
        sys.stdout.flush()
        err.print(f"[dim]{turn_line(turn)}[/]", highlight=False)
        if intr.signum == signal.SIGTERM:  # the reply is kept; the chat ends as SIGTERM asks
            intr.raise_if_requested()


def _read_stdin(prompt: str) -> str:
    """The next line of piped input; bytes that are not UTF-8 are kept as surrogate escapes (the
    turn is then refused with one line, not a UnicodeDecodeError out of the stream)."""
    buf = getattr(sys.stdin, "buffer", None)
    if buf is None:
        line = sys.stdin.readline()
    else:
        line = buf.readline().decode("utf-8", "surrogateescape")
    if not line:
        raise EOFError
    return line


def command(conv: Conversation, line: str, *, out: Console, err: Console) -> bool:
    """Run one ``/command``; -> True when the chat should end."""
    name, _, arg = line.strip().partition(" ")
    arg = arg.strip()
    if name in ("/exit", "/quit"):
        return True
    if name == "/reset":
        conv.reset()
        err.print("[dim]conversation reset[/]")
    elif name == "/system":
        conv.set_system(arg or None)
        err.print(f"[dim]system message {'set' if arg else 'removed'}[/]")
    elif name == "/stats":
        if conv.turns:
            out.print(stats_table(conv))
        else:
            err.print("[dim]no turns yet[/]")
    elif name == "/save":
        if not arg:
            error_line(err, "/save needs a file name")
        else:
            try:
                err.print(f"[dim]saved to {escape(str(conv.save(arg)))}[/]", highlight=False, soft_wrap=True)
            except BadInput as e:
                error_line(err, str(e))
    elif name == "/help":
        out.print(HELP, highlight=False, markup=False)
    else:
        error_line(err, f"unknown command {name}; /help lists them")
    return False
