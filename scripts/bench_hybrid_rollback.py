"""Paired measurement: fast rollback (per-row verify states) vs the copy/restore/replay path.

The copy path's re-run of the kept rows happens inside the next forward (``HybridCache.replay``), so
its cost shows in the verify and plain columns, not in rollback.

A random-weight qwen35-shaped hybrid trunk (3 of 4 layers GatedDeltaNet) is built in memory; both
paths decode the same prompt with the same scripted speculator (the plain continuation, corrupted
at a fixed draft index so every verify is a partial accept), alternating fast/fallback runs.
Outputs must be identical; the script prints per-run phase times from ``SpecStats.phase_ms``.

    python scripts/bench_hybrid_rollback.py [--d-model 1024 --layers 16 --tokens 48 --window 3 --keep 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tsspec.spec.plan import SpecPlan
from tsspec.models.base import ArchConfig, LayerSpec
from tsspec.models.gated_attention import AttnLayer
from tsspec.models.hybrid import GDNLayer, HybridModel, HybridSpec
from tsspec.sampling import Sampler, SamplingParams
from tsspec.spec.loop import decode
from tsspec.spec.protocols import Draft
from tsspec.spec.stats import SpecStats
from tsspec.weights import Linear


def random_trunk(d: int, n_layers: int, vocab: int, seed: int = 0) -> HybridModel:
    g = torch.Generator().manual_seed(seed)
    heads, kv, hd, ffn_dim = d // 128, max(1, d // 512), 128, 3 * d
    hy = HybridSpec(recurrent=[(i + 1) % 4 != 0 for i in range(n_layers)], conv_kernel=4,
                    n_k_heads=d // 128, n_v_heads=2 * d // 128, head_k_dim=128, head_v_dim=128, v_heads_tiled=True)
    cfg = ArchConfig(arch="qwen35", n_layers=n_layers, d_model=d, n_heads=heads, n_kv_heads=kv, head_dim=hd,
                     ffn_dim=ffn_dim, vocab_size=vocab, train_ctx=4096, rms_eps=1e-6, rope_dim=hd // 4,
                     rope_neox=True, layers=[LayerSpec(1e7) for _ in range(n_layers)], qk_norm=True,
                     extra={"hybrid": hy})

    def lin(o, i):
        return Linear(torch.randn(o, i, generator=g) / i**0.5)

    def norm(n):
        return 1 + 0.1 * torch.randn(n, generator=g)

    layers = []
    for rec in hy.recurrent:
        common = dict(attn_norm=norm(d), post_norm=norm(d), gate_up=lin(2 * ffn_dim, d), down=lin(d, ffn_dim))
        if rec:
            nv = hy.n_v_heads
            layers.append(GDNLayer(in_proj=lin(hy.conv_dim + hy.value_dim + 2 * nv, d),
                                   conv_w=0.5 * torch.randn(hy.conv_dim, 4, generator=g),
                                   ssm_a=-torch.empty(nv).uniform_(0.5, 8, generator=g),
                                   dt_bias=0.5 * torch.randn(nv, generator=g), ssm_norm=norm(hy.head_v_dim),
                                   out=lin(d, hy.value_dim), **common))
        else:
            layers.append(AttnLayer(qkv=lin(2 * heads * hd + 2 * kv * hd, d), o=lin(d, heads * hd),
                                    q_norm=norm(hd), k_norm=norm(hd), **common))
    embed = torch.randn(vocab, d, generator=g).to(torch.bfloat16)
    return HybridModel(cfg, layers, embed, norm(d), lin(vocab, d), n_ctx=4096)


class Scripted:
    """Drafts the reference continuation, wrong from draft index ``keep`` on (a partial accept)."""

    name = "scripted"
    default_min_draft_prob = min_draft_prob = 0.0
    needs_hidden_state = False
    can_arm_after_prefix_reuse = True
    default_accept_rule = "match"
    taps = ()

    def __init__(self, ref, n0, keep, k, vocab):
        self.ref, self.n0, self.keep, self.max_draft_tokens, self.vocab = ref, n0, keep, k, vocab

    def begin(self, prompt, hidden):
        pass

    def propose(self, ctx):
        i = len(ctx.history) - self.n0
        toks = [int(t) for t in self.ref[i : i + min(ctx.max_tokens, self.max_draft_tokens)]]
        return Draft([t if j < self.keep else (t + 1) % self.vocab for j, t in enumerate(toks)])

    def commit(self, tokens, hidden, start_pos):
        pass

    def reset(self):
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--window", type=int, default=3)
    ap.add_argument("--keep", type=int, default=1, help="draft tokens accepted per verify")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    m = random_trunk(a.d_model, a.layers, a.vocab)
    n_gdn = len(m.gdn_index)
    print(f"trunk: d_model {a.d_model}, {a.layers} layers ({n_gdn} GatedDeltaNet), vocab {a.vocab}, "
          f"{m.weight_bytes() / 2**20:.0f} MiB bf16, built in {time.perf_counter() - t0:.1f}s; "
          f"torch threads {torch.get_num_threads()}")
    print(f"recurrent state {m.state_bytes() / 2**20:.1f} MiB; per verify row {m.per_row_state_bytes() / 2**20:.1f} MiB; "
          f"rollback_state_bytes(window={a.window}) = {m.rollback_state_bytes(a.window) / 2**20:.1f} MiB "
          f"(window 8: {m.rollback_state_bytes(8) / 2**20:.1f} MiB)")
    prompt = [int(x) for x in torch.randint(0, a.vocab, (a.prompt,), generator=torch.Generator().manual_seed(1))]
    sampler = Sampler(SamplingParams())
    m.verify_snapshots = True
    ref = decode(m, sampler, prompt, a.tokens)
    rows = {True: [], False: []}
    for _ in range(a.pairs):
        for fast in (True, False):
            m.verify_snapshots = fast
            st = SpecStats()
            out = decode(m, sampler, prompt, a.tokens, SpecPlan(Scripted(ref, len(prompt), a.keep, a.window, a.vocab), window=a.window), stats=st)
            assert out == ref, "speculative output differs from plain"
            rows[fast].append(st)
    print(f"\n{a.tokens} tokens, window {a.window}, {a.keep} of {a.window} drafts accepted per verify, "
          f"{a.pairs} alternating pairs (median per path); output identical to plain in every run")
    print(f"{'path':<26}{'tok/s':>8}{'verify ms':>11}{'plain ms':>10}{'rollback ms':>13}{'verifies':>10}")
    for fast in (True, False):
        sts = rows[fast]
        med = lambda f: statistics.median(f(s) for s in sts)  # noqa: E731
        name = "fast rollback" if fast else "TS_Q35_VERIFY_SNAPSHOTS=0"
        print(f"{name:<26}{med(lambda s: s.decode_tok_s):>8.2f}{med(lambda s: s.phase_ms['verify']):>11.0f}"
              f"{med(lambda s: s.phase_ms['plain']):>10.0f}{med(lambda s: s.phase_ms['rollback']):>13.1f}"
              f"{sts[0].verify_calls:>10}")


if __name__ == "__main__":
    main()
