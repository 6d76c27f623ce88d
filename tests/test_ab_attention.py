"""scripts/ab_attention.py: the native attention of two revisions, compiled with a harness and paired."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tsspec import kernels

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import ab_attention  # noqa: E402

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"native kernels: {kernels.unavailable_reason()}")


def test_shapes_parse_with_and_without_rows():
    assert ab_attention.parse_shapes("128x4x2048,64x3x100x16") == [(128, 4, 2048, 1), (64, 3, 100, 16)]


@pytest.mark.parametrize("bad", ["128x4", "12x4x100", "128x5x100", "128x2x8x9", "axbxc"])
def test_a_bad_shape_is_one_clear_error(bad):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "ab_attention.py"), "--base", "HEAD", "--shapes", bad],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.startswith("ab_attention: --shapes:") and "Traceback" not in r.stderr


@pytest.mark.slow  # two builds of the kernels (~40 s here)
def test_the_working_tree_against_itself_gives_equal_outputs(tmp_path):
    """Both sides built from the same source: the outputs' hashes agree (the script refuses to time
    builds that differ) and each side reports a time."""
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "ab_attention.py"), "--base", "HEAD", "--new", "HEAD",
                        "--shapes", "64x3x100x9", "--rounds", "2", "--calls", "1", "--json", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    row = json.loads(out.read_text())["shapes"]["64x3x100x9"]
    assert row["base_us"] > 0 and row["new_us"] > 0
