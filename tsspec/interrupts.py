"""Ctrl-C from process start: exit 130 and one line, never a traceback or a wrong diagnosis.

Python turns SIGINT into a ``KeyboardInterrupt`` raised wherever the main thread happens to be. While
the process starts (importing torch, numpy and tokenizers, opening and loading the model) that place
can be a library's import machinery, which may swallow the exception (torch imports numpy inside a
broad ``try``) and leave a module half-imported: the run then ignores the interrupt, blames the model
file, or dies in an ``AttributeError`` traceback. So the command line's entry point calls
:func:`guard_startup` before any heavy import; until start-up is over, SIGINT flushes what stdout
holds, writes ``interrupted`` to stderr and ends the process at once with exit status 130.

Once a command has its own handling in place (``tsspec.cli.user_errors`` maps ``KeyboardInterrupt``
to exit 130, and ``generate`` keeps what it already printed), it calls :func:`startup_done`, which
puts Python's default handler back. Work that must clean up after itself during start-up (a model
download's ``.partial`` file, a kernel build's temporary file) runs inside :func:`catchable`.

When tsspec is used as a library (or the CLI is invoked in-process, as the tests do) the guard is
never installed and these functions change nothing. This module imports only the standard library.
The interpreter's own start (before the first line of tsspec runs, a few tens of milliseconds) is
Python's: an interrupt there is reported by Python itself.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Iterator

EXIT_CODE = 130
MESSAGE = "interrupted"
TERM_EXIT_CODE = 143  # 128 + SIGTERM, as a shell reports a process SIGTERM ended
TERM_MESSAGE = "terminated"
_installed = False  # guard_startup ran in this process: it is the command line, not a library user
# the stderr the process started with, kept apart from fd 2: while the tokenizer builds, fd 2 points
# into a temporary file (``tokenizer._panic_text_held``), and the guard's line written there was lost
# with the process (exit 130 and nothing said: an interrupt under load, 2.2 s after start)
_stderr_fd: int | None = None


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where SIGINT raises ``KeyboardInterrupt`` so the same clean-up runs (a pull's
    partial file and wheel directory, distill's checkpoint, what generate has printed); the command
    line then exits 143. Its default action killed the process on the spot: ``generate --json``
    lost its whole run, and ``pull`` left its ``.NAME.wheels-*`` directory behind."""


def exit_for(e: KeyboardInterrupt) -> tuple[str, int]:
    """(the word, the exit status) a command ends with on ``e``: SIGTERM's or Ctrl-C's."""
    return (TERM_MESSAGE, TERM_EXIT_CODE) if isinstance(e, Terminated) else (MESSAGE, EXIT_CODE)


def _raise_terminated(signum, frame) -> None:  # noqa: ARG001 (signal handler signature)
    raise Terminated()


def _exit_now(signum, frame) -> None:  # noqa: ARG001 (signal handler signature)
    try:  # what was already produced (an ``info`` table) is not lost
        sys.stdout.flush()
    except BaseException:  # noqa: BLE001 (interrupted mid-write: a reentrant flush, a closed pipe)
        pass
    prefix = b""
    fd = 2 if _stderr_fd is None else _stderr_fd
    try:
        if os.isatty(fd):  # a spinner may own the line and have hidden the cursor
            prefix = b"\r\x1b[2K\x1b[?25h"
    except OSError:
        pass
    term = signum == signal.SIGTERM
    try:
        os.write(fd, prefix + (TERM_MESSAGE if term else MESSAGE).encode() + b"\n")
    except OSError:
        pass
    os._exit(TERM_EXIT_CODE if term else EXIT_CODE)


def guard_startup() -> None:
    """Until :func:`startup_done`, SIGINT ends the process with exit 130 and one line.

    Left alone when SIGINT is ignored (``nohup``, a background job of a shell without job control),
    or when not on the main thread (only it may set handlers)."""
    global _installed, _stderr_fd
    if _stderr_fd is None:
        try:
            _stderr_fd = os.dup(2)
        except OSError:  # no fd 2: the guard writes where fd 2 points then, if anywhere
            pass
    try:
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            signal.signal(signal.SIGINT, _exit_now)
            _installed = True
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN:
            signal.signal(signal.SIGTERM, _exit_now)
    except ValueError:  # not the main thread
        pass


def guarded() -> bool:
    """Whether the start-up guard is the SIGINT handler now."""
    return signal.getsignal(signal.SIGINT) is _exit_now


def startup_done() -> None:
    """Start-up is over and the caller handles ``KeyboardInterrupt``: Python's default handler again."""
    if guarded():
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if signal.getsignal(signal.SIGTERM) is _exit_now:
            signal.signal(signal.SIGTERM, _raise_terminated)


@contextlib.contextmanager
def catchable() -> Iterator[None]:
    """Inside, SIGINT is a ``KeyboardInterrupt`` (so ``finally`` blocks clean up); the guard, if it
    was installed, is back afterwards. Only the main thread receives signals and may set handlers;
    elsewhere this changes nothing."""
    if not guarded() or threading.current_thread() is not threading.main_thread():
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    term = signal.getsignal(signal.SIGTERM) is _exit_now
    if term:
        signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, _exit_now)
        if term:
            signal.signal(signal.SIGTERM, _exit_now)


def exiting() -> None:
    """The command is over and its exit status decided: SIGINT is ignored from here to the end (the
    ``tsspec`` entry point then exits at once, ``__main__.quick_exit``; where it cannot, the
    interpreter's teardown, torch's about half a second, during which Python puts back the default
    action and a Ctrl-C would kill the finished process without a word). Only in the command line's
    process."""
    if _installed:
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        except ValueError:
            pass


class StopRequest:
    """While a run goes on the main thread: the first SIGINT or SIGTERM asks it to stop at the next
    token (``requested``; the caller passes ``is_set`` as the run's ``interrupted``), so what it
    made is kept (a reply in chat, generate --json's object); a second one raises at once
    (``KeyboardInterrupt``, or ``Terminated`` for SIGTERM). ``raise_if_requested`` afterwards ends
    the command as the signal would have. Off the main thread it changes nothing."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def is_set(self) -> bool:
        return self.signum is not None

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                if signal.getsignal(s) is not signal.SIG_IGN:
                    self._previous[s] = signal.signal(s, self._handler)
        return self

    def _handler(self, signum, frame) -> None:  # noqa: ARG002 (signal handler signature)
        if self.signum is not None:
            raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt
        self.signum = signum

    def __exit__(self, *exc) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)

    def raise_if_requested(self) -> None:
        if self.signum is not None:
            raise Terminated() if self.signum == signal.SIGTERM else KeyboardInterrupt
