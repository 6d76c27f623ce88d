"""A trained draft head's native step against its torch step, and both against plain decoding.

    python scripts/ab_draft_head.py HEAD.gguf [-m smollm2-135m] [--rounds 2] [--pmin P] [--no-governor]

One process, one loaded trunk, three engines over the same trunk: plain, the ``draft-head``
speculator on the file with its native step (``tsq_eagle_step``), and the same file with
``head.native = None`` (the torch reference, ``head_step``). For every chat prompt of the built-in
``code`` and ``prose`` workloads and every round, the three run greedy (64 tokens) in an order
shuffled per prompt; each speculative text must equal the plain text (the script stops if not).
Printed per workload: the median decode-speed ratio to plain of each speculative engine (quartiles
over prompts and rounds), drafted and accepted tokens, the per-verify phase times, and the median
paired ratio native / torch. ``--no-governor`` drafts on every step the gate allows (the cost of
drafting itself, which the governor otherwise hides by parking).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("head", help="a tsspec-eagle GGUF (tsspec distill --kind head)")
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("-n", "--tokens", type=int, default=64)
    ap.add_argument("--pmin", type=float, default=None, help="the gate (default: the head's own)")
    ap.add_argument("--no-governor", action="store_true")
    a = ap.parse_args()

    from tsspec.bench.workloads import get_workload
    from tsspec.cli import prompt_encoder
    from tsspec.errors import TsspecError
    from tsspec.options import SpecOptions
    from tsspec.sampling import Sampler, SamplingParams
    from tsspec.session import Session
    from tsspec.settings import RunConfig

    try:
        s = Session.open(RunConfig(model=a.model), progress=False)
        enc = prompt_encoder(s.gguf, s.tokenizer, chat=True, system=None, kwargs={})
        opts = SpecOptions(enabled=True, type="draft-head", draft=8, pmin=a.pmin, draft_model=a.head,
                           adaptive=not a.no_governor)
        native, torch_ref = s.speculation(opts), s.speculation(opts)
    except TsspecError as e:
        sys.exit(f"ab_draft_head: {e}")
    if native.plan.speculator.head.native is None:
        sys.exit("ab_draft_head: this head has no native step here (matrices off the gguf backend, or no SIMD kernels)")
    torch_ref.plan.speculator.head.native = None
    engines = {"plain": s.engine(), "native": s.engine(native), "torch": s.engine(torch_ref)}
    spec = ("native", "torch")
    for wl in ("code", "prose"):
        prompts = [enc(p.text) for p in get_workload(wl).prompts]
        ratio = {k: [] for k in spec}
        counts = {k: [0, 0, 0, 0] for k in spec}  # drafted, accepted, verifies, plain steps
        phases: dict[tuple[str, str], float] = {}
        for r in range(a.rounds):
            for i, ids in enumerate(prompts):
                order = list(engines)
                random.Random(1000 * r + i).shuffle(order)
                speed, text = {}, {}
                for k in order:
                    res = engines[k].generate(ids, sampler=Sampler(SamplingParams()), max_tokens=a.tokens)
                    st = res.stats
                    speed[k], text[k] = st.decode_tok_s, list(res.token_ids)
                    if k in spec:
                        c = counts[k]
                        c[0] += st.drafted; c[1] += st.accepted; c[2] += st.verify_calls; c[3] += st.plain_steps
                        for ph, ms in st.phase_ms.items():
                            phases[(k, ph)] = phases.get((k, ph), 0.0) + ms
                for k in spec:
                    if text[k] != text["plain"]:
                        sys.exit(f"ab_draft_head: {k} text differs from plain on {wl} prompt {i}")
                    ratio[k].append(speed[k] / speed["plain"])
        for k in spec:
            q = statistics.quantiles(ratio[k], n=4)
            d, acc, nv, npl = counts[k]
            per = {ph: round(phases.get((k, ph), 0.0) / max(1, nv), 2) for ph in ("draft", "verify", "commit")}
            print(f"{wl} {k:6s}: ratio to plain {statistics.median(ratio[k]):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f}); "
                  f"drafted {d}, accepted {acc}; {nv} verifies, {npl} plain steps; ms per verify {per}", flush=True)
        paired = statistics.median(x / y for x, y in zip(ratio["native"], ratio["torch"]))
        print(f"{wl} native/torch paired median {paired:.3f}", flush=True)


if __name__ == "__main__":
    main()
