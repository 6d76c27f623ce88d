"""The CLI in process with the speculation environment cleared around each call.

``generate`` publishes its resolved settings into ``os.environ`` (for child processes); the runner
restores only the variables it was given, so every one ``publish`` writes is listed here, or one
call's ``--draft-model`` would steer the next test's run.
"""

from __future__ import annotations

import sys

from typer.testing import CliRunner

from tsspec import cli
from tsspec.cli import app
from tsspec.options import FAMILIES

SPEC_ENV = {f"{fam}{key}": None for fam in FAMILIES
            for key in ("SPEC", "TYPE", "DRAFT", "ACCEPT", "ADAPTIVE", "PMIN", "DRAFT_MODEL", "TREE")}


def run(*args, env=None, input=None):
    return CliRunner().invoke(app, list(args), env=SPEC_ENV | (env or {}), input=input)


def entry(*args, env=None, input=None) -> tuple[int, str, str]:
    """``(exit status, stdout, stderr)`` through the real entry point (``tsspec.cli.run``, what the
    ``tsspec`` command exits with), whose parser errors are one ``error:`` line, not click's box."""
    with CliRunner().isolation(input=input, env=SPEC_ENV | (env or {})) as streams:
        code = cli.run(list(args))
        sys.stdout.flush()
        sys.stderr.flush()
        return code, streams[0].getvalue().decode(), streams[1].getvalue().decode()
