"""scripts/gpu_check.py as an importable module for the tests (``import gpu_check_module``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"
_spec = importlib.util.spec_from_file_location("gpu_check", _PATH)
_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mod)
sys.modules[__name__] = _mod
