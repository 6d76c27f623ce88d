"""A small corpus for training drafters on tiny trunks: varied, repetitive text that the tiny
byte-level tokenizer turns into long token runs (tests/test_distill*.py, test_export_hf.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

TEXT = ("def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"
        "        self.y = y\n\nThe quick brown fox jumps over the lazy dog. ")


def write_corpus(d: Path, files: int = 12, words: int = 600) -> Path:
    """``files`` text files of ``words`` words drawn (seeded) from TEXT, in ``d``."""
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    vocab = TEXT.split(" ")
    for i in range(files):
        (d / f"f{i:02d}.txt").write_text(" ".join(vocab[j % len(vocab)] for j in rng.integers(0, len(vocab), words)))
    return d


@pytest.fixture(scope="module", autouse=True)
def own_cache(tmp_path_factory):
    """Features and answers are cached beside the model cache: a test module gets its own, never
    the user's (import this fixture into the module)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TSSPEC_CACHE", str(tmp_path_factory.mktemp("cache") / "models"))
    yield mp
    mp.undo()
