#!/usr/bin/env python3
"""Does llama.cpp run a block drafter ``tsspec distill --kind block`` wrote, and draft what we draft?

    python scripts/llamacpp_dflash_check.py [-m smollm2-135m] [-d DRAFTER.gguf] [-w code -w prose]
        [--prompts 4] [-n 64] [--llama-bin DIR]

It starts llama.cpp's ``llama-server`` with the trunk, ``-md DRAFTER --spec-type draft-dflash`` and
debug logging (``-v``: b11434 logs each block's drafted tokens as "draft candidate 0, pos i"), sends
each prompt greedily as token ids (the first ``--prompts`` of each workload, through the trunk's chat
template), and reads back the generated tokens and every block it drafted.

Then tsspec, teacher-forced on llama.cpp's own text, drafts at the same anchors: the trunk's tapped
rows for the prompt and the text before each anchor fill the drafter's ring, and the block drafter
(the ``block`` speculator, gate off) proposes from the anchor token. Per prompt the table gives the
blocks llama.cpp drafted, how many of them tsspec drafted identically, and the drafts accepted as
llama.cpp counted them (its ``draft_n_accepted`` / ``draft_n``) beside the same count replayed from the
logged blocks (which checks the parse; llama.cpp clips the last blocks to the tokens left, so its
count can be a few drafts lower). Identical blocks show that llama.cpp reads the file (taps, MASK
token, draft vocabulary, rope, norms) as tsspec does. A block can still differ where the drafter's
distribution is flat, since the engines round differently (ggml quantizes the activations for a
Q8_0 matrix to 8 bits); "parted at p <=" is the highest probability tsspec gave its own draft at
the first position where a block differs.

llama.cpp: ``bash /work/shared/tools/build_llamacpp.sh`` builds it (default bin dir
``$LLAMA_CPP_DIR/build/bin`` or ``~/.cache/tsspec-peer/llama.cpp/build/bin``). Exit status 1 when
llama.cpp refuses the file or no block matches.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

from tsspec.bench.llama_server import LlamaServer, free_port, llama_tool, request_body, server_argv
from tsspec.errors import TsspecError
from tsspec.models.cache import common_prefix

THREADS = 2
N_CTX = 2048
_CANDIDATE = re.compile(r"draft candidate\s+0, pos\s+(\d+):\s+(-?\d+)")


def parse_blocks(log_text: str) -> list[list[int]]:
    """The drafted blocks in a llama-server debug log: each block's top candidate per position."""
    blocks: list[list[int]] = []
    for m in _CANDIDATE.finditer(log_text):
        pos, tok = int(m.group(1)), int(m.group(2))
        if pos == 0 or not blocks:
            blocks.append([])
        blocks[-1].append(tok)
    return blocks


