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
_installed = False  # guard_startup ran in this process: it is the command line, not a library user


def _exit_now(signum, frame) -> None:  # noqa: ARG001 (signal handler signature)
    try:  # what was already produced (an ``info`` table) is not lost
        sys.stdout.flush()
    except BaseException:  # noqa: BLE001 (interrupted mid-write: a reentrant flush, a closed pipe)
        pass
    prefix = b""
    try:
        if os.isatty(2):  # a spinner may own the line and have hidden the cursor
            prefix = b"\r\x1b[2K\x1b[?25h"
    except OSError:
        pass
    try:
        os.write(2, prefix + MESSAGE.encode() + b"\n")
    except OSError:
        pass
    os._exit(EXIT_CODE)


def guard_startup() -> None:
    """Until :func:`startup_done`, SIGINT ends the process with exit 130 and one line.

    Left alone when SIGINT is ignored (``nohup``, a background job of a shell without job control),
    or when not on the main thread (only it may set handlers)."""
    global _installed
    try:
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            signal.signal(signal.SIGINT, _exit_now)
            _installed = True
    except ValueError:  # not the main thread
        pass


def guarded() -> bool:
    """Whether the start-up guard is the SIGINT handler now."""
    return signal.getsignal(signal.SIGINT) is _exit_now


def startup_done() -> None:
    """Start-up is over and the caller handles ``KeyboardInterrupt``: Python's default handler again."""
    if guarded():
        signal.signal(signal.SIGINT, signal.default_int_handler)


@contextlib.contextmanager
def catchable() -> Iterator[None]:
    """Inside, SIGINT is a ``KeyboardInterrupt`` (so ``finally`` blocks clean up); the guard, if it
    was installed, is back afterwards. Only the main thread receives signals and may set handlers;
    elsewhere this changes nothing."""
    if not guarded() or threading.current_thread() is not threading.main_thread():
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, _exit_now)


def exiting() -> None:
    """The command is over and its exit status decided: SIGINT is ignored for the interpreter's
    teardown (torch's takes about half a second), during which Python puts back the default action
    and a Ctrl-C would kill the finished process without a word. Only in the command line's process."""
    if _installed:
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        except ValueError:
            pass
