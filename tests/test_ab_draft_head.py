"""scripts/ab_draft_head.py: a head's native step against its torch step, beside plain decoding."""

import subprocess
import sys
from pathlib import Path

from tiny import write_tiny_model

ROOT = Path(__file__).resolve().parents[1]


def test_a_missing_head_file_is_one_clear_error(tmp_path):
    model = write_tiny_model(tmp_path / "m.gguf", "llama", quant="Q8_0", d_model=64, ffn_dim=128, vocab_size=320)
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "ab_draft_head.py"), str(tmp_path / "nope.gguf"),
                        "-m", str(model)], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert r.stderr.strip().startswith("ab_draft_head:") and "nope.gguf" in r.stderr
    assert "Traceback" not in r.stderr