def replay(blocks: list[list[int]], generated: list[int]) -> list[tuple[int, list[int], int]]:
    """Each block's anchor (index into ``generated``), its drafts and how many greedy verification
    accepted: the longest prefix equal to the text that followed. The next block drafts from the
    token after the last accepted one (the verify's own token)."""
    out, a = [], 0
    for b in blocks:
        if a >= len(generated):
            break
        acc = common_prefix(b, generated[a + 1: a + 1 + len(b)])
        out.append((a, b, acc))
        a += acc + 1
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("-d", "--drafter", default=None,
                    help="block drafter GGUF (default: ~/.cache/tsspec/heads/MODEL-block.gguf)")
    ap.add_argument("-w", "--workload", action="append", default=None)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per workload")
    ap.add_argument("-n", "--tokens", type=int, default=64)
    ap.add_argument("--llama-bin", default=None, help="directory holding llama-server")
    args = ap.parse_args(argv)

    import torch
    from rich.console import Console
    from rich.table import Table

    from tsspec.bench.workloads import get_workload
    from tsspec.chat import build_messages, chat_prompt_ids
    from tsspec.drafters import load_drafter
    from tsspec.hub import ensure_model
    from tsspec.models import load_model
    from tsspec.sampling import Sampler
    from tsspec.spec.block import BlockSpeculator
    from tsspec.spec.protocols import DraftContext
    from tsspec.tokenizer import Tokenizer

    console = Console()
    try:
        exe = llama_tool("llama-server", args.llama_bin)
        trunk_path = ensure_model(args.model)
        drafter_path = Path(args.drafter or Path.home() / ".cache/tsspec/heads" / f"{args.model}-block.gguf")
        if not drafter_path.exists():
            raise TsspecError(f"no drafter at {drafter_path}: train one with "
                              f"tsspec distill -m {args.model} --kind block -o {drafter_path}")
        torch.set_num_threads(THREADS)
        target = load_model(trunk_path)
        tok = Tokenizer.from_gguf(trunk_path)
        drafter = load_drafter(drafter_path, target)
        if drafter.speculator_name != "block":
            raise TsspecError(f"{drafter_path.name} is not a block drafter (a dflash file from "
                              f"tsspec distill --kind block); llama.cpp's draft-dflash runs only those")
        head = drafter.draft_head
        k = head.block_size - 1
        cases = []
        for w in args.workload or ["code", "prose"]:
            for p in get_workload(w).prompts[: args.prompts]:
                cases.append((w, p.id, chat_prompt_ids(tok, build_messages(p.text))))

        port = free_port()
        srv_argv = server_argv(exe, trunk_path, port, threads=THREADS, ctx=N_CTX, mode="draft-dflash")
        srv_argv += ["-md", str(drafter_path), "--spec-draft-n-max", str(k), "-td", str(THREADS), "-v"]
        results = []
        with tempfile.TemporaryDirectory(prefix="tsspec-llama-") as tmp:
            log = Path(tmp) / "server.log"
            with LlamaServer(srv_argv, f"http://127.0.0.1:{port}", log) as srv:
                if srv.fallback:
                    console.print(f"note: {srv.fallback}")
                for w, pid, ids in cases:
                    start = log.stat().st_size
                    obj = srv.post("/completion", request_body(ids, args.tokens, ignore_eos=False))
                    with open(log, "rb") as fh:
                        fh.seek(start)
                        text = fh.read().decode(errors="replace")
                    t = obj.get("timings") or {}
                    results.append((w, pid, ids, [int(x) for x in obj.get("tokens") or []], parse_blocks(text),
                                    int(t.get("draft_n", 0)), int(t.get("draft_n_accepted", 0))))
    except TsspecError as e:
        console.print(f"[red]error:[/red] {e}")
        return 1

    table = Table(title=f"llama.cpp draft-dflash with {drafter_path.name} on {args.model}: "
                        f"its blocks vs tsspec's at the same anchors")
    for col in ("workload", "prompt", "tokens", "blocks", "identical", "parted at p <=", "accepted (llama.cpp)",
                "accepted (replayed)"):
        table.add_column(col, justify="right" if col not in ("workload", "prompt") else "left")
    total_blocks = total_same = 0
    for w, pid, ids, gen, blocks, n_draft, n_acc in results:
        seq = ids + gen
        with torch.inference_mode():
            hidden = target.forward(seq, target.make_cache(), taps=drafter.taps).hidden
        same, worst = 0, 0.0
        rounds = replay(blocks, gen)
        for a, block, _ in rounds:
            spec = BlockSpeculator(head, drafter.taps, max_draft_tokens=k, min_draft_prob=0.0)
            pos = len(ids) + a  # the anchor's position: the ring holds every row before it
            spec.begin(seq[:pos], hidden[:pos])
            ours = spec.propose(DraftContext(seq[pos], pos, k, seq[: pos + 1], None, Sampler())).tokens
            same += ours == block
            if ours != block:  # where they part: tsspec's probability for its own draft there
                i = common_prefix(ours, block)
                if i < len(spec.last_conf):
                    worst = max(worst, spec.last_conf[i])
        replayed = sum(r[2] for r in rounds)
        total_blocks += len(rounds)
        total_same += same
        table.add_row(w, pid, str(len(gen)), str(len(rounds)), f"{same}/{len(rounds)}",
                      f"{worst:.2f}" if same < len(rounds) else "-", f"{n_acc}/{n_draft}", f"{replayed}/{sum(len(r[1]) for r in rounds)}")
    console.print(table)
    console.print(f"llama.cpp loaded {drafter_path.name} and drafted {total_blocks} blocks; tsspec drafted "
                  f"{total_same} of them identically ({100.0 * total_same / max(1, total_blocks):.0f}%).")
    return 0 if total_blocks and total_same else 1


if __name__ == "__main__":
    sys.exit(main())
