"""The AMX tiles on the real models: every logit of a 600-token prompt, greedy steps and a 5-row
verify equal the VNNI path's bit for bit with every multi-row product on the hardware tiles, and a
seeded, n-gram-speculated run gives the same tokens under TSSPEC_AMX=1 and =0 (2 threads, so the
OpenMP workers load their own tile configuration); with prompt rows on the super-block route
(TSSPEC_PROMPT_TILES=1), seeded n-gram speculation gives plain's tokens.

Hardware only: on a CPU without AMX the tiles' code runs through its C emulation against the
reference in tests/test_amx.py (every type, rows 1..256, whole tiny models); a real model through
the emulated tiles would take hours there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from test_kernels import tiles_as_loaded
from tsspec import kernels

pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(not kernels.available() or not kernels.amx_usable(),
                       reason="needs AMX tiles the kernel grants (the emulation runs in tests/test_amx.py)"),
]

MODELS = ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]
PARAGRAPH = ("The cache keeps the keys and values of every position the model has seen, so a verify of "
             "several drafted tokens reads them once. ")


def logits_through(m, ids: list[int]) -> np.ndarray:
    """Every logit row of the prompt, four greedy steps and a 5-row forward of drafted tokens."""
    c = m.make_cache()
    rows = [m.forward(ids, c, all_logits=True).logits]
    for _ in range(4):
        rows.append(m.forward([int(rows[-1][-1].argmax())], c, all_logits=True).logits)
    rows.append(m.forward([int(rows[-1][-1].argmax()), *ids[5:9]], c, all_logits=True).logits)
    return torch.cat(rows).numpy()


@pytest.mark.parametrize("name", MODELS)
def test_tiles_give_the_vnni_logits_on_a_long_prompt(name, real_model_path):
    from tsspec.models import load_model
    from tsspec.tokenizer import Tokenizer

    path = real_model_path(name)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        m = load_model(path, n_ctx=1024)
        ids = Tokenizer.from_gguf(path).encode(PARAGRAPH * 30)[:640]
        assert len(ids) == 640
        kernels.use_tiles(0)
        vnni = logits_through(m, ids)
        kernels.use_tiles(1, min_rows=2)  # every product of 2 rows or more on the tiles
        tiles = logits_through(m, ids)
    finally:
        tiles_as_loaded()
        torch.set_num_threads(threads)
    assert np.isfinite(vnni).all()
    assert np.array_equal(tiles.argmax(-1), vnni.argmax(-1))
    assert np.array_equal(tiles.view(np.int32), vnni.view(np.int32))


@pytest.mark.parametrize("name", MODELS)
def test_seeded_ngram_speculation_gives_the_same_tokens_under_amx(name, real_model_path, tmp_path):
    path = real_model_path(name)
    prompt = tmp_path / "p.txt"
    prompt.write_text(PARAGRAPH * 30)
    outs = []
    for mode in ("0", "1"):
        env = {**os.environ, "TSSPEC_AMX": mode, "OMP_NUM_THREADS": "2"}
        r = subprocess.run([sys.executable, "-m", "tsspec", "generate", "-m", str(path), "-f", str(prompt), "-n",
                            "24", "--temp", "0.8", "--seed", "3", "--spec", "--spec-type", "ngram", "--json", "-t",
                            "2"], capture_output=True, text=True, env=env, timeout=1200)
        assert r.returncode == 0, f"TSSPEC_AMX={mode}: {r.stderr[-2000:]}"
        out = json.loads(r.stdout)
        assert out["prompt_tokens"] >= 600
        outs.append(out["token_ids"])
    assert outs[0] == outs[1] and len(outs[0]) > 0


@pytest.mark.parametrize("name", MODELS)
def test_speculation_equals_plain_with_prompt_rows_on_the_tiles(name, real_model_path, tmp_path):
    """TSSPEC_PROMPT_TILES=1: a 600-token prompt's Q4_K and Q6_K products in the super-block
    arithmetic on the tiles (prompt_tiles.c); plain (the lean path) and n-gram speculation forward
    the prompt alike and keep generated and verify rows on the shared arithmetic, so the seeded
    tokens agree"""
    path = real_model_path(name)
    prompt = tmp_path / "p.txt"
    prompt.write_text(PARAGRAPH * 30)
    outs = []
    for spec in ([], ["--spec", "--spec-type", "ngram"]):
        env = {**os.environ, "TSSPEC_PROMPT_TILES": "1", "OMP_NUM_THREADS": "2"}
        r = subprocess.run([sys.executable, "-m", "tsspec", "generate", "-m", str(path), "-f", str(prompt), "-n",
                            "24", "--temp", "0.8", "--seed", "3", *spec, "--json", "-t", "2"],
                           capture_output=True, text=True, env=env, timeout=1200)
        assert r.returncode == 0, f"{spec or 'plain'}: {r.stderr[-2000:]}"
        out = json.loads(r.stdout)
        assert out["prompt_tokens"] >= 600
        outs.append(out["token_ids"])
    assert outs[0] == outs[1] and len(outs[0]) == 24
    # and the switch took: a process under the same environment routes prompt rows to the tiles
    r = subprocess.run([sys.executable, "-c", "from tsspec import kernels; kernels.lib(); "
                        "print(kernels.prompt_tiles_status())"], capture_output=True, text=True, env=env, timeout=600)
    assert "on the AMX tiles" in r.stdout, r.stdout + r.stderr[-1000:]
