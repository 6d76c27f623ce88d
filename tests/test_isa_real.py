"""The instruction-set levels on the real models: TSSPEC_ISA=auto, each SIMD level this CPU runs and
scalar (the plain C reference) give the same logits bit for bit, and so the same greedy tokens.

Each level runs in a process of its own (the level is chosen when the library loads): a prompt
taken as one multi-row forward, then greedy single-row steps; every logit row is saved and compared
as bits. The scalar level's products are the reference's (one weight group unpacked per row), slow
on the 1.5b model, so the prompt and the continuation are short. Tests/test_isa.py holds every
product to the reference on random blocks; this holds the whole stack on the files users run.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from tsspec import kernels

pytestmark = [pytest.mark.real_model,
              pytest.mark.skipif(not kernels.available(), reason=f"native kernels: {kernels.unavailable_reason()}")]

MODELS = ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]
PROMPT = "def fibonacci(n):\n    # return the n-th Fibonacci number"
STEPS = 6

SCRIPT = r"""
import sys, numpy as np, torch
from tsspec import kernels
from tsspec.models import load_model
from tsspec.tokenizer import Tokenizer
path, out, want, prompt, steps = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
torch.set_num_threads(2)
m = load_model(path, n_ctx=256)
assert kernels.level() == want, (kernels.level(), want)
assert getattr(m, "fused", None) is not None  # the native block engine, not the torch blocks
ids = Tokenizer.from_gguf(path).encode(prompt)
c = m.make_cache()
rows = [m.forward(ids, c, all_logits=True).logits]
for _ in range(steps):
    nxt = int(rows[-1][-1].argmax())
    rows.append(m.forward([nxt], c, all_logits=True).logits)
np.save(out, torch.cat(rows).numpy())
"""


def levels_to_run() -> list[tuple[str, str]]:
    """(TSSPEC_ISA word, the level it loads): auto, then every level here (scalar last)."""
    here = kernels.cpu_levels()
    out = [("auto", here[0])]
    for lv in here:
        out.append(("neon" if lv.startswith("neon") else lv, lv))
    return out


@pytest.mark.parametrize("name", MODELS)
def test_every_level_gives_the_same_logits_and_tokens(name, real_model_path, tmp_path):
    path = real_model_path(name)
    outs = {}
    for word, lv in levels_to_run():
        f = tmp_path / f"{word}.npy"
        env = {**os.environ, "TSSPEC_ISA": word}
        r = subprocess.run([sys.executable, "-c", SCRIPT, str(path), str(f), lv, PROMPT, str(STEPS)],
                           capture_output=True, text=True, env=env, timeout=1800)
        assert r.returncode == 0, f"TSSPEC_ISA={word}: {r.stderr[-2000:]}"
        outs[word] = np.load(f)
    first_word, first = next(iter(outs.items()))
    tokens = first.argmax(-1)
    assert first.shape[0] > STEPS and np.isfinite(first).all()
    for word, o in outs.items():
        assert o.shape == first.shape
        assert np.array_equal(o.argmax(-1), tokens), f"{name}: {word} chose other tokens than {first_word}"
        assert np.array_equal(o.view(np.int32), first.view(np.int32)), f"{name}: {word}'s logits differ from {first_word}'s"
