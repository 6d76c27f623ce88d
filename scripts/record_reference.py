#!/usr/bin/env python3
"""Record reference logits from an independent engine (transformers loading the same GGUF).

For each real model and prompt: the prompt's token ids (transformers' tokenizer), the top-k
logits of every prompt position and of a 32+ token greedy continuation, and the continuation's ids.
The fixtures are small JSON files under tests/fixtures/reference/, so CI needs no second engine.

    python scripts/record_reference.py [MODEL ...]      # needs: pip install tsspec[reference]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived",
    "List of prime numbers: 2, 3, 5, 7,",
]
N_NEW = 40
TOP_K = 8
OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "reference"


def record(name: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tsspec.hub import ensure_model

    path = ensure_model(name)
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()
    print(f"{name}: loaded in {time.time() - t0:.0f}s", flush=True)
    cases = []
    for prompt in PROMPTS:
        ids = tok(prompt, add_special_tokens=True)["input_ids"]
        with torch.no_grad():
            gen = model.generate(
                torch.tensor([ids]), max_new_tokens=N_NEW, do_sample=False, output_logits=True,
                return_dict_in_generate=True, pad_token_id=tok.eos_token_id, min_new_tokens=N_NEW,
            )
            seq = gen.sequences[0].tolist()
            full = model(torch.tensor([seq[:-1]])).logits[0]  # teacher-forced over prompt + continuation
        top = torch.topk(full, TOP_K, dim=-1)
        cases.append({
            "prompt": prompt,
            "prompt_ids": ids,
            "continuation_ids": seq[len(ids):],
            "top_ids": top.indices.tolist(),
            "top_logits": [[round(v, 4) for v in row] for row in top.values.tolist()],
        })
        print(f"  {prompt[:30]!r}: {tok.decode(seq[len(ids):])!r}", flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{name}.json").write_text(json.dumps({"model": name, "engine": "transformers", "cases": cases}))


if __name__ == "__main__":
    for n in sys.argv[1:] or ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]:
        record(n)
