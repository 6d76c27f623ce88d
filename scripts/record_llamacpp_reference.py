#!/usr/bin/env python3
"""Record llama.cpp's greedy continuations, with the top-2 logprobs of every generated position.

    python scripts/record_llamacpp_reference.py [MODEL ...] [--tokens 32] [--llama-bin DIR]

MODEL is a name from ``tsspec.hub.KNOWN_MODELS`` (default: all of them). For each model this starts
``llama-server`` on 127.0.0.1 (a free port, ``-t 2 -c 1024 -np 1``, no speculation, greedy sampler
chain, prompt cache off), sends every prompt as a list of token ids to ``/completion`` and writes
``tests/fixtures/llamacpp/<model>.json``; ``tests/test_vs_llamacpp.py`` compares tsspec's plain greedy
decode against it, so the tests need no llama.cpp.

Prompts: the four of ``tests/fixtures/reference/<model>.json`` with the ids recorded there (the
transformers tokenizer), then the ``EXTRA`` texts below (code, prose, a list, a question, a chat
turn) encoded by tsspec's own tokenizer (``Tokenizer.from_gguf``; the chat turn through the file's
chat template and ``tsspec.chat.encode_chat``). Token ids go to the server as given: for an
all-integer prompt llama-server adds no BOS, so both engines see exactly the same ids.

Request (b11434, tools/server/README.md): ``"samplers": ["top_k"], "top_k": 1, "temperature": 0``
(pure greedy: only the argmax survives the chain), ``"n_probs": 2`` with ``"post_sampling_probs":
false`` (the server's ``get_token_probabilities``: a plain softmax of the model's raw logits, before
any sampler, so ``logprob[0] - logprob[1]`` is the raw top-2 logit gap), ``"return_tokens": true``,
``"cache_prompt": false``. ``ignore_eos`` stays false: llama.cpp implements it as a -inf bias on the
end-of-generation tokens, which would make its choice differ from the raw argmax; a continuation
that ends at EOS is recorded shorter instead (``stop_type``).

Each case: ``prompt`` (text), ``prompt_ids``, ``source`` ("reference" or "extra"),
``continuation_ids``, ``top2_ids`` and ``top2_logprobs`` per generated position, ``gaps`` (nats,
top-1 minus top-2 logprob), ``stop_type`` and ``content``. Provenance: llama.cpp build, model sha256
(the cache's ``.sha256`` sidecar), server command line and request settings.

llama.cpp: ``bash /work/shared/tools/build_llamacpp.sh`` builds it (default bin dir
``$LLAMA_CPP_DIR/build/bin`` or ``~/.cache/tsspec-peer/llama.cpp/build/bin``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tsspec.bench import llama_server
from tsspec.bench.llama_server import LlamaServer, free_port, llama_tool
from tsspec.errors import TsspecError
from tsspec.hub import KNOWN_MODELS, recorded_sha256

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "tests" / "fixtures" / "reference"
OUT = REPO / "tests" / "fixtures" / "llamacpp"
ALL_MODELS = list(KNOWN_MODELS)
THREADS = 2
N_CTX = 1024

# Extra prompts beyond the four reference ones: (kind, text). "chat" texts go through the chat template.
EXTRA: list[tuple[str, str]] = [
    ("code", "import numpy as np\n\n\ndef softmax(x):\n"),
    ("code", "#include <stdio.h>\n\nint main(void) {\n    int i;\n    for (i = 0; i < 10; i++) {\n"),
    ("code", "// Sort an array of numbers in JavaScript\nfunction sortNumbers(arr) {\n"),
    ("prose", "The Industrial Revolution began in Britain in the late eighteenth century and"),
    ("prose", "Photosynthesis is the process by which plants"),
    ("list", "Shopping list:\n1. Milk\n2. Eggs\n3."),
    ("question", "Why is the sky blue? Explain it to a ten-year-old.\n\n"),
    ("code", "class Stack:\n    def __init__(self):\n"),
    ("code", "-- total spent per customer\nSELECT customer_id,"),
    ("prose", "Dear Sam,\n\nThank you for your letter. I"),
    ("list", "The planets of the solar system, in order from the Sun:\n-"),
    ("question", "What are the main differences between Python lists and tuples?\n\n"),
    ("chat", "Write a Python function that checks whether a string is a palindrome."),
]


class ScriptError(Exception):
    """Printed as one ``error: ...`` line; the script exits non-zero."""


# ============================================================================ environment


def server_version(exe: Path) -> dict[str, Any]:
    """``llama-server --version`` -> {"build_number", "build_commit", "version_text"}."""
    try:
        r = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60)
        text = (r.stdout + r.stderr).strip()
    except (OSError, subprocess.SubprocessError) as e:
        raise ScriptError(f"{exe} --version failed: {e}") from None
    m = re.search(r"build (\d+)(?:,? \(?commit ([^)\s]+))?", text)
    return {"build_number": int(m.group(1)) if m else None, "build_commit": m.group(2) if m else None,
            "version_text": text}


def server_argv(exe: Path, model: Path, port: int) -> list[str]:
    """The bench's plain llama-server (greedy, one slot, no prompt cache) with this script's context."""
    return llama_server.server_argv(exe, model, port, threads=THREADS, ctx=N_CTX, mode="plain")


def request_body(prompt_ids: list[int], n_predict: int) -> dict:
    return {
        "prompt": list(prompt_ids), "n_predict": n_predict, "cache_prompt": False, "stream": False,
        "samplers": ["top_k"], "top_k": 1, "temperature": 0.0, "seed": 0,
        "n_probs": 2, "post_sampling_probs": False, "return_tokens": True, "ignore_eos": False,
    }


def _logprob(x: Any) -> float:
    v = float(x)
    return v if math.isfinite(v) else -1e30


def parse_completion(obj: dict) -> dict:
    """A /completion answer -> continuation ids, top-2 ids/logprobs and gaps per position.

    Checks what greedy must give: the generated token is the raw top-1 (up to an exact tie)."""
    toks = [int(t) for t in obj.get("tokens") or []]
    probs = obj.get("completion_probabilities") or []
    if len(toks) != len(probs):
        raise ScriptError(f"{len(toks)} tokens but {len(probs)} completion_probabilities")
    top2_ids, top2_lp, gaps = [], [], []
    for i, (t, p) in enumerate(zip(toks, probs)):
        top = p.get("top_logprobs")
        if top is None:
            raise ScriptError("no top_logprobs in the answer: is post_sampling_probs really off?")
        if int(p["id"]) != t:
            raise ScriptError(f"position {i}: completion_probabilities id {p['id']} != token {t}")
        if len(top) < 2:
            raise ScriptError(f"position {i}: only {len(top)} top_logprobs")
        ids = [int(e["id"]) for e in top[:2]]
        lps = [_logprob(e["logprob"]) for e in top[:2]]
        if ids[0] != t and lps[0] != _logprob(p["logprob"]):
            raise ScriptError(f"position {i}: generated {t} is not the raw top-1 {ids[0]} (not greedy?)")
        top2_ids.append(ids)
        top2_lp.append([round(v, 6) for v in lps])
        gaps.append(round(lps[0] - lps[1], 6))
    return {"continuation_ids": toks, "top2_ids": top2_ids, "top2_logprobs": top2_lp, "gaps": gaps,
            "stop_type": obj.get("stop_type"), "content": obj.get("content", "")}


# ============================================================================ prompts


def prompts_for(name: str, path: Path) -> list[dict]:
    from tsspec.chat import build_messages, encode_chat, render_chat
    from tsspec.tokenizer import Tokenizer

    out = []
    ref = REFERENCE / f"{name}.json"
    if ref.exists():
        for c in json.loads(ref.read_text())["cases"]:
            out.append({"prompt": c["prompt"], "kind": "reference", "source": "reference",
                        "prompt_ids": list(c["prompt_ids"])})
    tok = Tokenizer.from_gguf(path)
    for kind, text in EXTRA:
        if kind == "chat":
            if not tok.chat_template:
                continue
            rendered = render_chat(tok.chat_template, build_messages(text),
                                   bos_token=tok.token_text(tok.bos_id) if tok.bos_id is not None else "",
                                   eos_token=tok.token_text(tok.eos_id) if tok.eos_id is not None else "")
            ids = encode_chat(tok, rendered)
            out.append({"prompt": rendered, "kind": kind, "source": "extra", "prompt_ids": ids})
        else:
            out.append({"prompt": text, "kind": kind, "source": "extra", "prompt_ids": tok.encode(text)})
    return out


# ============================================================================ main


def dump_fixture(data: dict) -> str:
    """JSON with the provenance indented and one line per case (small, readable diffs)."""
    head = {k: v for k, v in data.items() if k != "cases"}
    text = json.dumps(head, indent=1, ensure_ascii=False)[:-2]  # drop the closing "\n}"
    cases = ",\n".join("  " + json.dumps(c, ensure_ascii=False) for c in data["cases"])
    text += ',\n "cases": [\n' + cases + "\n ]\n}\n"
    json.loads(text)  # still one JSON document
    return text


def record(name: str, exe: Path, version: dict, n_tokens: int, out_dir: Path) -> Path:
    from tsspec.hub import ensure_model

    path = ensure_model(name)
    cases = prompts_for(name, path)
    port = free_port()
    url = f"http://127.0.0.1:{port}"  # LlamaServer holds it to loopback
    argv = server_argv(exe, path, port)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="tsspec-llama-") as tmp:
        with LlamaServer(argv, url, Path(tmp) / "server.log") as srv:
            print(f"{name}: llama-server ready in {time.time() - t0:.0f}s ({url})", flush=True)
            if srv.fallback:
                print(f"{name}: note: {srv.fallback}", flush=True)
            props = srv.get("/props")
            settings = None
            for c in cases:
                t = time.time()
                obj = srv.post("/completion", request_body(c["prompt_ids"], n_tokens))
                c.update(parse_completion(obj))
                gs = obj.get("generation_settings") or {}
                if settings is None:
                    settings = {k: gs.get(k) for k in ("samplers", "top_k", "temperature", "n_probs",
                                                       "post_sampling_probs", "ignore_eos", "n_ctx")
                                if k in gs}
                small = min(c["gaps"]) if c["gaps"] else float("nan")
                print(f"  {c['kind']:9s} {len(c['prompt_ids']):3d}+{len(c['continuation_ids']):2d} tok "
                      f"({time.time() - t:4.1f}s, min gap {small:.3f}) {c['content'][:60]!r}", flush=True)
    data = {
        "model": name,
        "engine": "llama.cpp llama-server",
        "provenance": {
            "llama_cpp_build_number": version["build_number"],
            "llama_cpp_build_commit": version["build_commit"],
            "llama_cpp_version": version["version_text"],
            "server_build_info": props.get("build_info"),
            "model_file": path.name,
            "model_sha256": recorded_sha256(path),
            "server_argv": [Path(a).name if a in (str(exe), str(path)) else a for a in srv.argv],
            "server_fallback": srv.fallback,
            "request": {k: v for k, v in request_body([], n_tokens).items() if k != "prompt"},
            "server_generation_settings": settings,
            "recorded_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "script": "scripts/record_llamacpp_reference.py",
            "notes": "top2_logprobs are pre-sampling (softmax of raw logits); gaps = top-1 minus top-2 logprob in nats",
        },
        "cases": cases,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    dest = out_dir / f"{name}.json"
    dest.write_text(dump_fixture(data))
    print(f"{name}: {len(cases)} prompts -> {dest.relative_to(REPO)} ({time.time() - t0:.0f}s)", flush=True)
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", default=ALL_MODELS, help="model names (default: all)")
    ap.add_argument("--tokens", type=int, default=32, help="tokens to generate per prompt (default 32)")
    ap.add_argument("--llama-bin", default=None, help="directory holding llama-server")
    ap.add_argument("--out", default=str(OUT), help="fixture directory (default tests/fixtures/llamacpp)")
    args = ap.parse_args(argv)
    try:
        unknown = [m for m in args.models if m not in KNOWN_MODELS]
        if unknown:
            raise ScriptError(f"unknown model(s) {unknown}; known: {', '.join(KNOWN_MODELS)}")
        if args.tokens <= 0:
            raise ScriptError("--tokens must be positive")
        exe = llama_tool("llama-server", args.llama_bin)
        version = server_version(exe)
        for m in args.models:
            record(m, exe, version, args.tokens, Path(args.out))
    except (ScriptError, TsspecError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
