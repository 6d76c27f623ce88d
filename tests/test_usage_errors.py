"""Parser errors through the real entry point (``tsspec.cli.run``, what ``main`` exits with): one
``error:`` line on stderr and exit 2, the documented status for bad input, never click's usage box;
``--help`` and a bare ``tsspec`` unchanged; the commands' own exit statuses unchanged."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tsspec.cli import run

ROOT = Path(__file__).resolve().parents[1]

USAGE_ERRORS = [
    (["generate", "--bogus"], "No such option: --bogus (see '"),
    (["generate", "--specc"], "Possible options:"),
    (["generate", "-n", "x"], "Invalid value for '-n' / '--max-tokens'"),
    (["generate", "--temp", "hot"], "Invalid value for '--temp'"),
    (["generate", "--seed", "1.5"], "Invalid value for '--seed'"),
    (["generate", "-m"], "Option '-m' requires an argument"),
    (["generate", "--spec=yes"], "does not take a value"),
    (["frob"], "No such command 'frob'"),
    (["--bogus"], "No such option: --bogus"),
    (["info", "a", "b"], "unexpected extra argument"),
    (["pull", "--force=3"], "Option '--force' does not take a value"),
    (["bench", "--reps", "1.5"], "Invalid value for '--reps'"),
    (["bench", "-w"], "Option '-w' requires an argument"),
    (["models", "extra"], "unexpected extra argument"),
]


def one_line(err: str) -> str:
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("args, needle", USAGE_ERRORS, ids=[" ".join(a) for a, _ in USAGE_ERRORS])
def test_usage_error_is_one_line_and_exit_2(args, needle, capsys):
    assert run(args) == 2
    out, err = capsys.readouterr()
    line = one_line(err)
    assert line.startswith("error: ") and needle in line, line
    assert out == "" and "Usage:" not in err and "╭" not in err


@pytest.mark.parametrize("args", [["--help"], ["-h"], ["generate", "--help"], ["bench", "-h"], ["info", "--help"]])
def test_help_is_unchanged(args, capsys):
    assert run(args) == 0
    out, err = capsys.readouterr()
    assert "Usage:" in out and err == ""


def test_bare_command_prints_the_help_and_exits_2(capsys):
    assert run([]) == 2
    out, err = capsys.readouterr()
    assert "Usage:" in out and "generate" in out and err == ""


def test_command_errors_keep_their_status(tmp_path, capsys):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\xff" * 60)
    assert run(["generate", "-m", str(junk), "-p", "hi"]) == 3  # a bad model file
    assert one_line(capsys.readouterr().err).startswith("error: ")
    assert run(["generate", "-m", str(tmp_path / "none.gguf"), "-p", "hi"]) == 2  # no such file
    assert one_line(capsys.readouterr().err).startswith("error: model not found")
    assert run(["generate", "-m", str(tmp_path / "none.gguf"), "-p", "hi", "-n", "0"]) == 2  # bad input
    assert one_line(capsys.readouterr().err) == "error: --max-tokens must be >= 1"
    assert run(["pull"]) == 2
    assert one_line(capsys.readouterr().err).startswith("error: name a model to pull")


def test_real_process():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "tsspec", "generate", "--max-tokens", "many"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert one_line(r.stderr).startswith("error: Invalid value for '-n' / '--max-tokens'") and r.stdout == ""


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
@pytest.mark.parametrize("args, env", [(["generate", "--device", "cuda", "-p", "x"], {}),
                                       (["generate", "-p", "x"], {"TSSPEC_DEVICE": "cuda"}),
                                       (["bench", "--device", "cuda"], {})])
def test_cuda_without_a_gpu_is_one_line(args, env, monkeypatch, capsys):
    """--device cuda on a machine without a GPU: one error line saying why, exit 2, before any load."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert run(args) == 2
    out, err = capsys.readouterr()
    line = one_line(err)
    assert line.startswith("error: ") and "cuda" in line and ("GPU" in line or "CUDA" in line), line
    assert "Traceback" not in err and out == ""


def test_out_of_memory_is_one_line(tmp_path, monkeypatch, capsys):
    """Memory running out mid-run (torch's allocations, or the native kernels' scratch, which they
    check and report as -2 rather than write through a null pointer): one error line, exit 1."""
    from tiny import write_tiny_model

    from tsspec import generate, kernels

    with pytest.raises(MemoryError, match="out of memory"):
        kernels._check_rc(-2, "unused")
    with pytest.raises(ValueError, match="cannot multiply"):
        kernels._check_rc(-1, "cannot multiply")
    kernels._check_rc(0, "unused")

    def starved(*a, **k):
        kernels._check_rc(-2, "unused")

    model = write_tiny_model(tmp_path / "tiny.gguf", arch="llama", seed=3)
    monkeypatch.setattr(generate.Engine, "generate", starved)
    assert run(["generate", "-m", str(model), "-p", "hi", "-n", "4"]) == 1
    out, err = capsys.readouterr()
    line = one_line(err)
    assert line.startswith("error: out of memory") and "--ctx-size" in line, line
    assert "Traceback" not in err


def test_help_into_a_full_disk_is_one_line():
    """The parser's own output (--help) that stdout refuses: one error line and exit 1, as for every
    other write (it was a traceback: the help is printed before any command's error handling)."""
    import subprocess
    import sys

    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "tsspec", "generate", "--help"], stdout=full, stderr=subprocess.PIPE,
                           text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.strip() == "error: cannot write the output: No space left on device"
