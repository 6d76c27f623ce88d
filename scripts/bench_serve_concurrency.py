#!/usr/bin/env python3
"""Aggregate decode throughput of a real ``tsspec serve`` with 1 and with N concurrent clients.

    python scripts/bench_serve_concurrency.py [-m qwen2.5-coder-0.5b] [--clients 4] [--rounds 3]
        [--requests 2] [--tokens 64] [--threads 2] [--spec ngram] [--json FILE]

One server process (``--parallel`` = the largest client count) serves both sides. A side is
``c`` client threads, each sending ``--requests`` completions one after another (greedy, each its
own prompt); its figure is the completion tokens of all responses over the wall time from the
first request sent to the last response read. The sides run paired and interleaved: round r runs
1 then N clients, round r+1 N then 1, so drift on a shared machine hits both; each prompt starts
with a tag unique to its round and side, so no side is served from another's kept caches. The
report gives each round's two figures and their ratio (N clients / 1 client), then the median and
geometric mean of the ratios.

After the rounds, one check: the first N prompts sent alone and then all at once must give the
same texts (the server's batch invariance); the script exits 1 if they do not. Run it on a quiet
machine; it prints what it measured and nothing it did not.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TOPICS = ["a binary search in Python", "how a hash map handles collisions", "the rules of chess castling",
          "a SQL query that finds duplicate emails", "why the sky is blue", "a bash loop over files",
          "the difference between TCP and UDP", "a Rust function that reverses a string"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(port: int, body: dict, timeout: float = 600, route: str = "/v1/completions") -> dict:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("POST", route, body=json.dumps(body).encode(),
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        data = json.loads(r.read())
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {data}")
        return data
    finally:
        c.close()


def start_server(args: argparse.Namespace, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tsspec", "serve", "-m", args.model, "--port", str(port),
           "--parallel", str(args.clients), "--slots", str(getattr(args, "slots", 1)), "-t", str(args.threads)]
    if args.spec:
        cmd += ["--spec", "--spec-type", args.spec]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TS_SPEC_", "TS_MTP_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE)
    deadline = time.time() + args.start_timeout
    while True:
        if p.poll() is not None:
            raise SystemExit(f"the server exited: {p.stderr.read().decode()[-2000:]}")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return p
        except OSError:
            pass
        if time.time() > deadline:
            p.kill()
            raise SystemExit("the server did not come up")
        time.sleep(0.25)


def prompt(tag: str, i: int) -> str:
    return f"Note {tag}-{i}. The following is a long, detailed explanation of {TOPICS[i % len(TOPICS)]}, for a beginner. First,"


def run_side(port: int, clients: int, tag: str, args: argparse.Namespace) -> dict[str, Any]:
    """``clients`` threads, ``args.requests`` requests each; -> tokens, seconds, tok/s."""
    tokens = [0] * clients
    errors: list[str] = []

    def client(c: int) -> None:
        for k in range(args.requests):
            try:
                body = request(port, {"prompt": prompt(tag, c * args.requests + k), "max_tokens": args.tokens,
                                      "temperature": 0})
                tokens[c] += body["usage"]["completion_tokens"]
            except Exception as e:  # noqa: BLE001 - reported, and the side is void
                errors.append(f"{type(e).__name__}: {e}")

    dt = timed_clients([lambda c=c: client(c) for c in range(clients)], errors)
    return {"clients": clients, "tokens": sum(tokens), "seconds": dt, "tok_s": sum(tokens) / dt}


def timed_clients(clients: list, errors: list[str]) -> float:
    """Run each of ``clients`` (callables) on its own thread at once; -> seconds from the first start
    to the last end. Exits when any of them put an error in ``errors`` (the side is void)."""
    threads = [threading.Thread(target=c) for c in clients]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    if errors:
        raise SystemExit(f"{len(errors)} requests failed, e.g. {errors[0]}")
    return dt


def identical_check(port: int, args: argparse.Namespace) -> bool:
    """The first ``clients`` prompts alone, then all at once: the same texts."""
    bodies = [{"prompt": prompt("check", i), "max_tokens": args.tokens, "temperature": 0.8, "seed": 7 + i}
              for i in range(args.clients)]
    alone = [request(port, b)["choices"][0]["text"] for b in bodies]
    together: list[Any] = [None] * len(bodies)

    def one(i: int) -> None:
        together[i] = request(port, bodies[i])["choices"][0]["text"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return alone == together


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def server_bench_parser(doc: str | None, clients_help: str) -> argparse.ArgumentParser:
    """The options every serve bench shares: the model, the clients and the rounds."""
    ap = argparse.ArgumentParser(description=(doc or "").splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=doc)
    ap.add_argument("-m", "--model", default="qwen2.5-coder-0.5b", help="known model name or GGUF path")
    ap.add_argument("--clients", type=int, default=4, help=f"{clients_help} (default 4)")
    ap.add_argument("--rounds", type=int, default=3, help="paired, interleaved rounds (default 3)")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    ap = server_bench_parser(__doc__, "concurrent clients of the second side")
    ap.add_argument("--requests", type=int, default=2, help="requests per client per side (default 2)")
    ap.add_argument("--tokens", type=int, default=64, help="max_tokens per request (default 64)")
    ap.add_argument("--threads", type=int, default=2, help="the server's threads (default 2)")
    ap.add_argument("--spec", default=None, help="serve with --spec --spec-type NAME (default: plain)")
    ap.add_argument("--start-timeout", type=float, default=600, help="seconds to wait for the server")
    ap.add_argument("--json", metavar="OUT", help="write every side's figures here")
    args = ap.parse_args(argv)
    if args.clients < 2 or args.rounds < 1 or args.requests < 1 or args.tokens < 1:
        ap.error("--clients must be >= 2; --rounds, --requests and --tokens >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    port = free_port()
    server = start_server(args, port)
    try:
        request(port, {"prompt": "warm up", "max_tokens": 4, "temperature": 0})
        rounds = []
        for r in range(args.rounds):
            order = (1, args.clients) if r % 2 == 0 else (args.clients, 1)
            sides = {c: run_side(port, c, f"r{r}c{c}", args) for c in order}
            one, many = sides[1], sides[args.clients]
            if not one["tokens"] or not many["tokens"]:
                raise SystemExit("a side generated no tokens (every reply ended at once): change the prompts")
            ratio = many["tok_s"] / one["tok_s"]
            rounds.append({"round": r, "order": list(order), "one": one, "many": many, "ratio": ratio})
            print(f"round {r + 1}/{args.rounds} ({' then '.join(map(str, order))} clients): "
                  f"1 client {one['tok_s']:.2f} tok/s, {args.clients} clients {many['tok_s']:.2f} tok/s, "
                  f"ratio {ratio:.3f}", flush=True)
        ratios = [x["ratio"] for x in rounds]
        same = identical_check(port, args)
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    print(f"{args.clients} clients / 1 client aggregate tok/s: median {statistics.median(ratios):.3f}, "
          f"geometric mean {geomean(ratios):.3f}, range {min(ratios):.3f}-{max(ratios):.3f} "
          f"over {len(ratios)} round(s) ({args.model}, {args.spec or 'plain'}, {args.tokens} tokens, "
          f"{args.threads} threads)")
    print(f"texts alone == texts among {args.clients} concurrent: {'yes' if same else 'NO'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rounds": rounds, "identical": same}, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
