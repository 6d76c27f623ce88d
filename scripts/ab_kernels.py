#!/usr/bin/env python3
"""Paired speed of two builds of the native kernels (tsspec/kernels/*.c) in ONE process.

    python scripts/ab_kernels.py --base REV [--new REV] [--models smollm2-135m ...] [--rows 1,5]
                                 [--rounds 200] [--steps 8] [--context 64] [--no-head] [--prompt] [--json FILE]

Both sources are compiled with the flags tsspec uses and loaded side by side; one model is loaded
once and its fused blocks (plus the LM head, unless --no-head) are run through each build in turn,
``--steps`` forwards of r rows at a time after a ``--context``-token prompt (64; attention's
share grows with it), the order flipped every round. The machine's slow and
fast phases (minutes long on a shared host) then fall on both builds alike, which two processes
run one after the other (ab_revisions.py) cannot promise: a same-source pair reads 0.99-1.00 here
where process pairs wandered by +-10%. The report gives each build's median ms per forward and the
median and quartiles over rounds of the new/base ratio.

Before timing, both builds must give the same logits bit for bit (a kernel change is meant to move
no output bit; --allow-different times a deliberate numerics change anyway). The two sources must
share the C structures' layouts (tsq_sizeof_*): a change to those is compared with ab_revisions.py.
``--new`` defaults to the working tree's source.

``--prompt`` forwards the rows as prompt rows with the prompt routes on in both builds
(TSSPEC_PROMPT_TILES=1's products; needs AMX), for changes to the prefill's path.

``--amx`` pairs the AMX tiles against the VNNI products instead, in one build (``--new``'s source):
base is TSSPEC_AMX=0's path, new is every quantized product of the forward on the hardware tiles
(needs a CPU with AMX); the logits must be identical here too.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
KERNELS = "tsspec/kernels"


class ScriptError(Exception):
    pass


def source_at(rev: str | None) -> dict[str, bytes]:
    """The kernel sources (file name -> bytes: every .c and .h of tsspec/kernels; before the split,
    the one qgemm.c) at a git revision (None: the working tree)."""
    if rev is None:
        from tsspec import kernels

        return kernels.sources()
    r = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{rev}:{KERNELS}"], capture_output=True)
    names = [n for n in r.stdout.decode().split() if n.endswith((".c", ".h"))] if r.returncode == 0 else []
    if not names:
        why = r.stderr.decode().strip() or "no .c files there"
        raise ScriptError(f"no kernel sources ({KERNELS}/*.c) at {rev!r}: {why}")
    out = {}
    for n in names:
        f = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{KERNELS}/{n}"], capture_output=True)
        if f.returncode != 0:
            raise ScriptError(f"cannot read {KERNELS}/{n} at {rev!r}: {f.stderr.decode().strip()}")
        out[n] = f.stdout
    return out


def build(src: dict[str, bytes]) -> ctypes.CDLL:
    """``src`` built and cached as tsspec builds its own kernels, loaded, its functions declared as
    tsspec declares them."""
    from tsspec import kernels

    cc = kernels._compiler()
    if cc is None:
        raise ScriptError("no C compiler")
    try:
        lib = ctypes.CDLL(str(kernels._build(cc, src)))
        kernels._check_layouts(lib)
    except RuntimeError as e:  # a compile error, or C structures that differ from this tree's
        raise ScriptError(f"{e} (a change to the C structures is compared with ab_revisions.py)") from None
    try:
        kernels._declare(lib)
    except AttributeError:
        pass  # an older source lacks a later function; the ones timed here are declared first
    return lib


class Stepper:
    """One model's fused forward of r rows (and its head) through a given build."""

    def __init__(self, model: str, rows: int, head: bool, threads: int, steps: int = 16, context: int = 64,
                 prompt: bool = False):
        import torch

        from tsspec.hub import resolve_model
        from tsspec.models import load_model

        torch.set_num_threads(threads)
        self.t = t = load_model(resolve_model(model))
        if t.fused is None:
            raise ScriptError(f"{model}: no fused native path on this machine (kernels off or unsupported weights)")
        self.rows, self.head, self.threads, self.prompt = rows, head, threads, prompt
        self.cache = t.make_cache()
        self.context = context
        t.forward(list(range(100, 100 + self.context)), self.cache)
        self.cache.reserve(self.context + steps * rows)  # each round's steps go to new positions
        cos, sin = t.rope_lists()
        self._keep = (cos, sin)
        self.cos_p = (ctypes.c_void_p * len(cos))(*[x.data_ptr() for x in cos])
        self.sin_p = (ctypes.c_void_p * len(sin))(*[x.data_ptr() for x in sin])
        self.h0 = t._token_rows(list(range(5, 5 + rows))).contiguous()
        from tsspec import kernels

        self.head_c = kernels.c_linear(t.lm_head) if head else None
        if head and self.head_c is None:
            raise ScriptError(f"{model}: its head is not on the native path; use --no-head")
        self.norm = t.out_norm.float().contiguous()

    def step(self, lib: ctypes.CDLL, pos: int):
        import torch

        t, c, fb = self.t, self.cache, self.t.fused
        h = self.h0.clone()
        args = (ctypes.byref(fb.config), fb.layers, 0, t.n_layers, h.data_ptr(), self.rows, pos, c.k.data_ptr(),
                c.v.data_ptr(), c.k.shape[2], self.cos_p, self.sin_p, self.threads)
        rc = lib.tsq_forward_prompt(*args, 1) if self.prompt else lib.tsq_forward(*args)
        if rc:
            raise ScriptError(f"tsq_forward returned {rc}")
        if not self.head:
            return h
        # the head as every build can run it: norm in torch, then the product
        from tsspec.models.base import rms_norm

        x = rms_norm(h, self.norm, t.cfg.rms_eps).contiguous()
        xq = torch.empty(self.rows * lib.tsq_xrow_bytes(x.shape[1]), dtype=torch.uint8)
        y = torch.empty(self.rows, self.head_c.n_total)
        col = 0
        hc = self.head_c
        for i in range(hc.nparts):
            if i == 0:
                lib.tsq_quantize(x.data_ptr(), self.rows, x.shape[1], xq.data_ptr())
            rc = lib.tsq_matmul(hc.type[i], hc.w[i], hc.packed[i], hc.row_bytes[i], hc.n[i], hc.k, x.data_ptr(),
                                xq.data_ptr(), self.rows, y.data_ptr() + 4 * col, hc.n_total, self.threads, 1)
            if rc:
                raise ScriptError(f"tsq_matmul returned {rc}")
            col += hc.n[i]
        return y


