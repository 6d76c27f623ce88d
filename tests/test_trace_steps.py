"""scripts/trace_steps.py: every decode step of a real (tiny) run, as the loop ran it."""

import json
import subprocess
import sys
from pathlib import Path

from tiny import write_tiny_model

ROOT = Path(__file__).resolve().parents[1]


def test_the_trace_has_every_step_and_its_kind(tmp_path):
    model = write_tiny_model(tmp_path / "m.gguf", "llama", quant="Q8_0", d_model=64, ffn_dim=128, vocab_size=320)
    out = tmp_path / "steps.jsonl"
    prompt = "a b c a b c a b c a b c a b c"  # repeats, so n-gram finds drafts
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "trace_steps.py"), "--out", str(out), "--",
                        "generate", "-m", str(model), "-p", prompt, "-n", "24", "--quiet", "--spec",
                        "--spec-type", "ngram", "--no-spec-adaptive"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    steps = [json.loads(line) for line in out.read_text().splitlines()]
    assert steps, r.stderr
    assert [s["step"] for s in steps] == list(range(len(steps)))  # one sequence, every step in order
    assert {s["seq"] for s in steps} == {1}
    # 23 tokens after the prompt's forward drew the first: the steps emitted exactly those
    assert sum(s["emitted"] for s in steps) == 23
    for s in steps:
        assert s["state"] == s["after"] == "disabled"  # --no-spec-adaptive: drafting every step
        assert s["proposed"] and s["step_ms"] >= s["forward_ms"] > 0
        assert 1 <= s["emitted"] <= s["drafted"] + 1
        assert s["shared"] == 1  # one sequence: its steps are its own
    assert "plain steps by index" in r.stderr


def test_an_out_file_that_cannot_be_written_is_refused_before_the_run(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "trace_steps.py"), "--out",
                        str(tmp_path / "no" / "such" / "dir.jsonl"), "--", "generate", "-m", "nope.gguf"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "does not exist" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
