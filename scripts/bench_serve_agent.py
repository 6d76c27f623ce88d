#!/usr/bin/env python3
"""Aggregate throughput of ``tsspec serve`` on the agent workload: suffix against n-gram, 4 clients.

    python scripts/bench_serve_agent.py [-m qwen2.5-coder-0.5b] [--clients 4] [--rounds 3]
        [--tokens 96] [--threads 2] [--slots 4] [--specs ngram,suffix] [--json FILE]

The agent workload (``tsspec bench -w agent``: one tool-routing instruction, then requests that
each want a JSON tool call about a different input) is what a server sees from an agent loop: what
repeats is across requests, which the suffix speculator's store carries and per-sequence n-gram
cannot. Each round starts one fresh server per speculator (``serve --spec --spec-type NAME``; a
fresh store, so no round drafts from another's answers) and sends it the workload's requests as
chat completions from ``--clients`` threads that take the next request in order from one queue
(greedy). A side's figure is the completion tokens of all responses over the wall time from the
first request sent to the last answer read. The sides run paired and interleaved (round r in one
order, round r+1 in the other); the report gives each round's figures, the ratio of each side to
the first, and the median of those ratios over rounds.

Exactness, checked every round: every response of every side equals the same request's text from
a plain server (no speculation) asked one request at a time; the script exits 1 where one differs.
Run it on a quiet machine: it prints what it measured and nothing it did not.
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve_concurrency import free_port, request, server_bench_parser, start_server, timed_clients  # noqa: E402

import http.client  # noqa: E402

from tsspec.bench.workloads import get_workload  # noqa: E402


def chat(port: int, text: str, tokens: int) -> dict:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": tokens, "temperature": 0}
    return request(port, body, route="/v1/chat/completions")


def metric(port: int, name: str) -> float | None:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        c.request("GET", "/metrics")
        for line in c.getresponse().read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return None
    finally:
        c.close()


def serving(args: argparse.Namespace, spec: str | None):
    """A fresh server for ``spec`` (None: plain), ``--parallel`` = the clients."""
    ns = argparse.Namespace(**vars(args))
    ns.spec = spec
    port = free_port()
    return start_server(ns, port), port


def stop(p) -> None:
    p.terminate()
    try:
        p.wait(30)
    except Exception:  # noqa: BLE001
        p.kill()


def run_side(port: int, texts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """The requests in order from one queue, ``args.clients`` threads; -> answers, tokens, seconds."""
    todo: queue.Queue = queue.Queue()
    for i, t in enumerate(texts):
        todo.put((i, t))
    answers: list[Any] = [None] * len(texts)
    tokens = [0] * len(texts)
    spec = {"drafted_tokens": 0, "accepted_tokens": 0, "verify_calls": 0}
    errors: list[str] = []

    def client() -> None:
        while True:
            try:
                i, t = todo.get_nowait()
            except queue.Empty:
                return
            try:
                body = chat(port, t, args.tokens)
                answers[i] = body["choices"][0]["message"]["content"]
                tokens[i] = body["usage"]["completion_tokens"]
                for k in spec:
                    spec[k] += body["tsspec"][k]
            except Exception as e:  # noqa: BLE001 - reported, and the side is void
                errors.append(f"{type(e).__name__}: {e}")

    dt = timed_clients([client] * args.clients, errors)
    return {"answers": answers, "tokens": sum(tokens), "seconds": dt, "tok_s": sum(tokens) / dt, **spec}


def parse_args(argv=None) -> argparse.Namespace:
    ap = server_bench_parser(__doc__, "concurrent clients")
    ap.add_argument("--tokens", type=int, default=96, help="max_tokens per request (default 96)")
    ap.add_argument("--threads", type=int, default=2, help="each server's threads (default 2)")
    ap.add_argument("--slots", type=int, default=4, help="each server's kept caches (default 4, serve's own): "
                    "the requests share the instruction, which a kept cache spares them forwarding again")
    ap.add_argument("--specs", default="ngram,suffix", help="speculators compared, the first the baseline "
                    "(default ngram,suffix; plain: a server that does not speculate)")
    ap.add_argument("--start-timeout", type=float, default=600, help="seconds to wait for a server")
    ap.add_argument("--json", metavar="OUT", help="write every side's figures here")
    args = ap.parse_args(argv)
    args.spec_list = [s.strip() for s in args.specs.split(",") if s.strip()]
    if args.clients < 1 or args.rounds < 1 or args.tokens < 1 or len(args.spec_list) < 2:
        ap.error("--clients, --rounds and --tokens must be >= 1, and --specs must name two or more")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    texts = [p.text for p in get_workload("agent").prompts]
    p, port = serving(args, None)
    try:
        want = [chat(port, t, args.tokens)["choices"][0]["message"]["content"] for t in texts]
    finally:
        stop(p)
    rounds = []
    same = True
    for r in range(args.rounds):
        order = args.spec_list if r % 2 == 0 else list(reversed(args.spec_list))
        sides = {}
        for spec in order:
            p, port = serving(args, None if spec == "plain" else spec)
            try:
                chat(port, "warm up", 4)  # the first forward's one-off costs; its answer feeds a store too
                sides[spec] = run_side(port, texts, args)
                sides[spec]["suffix_hits"] = metric(port, "tsspec_suffix_hits_total")
                sides[spec]["suffix_lookups"] = metric(port, "tsspec_suffix_lookups_total")
            finally:
                stop(p)
            differ = [i for i, (a, b) in enumerate(zip(sides[spec]["answers"], want)) if a != b]
            if differ:
                same = False
                print(f"round {r + 1}: {spec}: {len(differ)} answers differ from plain, first request {differ[0] + 1}")
        base = sides[args.spec_list[0]]["tok_s"]
        ratios = {s: sides[s]["tok_s"] / base for s in args.spec_list[1:]}
        rounds.append({"round": r, "order": order, "sides": {s: {k: v for k, v in d.items() if k != "answers"}
                                                             for s, d in sides.items()}, "ratios": ratios})
        figures = ", ".join(f"{s} {sides[s]['tok_s']:.2f} tok/s ({sides[s]['seconds']:.1f} s, "
                            f"{sides[s]['accepted_tokens']}/{sides[s]['drafted_tokens']} accepted in "
                            f"{sides[s]['verify_calls']} verifies)" for s in args.spec_list)
        print(f"round {r + 1}/{args.rounds} ({' then '.join(order)}): {figures}; "
              + ", ".join(f"{s}/{args.spec_list[0]} {x:.3f}" for s, x in ratios.items()), flush=True)
    for s in args.spec_list[1:]:
        xs = [x["ratios"][s] for x in rounds]
        print(f"{s} / {args.spec_list[0]} aggregate tok/s: median {statistics.median(xs):.3f}, range "
              f"{min(xs):.3f}-{max(xs):.3f} over {len(xs)} round(s) ({args.model}, {args.clients} clients, "
              f"{len(texts)} agent requests, {args.threads} threads)")
    print(f"every answer == the plain server's: {'yes' if same else 'NO'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": {k: v for k, v in vars(args).items()}, "rounds": rounds,
                                               "identical": same}, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
