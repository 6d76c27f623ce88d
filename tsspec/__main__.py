"""``python -m tsspec`` and the ``tsspec`` script: the command line, with Ctrl-C owned from the start.

Only the standard library is imported before the interrupt guard is in place (see
``tsspec.interrupts``); the command line itself (typer, rich, and through the commands torch and
numpy) is imported after it. The process ends without the interpreter's teardown (``quick_exit``).
"""

import os
import sys


def main() -> None:
    from tsspec.interrupts import guard_startup

    guard_startup()
    from tsspec.cli import main as cli_main

    try:
        cli_main()
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            quick_exit(e.code or 0)
        raise


def quick_exit(status: int) -> None:
    """End the finished command with ``status`` once its output is flushed, skipping the interpreter's
    teardown: unloading torch and freeing a model's memory object by object took 0.4-0.5 s of every
    scripted one-shot call, after its last byte was written. Only the process's entry point does this
    (``tsspec.cli.main`` called as a function exits as ``sys.exit`` does); every file a command writes
    is closed by then. Where the flush fails (a closed pipe, a full disk) the ordinary exit reports it,
    as it always has."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - the ordinary exit says what went wrong
        sys.exit(status)
    os._exit(status)


if __name__ == "__main__":
    main()
