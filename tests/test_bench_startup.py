"""scripts/bench_startup.py's handling of a peer that dies by a signal: llama.cpp's default build
raises SIGILL on a virtual machine that advertises AMX but refuses a process its tiles; the script
then runs it with --no-repack, says so, and still fails loudly on any other death."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "bench_startup.py"
_spec = importlib.util.spec_from_file_location("bench_startup", _PATH)
bs = importlib.util.module_from_spec(_spec)
sys.modules["bench_startup"] = bs
_spec.loader.exec_module(bs)

# a stand-in for llama-completion: SIGILL unless told --no-repack (as the real one on such a VM)
FAKE_LLAMA = """#!/bin/sh
for a in "$@"; do [ "$a" = "--no-repack" ] && exit 0; done
kill -ILL $$
"""


def _fake(tmp_path: Path, name: str, body: str) -> Path:
    p = tmp_path / name
    p.write_text(body)
    p.chmod(0o755)
    return p


@pytest.fixture
def patched(tmp_path, monkeypatch):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    monkeypatch.setattr(bs, "model_path", lambda name: model)
    return tmp_path


def test_a_peer_killed_by_sigill_runs_again_without_repacking(patched, monkeypatch):
    llama = _fake(patched, "llama", FAKE_LLAMA)
    ok = _fake(patched, "tsspec", "#!/bin/sh\nexit 0\n")
    monkeypatch.setattr(bs, "commands", lambda model, threads, llama_, tokens: {
        "tsspec": [str(ok)], "llama.cpp": [str(llama), "-m", str(model)]})
    out = bs.bench_model("x", rounds=2, threads=1, llama=llama, cold=False, tokens=1)
    assert "killed by signal 4" in out["llama_no_repack"]
    assert len(out["warm"]["llama.cpp"]["samples"]) == 2  # both rounds measured, with --no-repack


def test_a_signal_elsewhere_still_ends_the_run(patched, monkeypatch):
    dies = _fake(patched, "tsspec", "#!/bin/sh\nkill -SEGV $$\n")
    fine = _fake(patched, "llama", "#!/bin/sh\nexit 0\n")
    monkeypatch.setattr(bs, "commands", lambda model, threads, llama_, tokens: {
        "tsspec": [str(dies)], "llama.cpp": [str(fine)]})
    with pytest.raises(SystemExit, match="killed by signal 11"):
        bs.bench_model("x", rounds=1, threads=1, llama=fine, cold=False, tokens=1)


def test_a_plain_failure_is_not_retried(patched, monkeypatch):
    ok = _fake(patched, "tsspec", "#!/bin/sh\nexit 0\n")
    fails = _fake(patched, "llama", "#!/bin/sh\necho broken >&2\nexit 3\n")
    monkeypatch.setattr(bs, "commands", lambda model, threads, llama_, tokens: {
        "tsspec": [str(ok)], "llama.cpp": [str(fails)]})
    with pytest.raises(SystemExit, match=r"failed \(3\): broken"):
        bs.bench_model("x", rounds=1, threads=1, llama=fails, cold=False, tokens=1)
