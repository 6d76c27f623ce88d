#!/usr/bin/env python3
"""Who is right where tsspec and llama.cpp part on a real model: teacher-forced top-2 margins.

    python scripts/gemma3_margins.py [--model gemma3-270m] [--prompt TEXT] [--tokens 40]
                                     [--llama-bin DIR] [--f64] [--json OUT]

One token sequence (the chat-templated prompt, then llama.cpp's greedy continuation when
``--llama-bin`` is given, else tsspec's f32 greedy one) is run, teacher-forced, through

* llama.cpp's ``llama-server`` (its greedy continuation, with ``n_probs`` 2 of the raw logits:
  the same request as ``scripts/record_llamacpp_reference.py``),
* tsspec with ``--weights f32`` and with the default format,
* transformers' ``Gemma3ForCausalLM`` (any architecture transformers reads from GGUF) loaded from
  the same file, dequantized by transformers' GGUF loader, in float32 and (``--f64``) float64,

and prints, per generated position, each engine's margin between llama.cpp's top-1 and top-2
candidates (logit difference in nats; negative: that engine prefers llama.cpp's runner-up) and
whether its own argmax is llama.cpp's token. At the first position where tsspec f32's argmax is not
llama.cpp's token, llama.cpp is asked again for the same position with more of the generated tokens
prefilled with the prompt (same tokens, same positions, another batch split) to show how far its
own logits move with the split. transformers in float64 on the dequantized weights is
the arbiter: it has no activation quantization and no float32 accumulation.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

PROMPT = "List the first ten prime numbers."


def prompt_ids(path: Path, text: str) -> list[int]:
    from tsspec.chat import build_messages, chat_prompt_ids
    from tsspec.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(path)
    if tok.chat_template:
        return chat_prompt_ids(tok, build_messages(text))
    # no template in the file (gemma3-270m has none): the text as `tsspec generate -p` encodes it
    return tok.encode(text)


def llama_continuation(bin_dir: Path, path: Path, ids: list[int], n: int, extra: list[str] = ()) -> dict:
    """llama.cpp's greedy continuation of ``ids`` with its top-2 raw logprobs per position
    (``extra``: more llama-server flags, e.g. ``-ctk f32 -ctv f32`` for an f32 KV cache)."""
    import record_llamacpp_reference as rec
    from tsspec.bench.llama_server import LlamaServer, free_port

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="tsspec-llama-") as tmp:
        with LlamaServer([*rec.server_argv(bin_dir / "llama-server", path, port), *extra], f"http://127.0.0.1:{port}",
                         Path(tmp) / "server.log") as srv:
            return rec.parse_completion(srv.post("/completion", rec.request_body(ids, n)))


def llama_split_probe(bin_dir: Path, path: Path, ids: list[int], cont: list[int], pos: int,
                      splits: list[int], extra: list[str] = ()) -> list[tuple[int, list]]:
    """llama.cpp's top-4 logprobs at generated position ``pos`` when the first ``k`` generated tokens
    are sent with the prompt (prefilled as one batch) and the rest up to ``pos`` decoded one by one:
    the same tokens at the same positions, only the batch split differs."""
    import record_llamacpp_reference as rec
    from tsspec.bench.llama_server import LlamaServer, free_port

    out = []
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="tsspec-llama-") as tmp:
        with LlamaServer([*rec.server_argv(bin_dir / "llama-server", path, port), *extra], f"http://127.0.0.1:{port}",
                         Path(tmp) / "server.log") as srv:
            for k in splits:
                body = rec.request_body(ids + cont[:k], pos + 1 - k)
                body["n_probs"] = 4
                obj = srv.post("/completion", body)
                if obj["tokens"][: pos - k] != cont[k:pos]:
                    raise RuntimeError(f"split {k}: llama.cpp decoded other tokens before position {pos}")
                top = obj["completion_probabilities"][pos - k]["top_logprobs"]
                out.append((k, [(int(t["id"]), float(t["logprob"])) for t in top]))
    return out


def tsspec_engine(path: Path, fmt: str | None):
    from tsspec.models import load_model

    m = load_model(path, fmt=fmt)
    return lambda seq: m.forward(seq, m.make_cache(), all_logits=True).logits.double()


def tsspec_greedy(path: Path, ids: list[int], n: int) -> list[int]:
    from tsspec.models import load_model
    from tsspec.sampling import Sampler
    from tsspec.spec.loop import decode

    return decode(load_model(path, fmt="f32"), Sampler(), ids, n)


def hf_engine(path: Path, dtype: torch.dtype):
    """transformers' model for the file (weights dequantized by its GGUF loader) in ``dtype``."""
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=cfg,
                                                              dtype=torch.float32)
    model = model.to(dtype).eval()

    def run(seq: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([seq])).logits[0].double()

    return run


