"""Every path a command takes goes through one guarded open (tsspec/paths.py): a FIFO, a directory and
/dev/zero given to any path-taking option of any command end within a few seconds in one ``error:``
line, never a hang, a traceback or a run that reads for ever.

The options are read from the typer app itself, so a new one is covered without editing this
test: every option or argument annotated ``Path`` (input or output), and every ``str`` one whose
help says it names a file ("GGUF path", "Drafter GGUF", "drafter GGUF", "prompts file"), as each
of them does. A command without a base invocation below fails the test, so a new command is not
skipped silently either.
"""

from __future__ import annotations

import os
import re
import signal
import typing
from pathlib import Path

import pytest
import typer

from clirun import entry
from tiny import write_tiny_model
from tsspec.cli import app

NAMES_A_FILE = re.compile(r"GGUF path|[Dd]rafter GGUF|prompts file")
LIMIT_S = 5


def _has_path(annotation) -> bool:
    return annotation is Path or any(_has_path(a) for a in typing.get_args(annotation))


def path_options() -> list[tuple[str, str, bool]]:
    """(command, the option's first spelling or the argument's name, is an argument)."""
    out = []
    group = typer.main.get_command(app)
    for name, cmd in group.commands.items():
        hints = typing.get_type_hints(cmd.callback)
        for p in cmd.params:
            if _has_path(hints.get(p.name)) or NAMES_A_FILE.search(getattr(p, "help", None) or ""):
                is_arg = not p.opts or not p.opts[0].startswith("-")
                out.append((name, p.name if is_arg else p.opts[0], is_arg))
    return out


OPTIONS = path_options()
# options that name a directory: there a directory is the valid value (export-hf writes into it; a
# --llama-bin without llama-server is refused by the bench that needs it), a FIFO and a device not
DIRECTORY_OPTIONS = {("export-hf", "-o"), ("bench", "--llama-bin")}
CASES = [(c, o, a, kind) for c, o, a in OPTIONS for kind in ("FIFO", "a directory", "/dev/zero")
         if not (kind == "a directory" and (c, o) in DIRECTORY_OPTIONS)]


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    d = tmp_path_factory.mktemp("guarded")
    model = write_tiny_model(d / "m.gguf", "llama", quant="Q4_0", d_model=64, ffn_dim=128, vocab_size=320)
    fifo = d / "fifo"
    os.mkfifo(fifo)
    (d / "adir").mkdir()
    return {"model": str(model), "out": str(d / "out"), "FIFO": str(fifo), "a directory": str(d / "adir"),
            "/dev/zero": "/dev/zero"}


def base_args(command: str, places: dict) -> dict[str, list[str]]:
    """A valid invocation of ``command``, option -> its value(s), in order (positional arguments under
    their names). The option under test replaces its entry."""
    m, out = places["model"], places["out"]
    return {
        "generate": {"-m": [m], "-p": ["hi"], "-n": ["1"]},
        "chat": {"-m": [m]},
        "serve": {"-m": [m], "--port": ["1"]},
        "info": {"model": [m], "--no-load": []},
        "pull": {},
        "distill": {"-m": [m], "-o": [out + ".gguf"], "--steps": ["1"]},
        "export-hf": {"drafter": [m], "-o": [out]},
        "models": {},
        "bench": {"-m": [m], "-w": ["prose"], "-n": ["1"], "--reps": ["1"]},
    }[command]


def invocation(command: str, option: str, is_arg: bool, value: str, places: dict) -> list[str]:
    args = dict(base_args(command, places))
    if option in ("-f", "--prompts"):
        args.pop("-p", None)  # the prompt comes from the file under test
    args[option] = [value]
    argv = [command]
    for k, v in args.items():
        argv += v if (k == option and is_arg) or (k in ("model", "drafter")) else [k, *v]
    return argv


class Hung(Exception):
    pass


def _alarm(signum, frame):
    raise Hung()


def test_the_walk_finds_every_kind_of_path_option():
    found = {(c, o) for c, o, _ in OPTIONS}
    for want in [("generate", "-f"), ("generate", "--prompts"), ("generate", "-m"), ("generate", "--draft-model"),
                 ("bench", "-w"), ("bench", "--config-file"), ("bench", "--json"), ("distill", "--corpus"),
                 ("info", "model"), ("export-hf", "drafter"), ("distill", "-o")]:
        assert want in found, want
    assert ("generate", "--weights") not in found and ("generate", "--device") not in found


@pytest.mark.parametrize("command,option,is_arg,kind", CASES, ids=[f"{c} {o} {k}" for c, o, _, k in CASES])
def test_every_path_option_refuses_what_is_not_a_file(command, option, is_arg, kind, places, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    argv = invocation(command, option, is_arg, places[kind], places)
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(LIMIT_S)
    try:
        code, out, err = entry(*argv, input="")
    except Hung:
        pytest.fail(f"tsspec {' '.join(argv)}: still running after {LIMIT_S} s")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    lines = [x for x in err.splitlines() if x.strip()]
    what = f"tsspec {' '.join(argv)}: exit {code}, stderr {err[-600:]!r}"
    assert "Traceback" not in out + err, what
    assert code in (2, 3) and len(lines) == 1 and lines[0].startswith("error:"), what


def test_the_two_bench_hangs_of_round_two_end_at_once(places, monkeypatch, tmp_path):
    """issue 49's cases: a FIFO as a workload file and as the config file."""
    monkeypatch.chdir(tmp_path)
    for argv in (["bench", "-m", places["model"], "-w", places["FIFO"]],
                 ["bench", "-m", places["model"], "-w", "prose", "--config-file", places["FIFO"]]):
        signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(LIMIT_S)
        try:
            code, _, err = entry(*argv)
        finally:
            signal.alarm(0)
        assert code == 2 and "named pipe" in err and len(err.strip().splitlines()) == 1, err


def test_read_user_file_limits_and_encodings(tmp_path):
    from tsspec.errors import BadInput
    from tsspec.paths import read_user_file

    f = tmp_path / "p.txt"
    f.write_bytes(b"\xef\xbb\xbfhello")
    assert read_user_file(f, "-f") == "hello"  # the BOM dropped
    assert read_user_file(f, "-f", encoding=None) == b"\xef\xbb\xbfhello"
    with pytest.raises(BadInput, match=r"-f .*p.txt: 0 MB is too large \(at most 0 MB\)"):
        read_user_file(f, "-f", max_bytes=4)
    f.write_bytes(b"caf\xe9")
    with pytest.raises(BadInput, match="is not UTF-8 text"):
        read_user_file(f, "-f")
    with pytest.raises(BadInput, match="no such file or directory"):
        read_user_file(tmp_path / "none", "-f")
    f.chmod(0)
    if os.geteuid() != 0:  # root reads it anyway
        with pytest.raises(BadInput, match="cannot be read"):
            read_user_file(f, "-f")