def compare(model: str, rows: int, libs: list, rounds: int, steps: int, head: bool, threads: int,
            allow_different: bool, modes: tuple[int, int] | None = None, context: int = 64,
            prompt: bool = False) -> dict:
    """``modes``: the tile mode (tsq_amx_use) each side runs under, where both sides are one build.
    ``prompt``: the rows go as prompt rows, the prompt routes on in both builds (tsq_sb_use)."""
    import torch

    st = Stepper(model, rows, head, threads, steps, context, prompt)
    if prompt:
        for lib in libs:
            if lib.tsq_sb_use(1):
                raise ScriptError("--prompt needs the prompt routes' tiles (AMX, the AVX-512 level with VBMI)")

    def side(j: int):
        if modes is not None:
            libs[j].tsq_amx_use(modes[j], 1)
        return libs[j]

    outs = [st.step(side(j), st.context) for j in (0, 1)]
    same = torch.equal(outs[0], outs[1])
    if not same and not allow_different:
        raise ScriptError(f"{model}, {rows} rows: the builds' outputs differ (--allow-different to time them anyway)")
    ms: list[list[float]] = [[], []]
    for i in range(rounds):
        for j in ((0, 1) if i % 2 == 0 else (1, 0)):
            t0 = time.perf_counter()
            lib = side(j)
            for s in range(steps):
                st.step(lib, st.context + s * rows)
            ms[j].append((time.perf_counter() - t0) * 1000 / steps)
    ratios = sorted(n / b for b, n in zip(ms[0], ms[1]))
    q = statistics.quantiles(ratios, n=4)
    if prompt:
        for lib in libs:
            lib.tsq_sb_use(0)
    return {"model": model, "rows": rows, "context": context, "head": head, "prompt": prompt, "identical": same,
            "rounds": rounds, "steps": steps,
            "base_ms": statistics.median(ms[0]), "new_ms": statistics.median(ms[1]),
            "ratio": statistics.median(ratios), "ratio_q1": q[0], "ratio_q3": q[2]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", help="git revision of the base source (not with --amx)")
    ap.add_argument("--amx", action="store_true", help="VNNI (base) against the AMX tiles (new), one build")
    ap.add_argument("--new", help="git revision of the new source (default: the working tree)")
    ap.add_argument("--models", nargs="+", default=["smollm2-135m"], help="catalogue names or GGUF paths")
    ap.add_argument("--rows", default="1", help="rows per forward, e.g. 1,5,9 (decode, verify)")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--steps", type=int, default=8, help="forwards per build per round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=64, help="cached tokens before the timed forwards")
    ap.add_argument("--no-head", action="store_true", help="time the blocks alone")
    ap.add_argument("--allow-different", action="store_true", help="time builds whose outputs differ")
    ap.add_argument("--prompt", action="store_true",
                    help="forward the rows as prompt rows with the prompt routes on the tiles (TSSPEC_PROMPT_TILES=1)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    try:
        rows = [int(r) for r in args.rows.split(",") if r.strip()]
        if not rows or min(rows) < 1 or args.rounds < 4 or args.steps < 1 or args.threads < 1 or args.context < 1:
            raise ScriptError("--rows must be positive integers, --rounds at least 4, --steps, --threads and --context at least 1")
        if args.amx == (args.base is not None):
            raise ScriptError("give --base REV, or --amx (the tiles against VNNI in one build), not both")
        modes = None
        if args.amx:
            from tsspec import kernels

            lib = build(source_at(args.new))
            if lib.tsq_isa() != kernels.LEVELS["avx512"].isa or lib.tsq_amx_init() != 0:
                raise ScriptError("--amx needs the AVX-512 level and AMX tiles this process may use")
            libs, modes = [lib, lib], (0, 1)
        else:
            libs = [build(source_at(args.base)), build(source_at(args.new))]
        results = []
        for model in args.models:
            for r in rows:
                res = compare(model, r, libs, args.rounds, args.steps, not args.no_head, args.threads,
                              args.allow_different, modes, args.context, args.prompt)
                results.append(res)
                print(f"{model} rows={r} context={args.context}{'' if res['head'] else ' (blocks)'}"
                      f"{' (prompt rows)' if args.prompt else ''}: base {res['base_ms']:.3f} ms, "
                      f"new {res['new_ms']:.3f} ms, new/base {res['ratio']:.3f} "
                      f"(quartiles {res['ratio_q1']:.3f}-{res['ratio_q3']:.3f}, {res['rounds']} rounds)"
                      f"{'' if res['identical'] else '  [outputs differ]'}", flush=True)
    except ScriptError as e:
        sys.exit(f"ab_kernels: {e}")
    if args.json:
        args.json.write_text(json.dumps({"base": "VNNI" if args.amx else args.base,
                                         "new": ("AMX tiles, " if args.amx else "") + (args.new or "working tree"),
                                         "results": results},
                                        indent=1) + "\n")


if __name__ == "__main__":
    main()