def margins(logits: torch.Tensor, n_prompt: int, top2: list[list[int]]) -> list[dict]:
    """Per generated position: logit[top1] - logit[top2] for the given candidate pairs, own argmax."""
    out = []
    for i, (a, b) in enumerate(top2):
        row = logits[n_prompt - 1 + i]
        v, ix = row.topk(2)
        out.append({"gap": float(row[a] - row[b]), "argmax": int(ix[0]), "own_gap": float(v[0] - v[1])})
    return out


def main(argv: list[str] | None = None) -> int:
    from tsspec.hub import ensure_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--prompt", action="append", help=f"repeatable (default {PROMPT!r})")
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--llama-bin", type=Path)
    ap.add_argument("--llama-arg", action="append", default=[], help="extra llama-server flag (repeatable)")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers (tsspec and llama.cpp only)")
    ap.add_argument("--f64", action="store_true", help="also transformers in float64")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    torch.set_num_threads(2)
    path = Path(ensure_model(a.model))
    from tsspec.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(path)
    engines = {"tsspec f32": tsspec_engine(path, "f32"), "tsspec auto": tsspec_engine(path, None)}
    if not a.no_hf:
        engines["hf f32"] = hf_engine(path, torch.float32)
    if a.f64 and not a.no_hf:
        engines["hf f64"] = hf_engine(path, torch.float64)
    report = []
    for text in a.prompt or [PROMPT]:
        ids = prompt_ids(path, text)
        if a.llama_bin:
            ref = llama_continuation(a.llama_bin, path, ids, a.tokens, a.llama_arg)
            cont, top2, ref_gaps = ref["continuation_ids"], ref["top2_ids"], ref["gaps"]
            source = "llama.cpp"
        else:
            cont, source, ref_gaps = tsspec_greedy(path, ids, a.tokens), "tsspec f32", None
        seq = ids + cont
        logits = {name: run(seq) for name, run in engines.items()}
        if ref_gaps is None:  # pairs from tsspec f32's own top 2
            top2 = [logits["tsspec f32"][len(ids) - 1 + i].topk(2).indices.tolist() for i in range(len(cont))]
        rows = {name: margins(lg, len(ids), top2) for name, lg in logits.items()}
        print(f"\nprompt {text!r}: {len(ids)} ids; continuation from {source}: {tok.decode(cont)!r}")
        names = list(engines)
        print("pos  token           cand2         " + ("llama   " if ref_gaps else "")
              + "  ".join(f"{n:>12s}" for n in names))
        for i, t in enumerate(cont):
            cells = [f"{rows[n][i]['gap']:+9.3f}{'' if rows[n][i]['argmax'] == top2[i][0] else ' *':2s}" for n in names]
            lg = f"{ref_gaps[i]:+6.3f}  " if ref_gaps else ""
            print(f"{i:3d}  {tok.decode([t])!r:14s}  {tok.decode([top2[i][1]])!r:12s}  {lg}"
                  + "  ".join(f"{c:>12s}" for c in cells))
        parted = next((i for i, r in enumerate(rows["tsspec f32"]) if r["argmax"] != top2[i][0]), None)
        split = None
        if a.llama_bin and parted is not None:
            split = llama_split_probe(a.llama_bin, path, ids, cont, parted, sorted({0, parted // 2, parted - 1, parted}),
                                      a.llama_arg)
            print(f"llama.cpp at position {parted} by batch split (generated tokens prefilled with the prompt):")
            for k, top in split:
                print(f"  {k:3d} prefilled, {parted - k:3d} decoded: "
                      + ", ".join(f"{tok.decode([t])!r} {lp:+.3f}" for t, lp in top))
        report.append({"prompt": text, "parted_at": parted, "llama_split": split, "prompt_ids": ids, "continuation": cont, "source": source, "top2": top2,
                       "llama_gaps": ref_gaps, "engines": rows})
    print("(* : that engine's argmax is not the continuation's token)")
    if a.json:
        a.json.write_text(json.dumps({"model": a.model, "cases": report}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
