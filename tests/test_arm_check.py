"""scripts/arm_check.sh: the ARM64 NEON products (with and without dotprod) cross-built and run under
qemu-aarch64 against the reference, bit for bit, every type, stored and repacked, rows 1..64,
threads 1 and 2. Slow (a cross build per level, qemu), so marked ``slow``: CI runs it, the fast
layer leaves it out. It installs Debian's cross compiler and qemu-user where they are missing."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_arm_check_passes_at_both_levels():
    r = subprocess.run(["bash", str(ROOT / "scripts" / "arm_check.sh")], capture_output=True, text=True, timeout=1800)
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    last = re.fullmatch(r"(\d+) passed, (\d+) failed", lines[-1])
    assert last and int(last.group(1)) > 0 and last.group(2) == "0", lines[-1]
    for level in ("neon-dotprod", "neon"):
        m = next(re.fullmatch(rf"{level}: (\d+) passed, 0 failed", ln) for ln in lines if ln.startswith(f"{level}: ")
                 and "passed" in ln)
        assert m and int(m.group(1)) > 0
