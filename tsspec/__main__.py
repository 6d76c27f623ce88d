"""``python -m tsspec`` and the ``tsspec`` script: the command line, with Ctrl-C owned from the start.

Only the standard library is imported before the interrupt guard is in place (see
``tsspec.interrupts``); the command line itself (typer, rich, and through the commands torch and
numpy) is imported after it.
"""


def main() -> None:
    from tsspec.interrupts import guard_startup

    guard_startup()
    from tsspec.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
