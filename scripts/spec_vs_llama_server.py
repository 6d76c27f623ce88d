"""tsspec's n-gram speculation beside llama.cpp's own, on the same rendered prompts and budgets.

    python scripts/spec_vs_llama_server.py [-m smollm2-135m] [-w grounded] [-n 48] [--reps 2]
        [--spec-type ngram-simple] [--llama-bin DIR] [--json OUT]

Starts two llama-server processes from the peer build (`../shared/tools/build_llamacpp.sh`) on
loopback ports, one plain and one with ``--spec-type`` (default ngram-simple), each with 2 threads and
greedy sampling, and loads the tsspec trunk once. For every prompt of the workload (rendered through
the file's chat template exactly as ``tsspec bench --chat`` encodes it) and every repetition it runs,
in rotating order, tsspec plain, tsspec ``ngram`` (its defaults: window 8, governor on), llama.cpp
plain and llama.cpp speculative, each generating ``-n`` tokens with end-of-sequence ignored.

Reported per engine: decode tok/s (llama.cpp's own ``timings.predicted_per_second``; tsspec's
decode timer), the speculative/plain ratio as a geometric mean over prompts with a prompt-level
bootstrap interval (``tsspec.bench.stats``), and how many speculative texts equal the same engine's
plain text. The two servers idle while tsspec runs and vice versa; only one thing runs at a time.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tsspec.bench import provenance, stats
from tsspec.bench.llama_server import complete, llama_tool
from tsspec.bench.workloads import get_workload


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(exe: Path, model: Path, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    argv = [str(exe), "-m", str(model), "-t", "2", "-tb", "2", "--host", "127.0.0.1", "--port", str(port),
            "-c", "4096", "--temp", "0", "-np", "1", *extra]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            raise SystemExit(f"llama-server exited at start: {' '.join(argv)}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("llama-server did not become healthy in 300 s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("-w", "--workload", default="grounded")
    ap.add_argument("-n", "--max-tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--spec-type", default="ngram-simple")
    ap.add_argument("--llama-bin", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch

    from tsspec.cli import build_speculation, load_session, prompt_encoder
    from tsspec.generate import Engine
    from tsspec.options import SpecOptions
    from tsspec.sampling import Sampler

    torch.set_num_threads(2)
    exe = llama_tool("llama-server", args.llama_bin)
    g, target, tok = load_session(args.model, weights=None, ctx_size=4096, progress=False)
    encode = prompt_encoder(g, tok, chat=True, system=None, kwargs={})
    spec, gov, window, accept, _ = build_speculation(SpecOptions(enabled=True, type="ngram"), target)
    engines = {"tsspec plain": Engine(target, tok),
               "tsspec ngram": Engine(target, tok, speculator=spec, governor=gov, window=window, accept_rule=accept)}
    servers = {"llama.cpp plain": start_server(exe, g.path, []),
               f"llama.cpp {args.spec_type}": start_server(exe, g.path, ["--spec-type", args.spec_type])}
    names = [*engines, *servers]
    wl = get_workload(args.workload)
    tok_s: dict[str, list[float]] = {n: [] for n in names}
    texts: dict[tuple[str, str], str] = {}
    groups: list[str] = []
    try:
        for name, (_, url) in servers.items():  # warm-up
            complete(url, tok.decode(encode(wl.prompts[0].text), skip_special=False), 8, ignore_eos=True)
        for e in engines.values():
            e.generate(encode(wl.prompts[0].text), sampler=Sampler(), max_tokens=8, ignore_eos=True)
        for rep in range(args.reps):
            for i, p in enumerate(wl.prompts):
                ids = encode(p.text)
                rendered = tok.decode(ids, skip_special=False)
                order = names[(i + rep) % len(names):] + names[:(i + rep) % len(names)]
                for n in order:
                    if n in engines:
                        r = engines[n].generate(ids, sampler=Sampler(), max_tokens=args.max_tokens, ignore_eos=True)
                        tok_s[n].append(r.stats.decode_tok_s)
                        texts[(n, p.id)] = r.text
                    else:
                        r = complete(servers[n][1], rendered, args.max_tokens, ignore_eos=True)
                        tok_s[n].append(r["tok_s"])
                        texts[(n, p.id)] = r["text"]
                groups.append(p.id)
                print(f"rep {rep + 1} {p.id}: " + ", ".join(f"{n} {tok_s[n][-1]:.1f}" for n in names), flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
    out = {"provenance": {"git": provenance.git_state(), "machine": provenance.machine_info(),
                          "env": provenance.spec_env(), "command": sys.argv,
                          "weights": provenance.weight_formats(target)},
           "settings": vars(args), "tok_s": tok_s, "prompts": groups, "rows": []}
    print(f"\n{args.model}, workload {args.workload}: {len(wl.prompts)} prompts x {args.reps} reps, "
          f"{args.max_tokens} tokens, decode tok/s")
    for plain, specn in (("tsspec plain", "tsspec ngram"), ("llama.cpp plain", f"llama.cpp {args.spec_type}")):
        r = stats.paired_ratio(tok_s[specn], tok_s[plain], groups=groups)
        same = sum(texts[(specn, p.id)] == texts[(plain, p.id)] for p in wl.prompts)
        med = {n: sorted(tok_s[n])[len(tok_s[n]) // 2] for n in (plain, specn)}
        print(f"  {specn:26s} median {med[specn]:7.1f} (plain {med[plain]:7.1f})  ratio {r.estimate:.3f} "
              f"[{r.ci_low:.3f}, {r.ci_high:.3f}]  text equal to its plain: {same}/{len(wl.prompts)}")
        out["rows"].append({"spec": specn, "plain": plain, "median_tok_s": med[specn], "plain_median_tok_s": med[plain],
                            "ratio": r.estimate, "ci": [r.ci_low, r.ci_high], "identical": same,
                            "prompts": len(wl.prompts)})
    ours, theirs = out["rows"]
    print(f"  tsspec ngram / llama.cpp {args.spec_type} (medians): {ours['median_tok_s'] / theirs['median_tok_s']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
