"""DFlash / DFlash2 block drafter and the block speculator, on tiny random-weight files.

What is shown here:

* speculative output equals plain output token for token (greedy and seeded sampling, DFlash and
  DFlash2, with drafts the trunk rejects and with drafts it partly accepts);
* passes A-C equal a plain step-by-step torch reference written below from the published
  architecture (float64, per head, per row), on the same weights, and the drafter's ring after a
  speculative run holds exactly what a one-shot injection of the whole history gives;
* ``dflash.logit_scale`` and ``dflash.final_logit_softcapping`` transform the logits (and the
  selector's unary term) as the reference does, and the scale changes the selector's walk;
* the selector's greedy walk equals a brute-force search over the same lattice, and differs from
  the maximum-total path only where transitions trade off;
* the conv never reads across a block boundary; a file without DFlash2's tensors runs as DFlash;
  TS_DFLASH_CONV=0 / TS_DFLASH_SELECTOR=0 switch each piece off; a drafter bound to another
  trunk, or with missing metadata, is refused with a reason naming the key.
"""

from __future__ import annotations

import itertools
import random
import math

import numpy as np
import pytest
import torch

from tiny import write_tiny_model
from tiny_dflash import write_tiny_dflash
from tsspec.spec.plan import SpecPlan
from tsspec.drafters import load_drafter
from tsspec.drafters.dflash import greedy_walk, grouped_dynamic_conv, selector_lattice
from tsspec.errors import BadInput, ModelFileError, TsspecError
from tsspec.gguf_file import GGUFFile
from tsspec.models import load_model
from tsspec.options import SpecOptions
from tsspec.sampling import Sampler, SamplingParams
from tsspec.session import Session
from tsspec.settings import resolve_run
from tsspec.spec.block import BlockSpeculator, gate_cumulative
from tsspec.spec.loop import decode
from tsspec.spec.protocols import DraftContext, DraftHeadKind, Speculator
from tsspec.spec.registry import REGISTRY
from tsspec.spec.stats import SpecStats

PROMPT = [(7 * i + 40) % 250 for i in range(30)]  # longer than the drafter's window of 12
N_TOKENS = 24
WINDOW = 12


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("dflash")
    trunk = write_tiny_model(d / "trunk.gguf", arch="qwen3", n_layers=4)
    return {
        "trunk": trunk,
        "dflash": write_tiny_dflash(d / "dflash.gguf", trunk),
        "dflash2": write_tiny_dflash(d / "dflash2.gguf", trunk, dflash2=True),
        "conv_only": write_tiny_dflash(d / "conv_only.gguf", trunk, conv=True, selector=False),
        "dir": d,
    }


def _load(files, which, fmt="f32"):
    target = load_model(files["trunk"], fmt=fmt)
    return target, load_drafter(files[which], target)


class Steer:
    """Wraps a block head: replaces the first j drafts of each block with the plain continuation,
    j cycling 0..block_size-1, so verifies accept some drafts and commit several rows at once."""

    def __init__(self, head, full):
        self.head, self.full = head, full
        self.kind, self.block_size = head.kind, head.block_size

    def new_state(self):
        return self.head.new_state()

    def walk_block(self, anchor, position, state, pick=None):
        tokens, conf = self.head.walk_block(anchor, position, state, pick)
        j = position % self.block_size
        for e in range(min(j, len(tokens))):
            if position + 1 + e < len(self.full):
                tokens[e] = self.full[position + 1 + e]
        return tokens, [1.0] * len(conf)

    def catch_up(self, tokens, hidden, start_pos, state):
        self.head.catch_up(tokens, hidden, start_pos, state)


# ----------------------------------------------------------------------------- loading


def test_loads_both_generations(files):
    for which, gen, conv, sel in (("dflash", 1, False, False), ("dflash2", 2, True, True),
                                  ("conv_only", 2, True, False)):
        target, dr = _load(files, which)
        assert dr.speculator_name == "block"
        assert dr.draft_head.kind is DraftHeadKind.BLOCK
        assert dr.model.generation == gen
        assert (dr.model.has_conv, dr.model.has_selector) == (conv, sel)
        assert dr.taps == (1, 3)
        assert dr.cfg.block_size == 5 and dr.model.new_state().rows == WINDOW


def test_registry_builds_the_block_speculator(files):
    target, dr = _load(files, "dflash2")
    spec = REGISTRY.create("block", target, SpecOptions(draft=16), dr)
    assert isinstance(spec, BlockSpeculator) and isinstance(spec, Speculator)
    assert spec.max_draft_tokens == 4  # clamped to block_size - 1
    assert spec.min_draft_prob == 0.35 == spec.default_min_draft_prob
    assert spec.taps == (1, 3) and spec.needs_hidden_state and spec.can_arm_after_prefix_reuse
    assert spec.default_accept_rule == "match" and not spec.sample_drafts
    assert isinstance(REGISTRY.create("auto", target, SpecOptions(), dr), BlockSpeculator)
    assert REGISTRY.create("block", target, SpecOptions(accept="residual", pmin=0.1), dr).sample_drafts
    # the registry declines politely without a drafter
    spec, why = REGISTRY.try_create("block", target, SpecOptions(), None)
    assert spec is None and "--draft-model" in why


def test_target_layer_ids_are_read_as_entering_indices(files):
    p = write_tiny_dflash(files["dir"] / "ids.gguf", files["trunk"], target_layers=None, target_layer_ids=[0, 2])
    target = load_model(files["trunk"], fmt="f32")
    assert load_drafter(p, target).taps == (1, 3)


def test_refuses_a_drafter_for_another_trunk(files, tmp_path):
    other = write_tiny_model(tmp_path / "narrow.gguf", arch="qwen3", n_layers=4, d_model=32)
    with pytest.raises(BadInput, match="fc.weight"):
        load_drafter(files["dflash"], load_model(other))
    shallow = write_tiny_model(tmp_path / "shallow.gguf", arch="qwen3", n_layers=2)
    with pytest.raises(BadInput, match="dflash.target_layers.*2 layers"):
        load_drafter(files["dflash"], load_model(shallow))
    # fc consistent with the trunk, but the drafter's own width is not the trunk's
    wide = write_tiny_dflash(tmp_path / "wide.gguf", files["trunk"], hidden=96)
    with pytest.raises(BadInput, match="dflash.embedding_length"):
        load_drafter(wide, load_model(files["trunk"]))
    # a speculator asked for a different trunk than the one bound declines with a reason
    target, dr = _load(files, "dflash")
    deep = load_model(write_tiny_model(tmp_path / "deep.gguf", arch="qwen3", n_layers=5))
    spec, why = REGISTRY.try_create("block", deep, SpecOptions(), dr)
    assert spec is None and "5" in why


@pytest.mark.parametrize("key", ["dflash.block_size", "dflash.mask_token_id", "dflash.target_layers",
                                 "dflash.embedding_length", "dflash.conv_kernel_size", "dflash.selector_rank"])
def test_refuses_missing_metadata(files, tmp_path, key):
    p = write_tiny_dflash(tmp_path / "bad.gguf", files["trunk"], dflash2=True, drop_keys=(key,))
    with pytest.raises(ModelFileError, match=key.split(".", 1)[1]):
        load_drafter(p, load_model(files["trunk"]))


def test_refuses_inconsistent_metadata(files, tmp_path):
    p = write_tiny_dflash(tmp_path / "g.gguf", files["trunk"], dflash2=True, conv_group=24)  # 64 % 24
    with pytest.raises(TsspecError, match="conv_group_size"):
        load_drafter(p, load_model(files["trunk"]))
    p = write_tiny_dflash(tmp_path / "b.gguf", files["trunk"], block_size=1)
    with pytest.raises(ModelFileError, match="block_size"):
        load_drafter(p, load_model(files["trunk"]))


# ----------------------------------------------------------------------------- output identity


def _plain(target, sampler):
    return decode(target, sampler, PROMPT, N_TOKENS)


@pytest.mark.parametrize("which", ["dflash", "dflash2"])
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.9, top_k=40, seed=11)],
                         ids=["greedy", "seeded"])
def test_speculative_output_equals_plain(files, which, params):
    target, dr = _load(files, which, fmt="bf16")
    sampler = Sampler(params)
    plain = _plain(target, sampler)
    # the drafter's own drafts (random weights: the trunk rejects them)
    spec = BlockSpeculator(dr.draft_head, dr.taps, 8, min_draft_prob=0.0)
    stats = SpecStats()
    assert decode(target, sampler, PROMPT, N_TOKENS, SpecPlan(spec, window=8), stats=stats) == plain
    assert stats.drafted > 0 and stats.verify_calls > 0
    # steered drafts: partial and full acceptance, multi-row commits, rewinds
    steer = BlockSpeculator(Steer(dr.draft_head, PROMPT + plain), dr.taps, 8, min_draft_prob=0.0)
    stats = SpecStats()
    assert decode(target, sampler, PROMPT, N_TOKENS, SpecPlan(steer, window=8), stats=stats) == plain
    assert 0 < stats.accepted < stats.drafted


def test_residual_rule_gets_draft_distributions(files):
    target, dr = _load(files, "dflash2", fmt="bf16")
    sampler = Sampler(SamplingParams(temperature=0.9, seed=3))
    spec = BlockSpeculator(dr.draft_head, dr.taps, 8, min_draft_prob=0.0, sample_drafts=True)
    seen = []
    original = spec.propose

    def propose(ctx):
        draft = original(ctx)
        seen.append(draft)
        return draft

    spec.propose = propose
    out = decode(target, sampler, PROMPT, N_TOKENS, SpecPlan(spec, window=8, accept_rule="residual"))
    assert len(out) == N_TOKENS and all(0 <= t < target.vocab_size for t in out)
    drafts = [d for d in seen if d.tokens]
    assert drafts
    for d in drafts:
        assert d.probs.shape == (len(d.tokens), target.vocab_size)
        assert torch.allclose(d.probs.sum(-1), torch.ones(len(d.tokens)), atol=1e-5)
        assert all(float(d.probs[i, t]) > 0 for i, t in enumerate(d.tokens))  # drawn from q
    # a residual run under greedy is a match run: identical to plain
    greedy = Sampler()
    spec = BlockSpeculator(dr.draft_head, dr.taps, 8, min_draft_prob=0.0, sample_drafts=True)
    assert decode(target, greedy, PROMPT, N_TOKENS, SpecPlan(spec, accept_rule="residual")) == _plain(target, greedy)


def test_cumulative_gate():
    assert gate_cumulative([0.9, 0.5, 0.9], 0.35) == 3  # 0.9, 0.45, 0.405
    assert gate_cumulative([0.9, 0.3, 1.0], 0.35) == 1  # 0.27 < 0.35 at the second
    assert gate_cumulative([0.2, 1.0], 0.35) == 0
    assert gate_cumulative([0.01] * 4, 0.0) == 4


def test_gate_and_window_in_propose(files):
    target, dr = _load(files, "dflash")
    hidden = target.forward(PROMPT[:-1], target.make_cache(), taps=dr.taps).hidden
    ctx = DraftContext(PROMPT[-1], len(PROMPT) - 1, 3, PROMPT)
    spec = BlockSpeculator(dr.draft_head, dr.taps, 8, min_draft_prob=0.0)
    spec.begin(PROMPT[:-1], hidden)
    assert len(spec.propose(ctx).tokens) == 3  # ctx.max_tokens bounds it
    _, conf = dr.draft_head.walk_block(PROMPT[-1], len(PROMPT) - 1, spec.state)
    for pmin in (0.0, 0.5 * conf[0], conf[0] * conf[1] * 0.999, 0.999):
        spec.min_draft_prob = pmin
        want = gate_cumulative(conf[:3], pmin)
        assert len(spec.propose(ctx).tokens) == want


# ----------------------------------------------------------------------------- reference passes


def _rms(x, w, eps=1e-6):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _rope_neox(x, pos, base):
    # x [rows, dim]; pairs (i, i + dim/2) rotated by pos * base^(-2i/dim)
    dim = x.shape[-1]
    inv = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    ang = pos.double()[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    rot = torch.cat([-x[:, dim // 2 :], x[:, : dim // 2]], -1)
    return x * cos + rot * sin


def _conv_ref(x, dyn, base, group):
    # y[r][c] = sum_{t <= r} (base[t][c] + dyn[r][t][c // group]) * x[r - t][c]
    rows, hidden = x.shape
    group_of = torch.arange(hidden) // group
    y = torch.zeros_like(x)
    for r in range(rows):
        for t in range(base.shape[0]):
            if r - t >= 0:
                y[r] += (base[t] + dyn[r, t][group_of]) * x[r - t]
    return y


def reference_block(path, trunk_path, feats, anchor, position, *, conv=True, selector=True):
    """Passes A-C of the published DFlash(2) architecture, step by step in float64.

    ``feats`` [P', T*D]: the tap rows of positions ``position - P'`` .. ``position - 1``.
    -> (h [B-1, H], logits [B-1, V], greedy-walk tokens or None).
    """
    g = GGUFFile(path)
    tg = GGUFFile(trunk_path)
    W = lambda n: torch.from_numpy(np.array(g.tensor(n))).double()  # noqa: E731
    m = g.metadata
    L, H = m["dflash.block_count"], m["dflash.embedding_length"]
    nh, nkv = m["dflash.attention.head_count"], m["dflash.attention.head_count_kv"]
    hd = m["dflash.attention.key_length"]
    B, mask, base = m["dflash.block_size"], m["dflash.mask_token_id"], m["dflash.rope.freq_base"]
    window = m.get("dflash.attention.sliding_window")
    embed = torch.from_numpy(np.array(tg.tensor("token_embd.weight"))).double()  # tied trunk: also its LM head

    # PASS A: the target feature, fused
    ctx = _rms(feats.double() @ W("fc.weight").T, W("enc.output_norm.weight"))  # [P', H]
    ctx_pos = torch.arange(position - ctx.shape[0], position)
    q_pos = torch.arange(position, position + B)
    x = embed[torch.tensor([anchor] + [mask] * (B - 1))]  # [B, H]
    use_conv = conv and g.has_tensor("blk.0.attn_conv_base")
    K = m.get("dflash.conv_kernel_size", 0)
    for i in range(L):
        p = f"blk.{i}."
        Wq, Wk, Wv, Wo = (W(p + f"attn_{n}.weight") for n in ("q", "k", "v", "output"))
        qn, kn = W(p + "attn_q_norm.weight"), W(p + "attn_k_norm.weight")
        u = _rms(x, W(p + "attn_norm.weight"))
        if use_conv:
            dyn = (u @ W(p + "attn_conv_proj.weight").T).view(B, 2, K, -1)
            cb = W(p + "attn_conv_base")
            u = _conv_ref(u, dyn[:, 0], cb[0], m["dflash.conv_group_size"])
        heads = []
        for h in range(nh):
            kvh = h // (nh // nkv)
            qs, ks = slice(h * hd, (h + 1) * hd), slice(kvh * hd, (kvh + 1) * hd)
            q = _rope_neox(_rms(u @ Wq[qs].T, qn), q_pos, base)
            # PASS B: context K/V from the fused feature (no norm, no attention)
            k_ctx = _rope_neox(_rms(ctx @ Wk[ks].T, kn), ctx_pos, base)
            v_ctx = ctx @ Wv[ks].T
            k_blk = _rope_neox(_rms(u @ Wk[ks].T, kn), q_pos, base)
            keys, vals = torch.cat([k_ctx, k_blk]), torch.cat([v_ctx, u @ Wv[ks].T])
            key_pos = torch.cat([ctx_pos, q_pos])
            out = torch.zeros(B, hd, dtype=torch.float64)
            for r in range(B):  # non-causal within the block; sliding window |q - k| < window
                s = keys @ q[r] / math.sqrt(hd)
                if window:
                    s = s.masked_fill((q_pos[r] - key_pos).abs() >= window, float("-inf"))
                out[r] = torch.softmax(s, 0) @ vals
            heads.append(out)
        a = torch.cat(heads, -1) @ Wo.T
        if use_conv:
            a = _conv_ref(a, dyn[:, 1], cb[1], m["dflash.conv_group_size"])
        x = x + a
        u = _rms(x, W(p + "ffn_norm.weight"))
        if use_conv:
            dyn = (u @ W(p + "ffn_conv_proj.weight").T).view(B, 2, K, -1)
            cb = W(p + "ffn_conv_base")
            u = _conv_ref(u, dyn[:, 0], cb[0], m["dflash.conv_group_size"])
        gate, up = u @ W(p + "ffn_gate.weight").T, u @ W(p + "ffn_up.weight").T
        y = (torch.nn.functional.silu(gate) * up) @ W(p + "ffn_down.weight").T
        if use_conv:
            y = _conv_ref(y, dyn[:, 1], cb[1], m["dflash.conv_group_size"])
        x = x + y
    hid = _rms(x[1:], W("output_norm.weight"))
    logits = hid @ embed.T
    # the target's logit transform as the file states it (0 or absent: none); the selector's unary
    # is the transformed logit
    scale, cap = m.get("dflash.logit_scale") or 1.0, m.get("dflash.final_logit_softcapping") or None
    logits = logits * scale
    if cap:
        logits = torch.tanh(logits / cap) * cap
    walk = None
    if selector and g.has_tensor("selector_hidden.weight"):
        A, Bk, P = W("selector_predecessor.weight"), W("selector_successor.weight"), W("selector_hidden.weight")
        k = m["dflash.selector_top_k"]
        unary, cand = torch.topk(logits, k, -1)
        prev, walk = anchor, []
        for e in range(B - 1):
            ph = P @ hid[e]
            scores = [float(unary[e, c] + (A[prev] * ph * Bk[cand[e, c]]).sum()) for c in range(k)]
            prev = int(cand[e, int(np.argmax(scores))])
            walk.append(prev)
    return hid, logits, walk


@pytest.mark.parametrize("which", ["dflash", "dflash2"])
def test_passes_match_the_reference(files, which):
    target, dr = _load(files, which)
    P = len(PROMPT) - 1
    feats = target.forward(PROMPT[:-1], target.make_cache(), taps=dr.taps).hidden
    ring = dr.draft_head.new_state()
    dr.draft_head.catch_up(PROMPT[:-1], feats, 0, ring)
    h, logits = dr.model.block_forward(PROMPT[-1], P, ring)
    rh, rlogits, rwalk = reference_block(files[which], files["trunk"], feats, PROMPT[-1], P)
    assert torch.allclose(h.double(), rh, atol=1e-4, rtol=1e-4)
    assert torch.allclose(logits.double(), rlogits, atol=1e-4, rtol=1e-4)
    tokens, _ = dr.draft_head.walk_block(PROMPT[-1], P, ring)
    assert tokens == (rwalk if rwalk is not None else rlogits.argmax(-1).tolist())


@pytest.mark.parametrize("which, scale, cap", [("dflash2", 0.196, 20.0), ("dflash2", 0.5, 1.5),
                                               ("dflash2", 3.0, None), ("dflash", None, 1.5)])
def test_logit_transform_matches_the_reference(files, tmp_path, which, scale, cap):
    """``dflash.logit_scale`` and ``dflash.final_logit_softcapping`` shape the logits, and through
    them the selector's unary term (the design: skipping the transform cost more than half the
    acceptance on a real DFlash2 drafter). The first case is that drafter's (scale 0.196, softcap
    20); the others make each transform matter on tiny logits. Checked against the reference."""
    p = write_tiny_dflash(tmp_path / f"{which}.gguf", files["trunk"], dflash2=which == "dflash2",
                          logit_scale=scale, softcap=cap)
    target = load_model(files["trunk"], fmt="f32")
    dr = load_drafter(p, target)
    P = len(PROMPT) - 1
    feats = target.forward(PROMPT[:-1], target.make_cache(), taps=dr.taps).hidden
    ring = dr.draft_head.new_state()
    dr.draft_head.catch_up(PROMPT[:-1], feats, 0, ring)
    _, logits = dr.model.block_forward(PROMPT[-1], P, ring)
    _, rlogits, rwalk = reference_block(p, files["trunk"], feats, PROMPT[-1], P)
    assert torch.allclose(logits.double(), rlogits, atol=1e-4, rtol=1e-4)
    if cap:
        assert rlogits.abs().max() < cap
    tokens, _ = dr.draft_head.walk_block(PROMPT[-1], P, ring)
    assert tokens == (rwalk if rwalk is not None else rlogits.argmax(-1).tolist())


def test_logit_transform_changes_the_selector_walk(files, tmp_path):
    """The walk itself depends on the scale (its unary term competes with the transition scores):
    over a few seeds, some drafter's walk with scale 0.196 differs from its walk with none, and
    each equals the reference's. Without the transform both walks would be the same."""
    target = load_model(files["trunk"], fmt="f32")
    P = len(PROMPT) - 1
    differ = 0
    for seed in range(1, 5):
        walks = []
        for scale in (None, 0.196):
            p = write_tiny_dflash(tmp_path / f"s{seed}-{scale}.gguf", files["trunk"], seed=seed, dflash2=True,
                                  logit_scale=scale)
            dr = load_drafter(p, target)
            feats = target.forward(PROMPT[:-1], target.make_cache(), taps=dr.taps).hidden
            ring = dr.draft_head.new_state()
            dr.draft_head.catch_up(PROMPT[:-1], feats, 0, ring)
            tokens, _ = dr.draft_head.walk_block(PROMPT[-1], P, ring)
            assert tokens == reference_block(p, files["trunk"], feats, PROMPT[-1], P)[2]
            walks.append(tokens)
        differ += walks[0] != walks[1]
    assert differ >= 1


@pytest.mark.parametrize("which", ["dflash", "dflash2"])
def test_ring_after_a_speculative_run_equals_one_shot_injection(files, which):
    """Commits of 1..B rows, rewinds and ring wrap-around leave exactly the context a one-shot
    pass A+B over the whole history gives: the drafted block at the end matches the reference."""
    target, dr = _load(files, which)
    sampler = Sampler()
    plain = _plain(target, sampler)
    spec = BlockSpeculator(Steer(dr.draft_head, PROMPT + plain), dr.taps, 8, min_draft_prob=0.0)
    out = decode(target, sampler, PROMPT, N_TOKENS, SpecPlan(spec, window=8))
    assert out == plain
    n = len(PROMPT) + len(out) - 1  # committed positions 0..n-1 (the last token is not forwarded)
    spec.sync()  # the last commits wait for the next proposal; write them as it would
    ring = spec.state
    assert sorted(ring.pos_of[ring.pos_of >= 0].tolist()) == list(range(n - WINDOW, n))
    full = PROMPT + out
    fresh = load_model(files["trunk"], fmt="f32")
    feats = fresh.forward(full[:n], fresh.make_cache(), taps=dr.taps).hidden
    h, logits = dr.model.block_forward(full[n], n, ring)
    rh, rlogits, _ = reference_block(files[which], files["trunk"], feats[n - WINDOW :], full[n], n)
    assert torch.allclose(logits.double(), rlogits, atol=1e-4, rtol=1e-4)


def test_arms_after_a_reused_prefix(files):
    """Tap rows for only a suffix of the prompt (an adopted KV prefix): the ring holds that suffix
    and the block drafts from it, exactly as the reference with that shorter context."""
    target, dr = _load(files, "dflash2")
    feats = target.forward(PROMPT[:-1], target.make_cache(), taps=dr.taps).hidden
    spec = BlockSpeculator(dr.draft_head, dr.taps, 8, min_draft_prob=0.0)
    spec.begin(PROMPT[:-1], feats[-4:])
    P = len(PROMPT) - 1
    spec.sync()  # begin only keeps the rows; the first proposal writes them
    assert sorted(spec.state.pos_of[spec.state.pos_of >= 0].tolist()) == list(range(P - 4, P))
    draft = spec.propose(DraftContext(PROMPT[-1], P, 4, PROMPT))
    _, rlogits, rwalk = reference_block(files["dflash2"], files["trunk"], feats[-4:], PROMPT[-1], P)
    assert draft.tokens == rwalk


# ----------------------------------------------------------------------------- DFlash2 pieces


def _brute_force_greedy(first, trans):
    """Over every path: the one whose step scores are lexicographically largest."""
    k, E = first.shape[0], trans.shape[0] + 1
    best, best_key = None, None
    for path in itertools.product(range(k), repeat=E):
        key = [float(first[path[0]])] + [float(trans[e, path[e], path[e + 1]]) for e in range(E - 1)]
        if best_key is None or key > best_key:
            best, best_key = list(path), key
    return best


def _brute_force_total(first, trans):
    k, E = first.shape[0], trans.shape[0] + 1
    return max(
        float(first[p[0]]) + sum(float(trans[e, p[e], p[e + 1]]) for e in range(E - 1))
        for p in itertools.product(range(k), repeat=E)
    )


def _path_total(first, trans, path):
    return float(first[path[0]]) + sum(float(trans[e, path[e], path[e + 1]]) for e in range(len(path) - 1))


def test_greedy_walk_is_the_brute_force_greedy_path():
    gen = torch.Generator().manual_seed(0)
    for E, k in ((1, 3), (2, 3), (3, 3), (4, 2), (3, 4)):
        for _ in range(20):
            first = torch.randn(k, generator=gen)
            trans = torch.randn(E - 1, k, k, generator=gen)
            path = greedy_walk(first, trans)
            assert path == _brute_force_greedy(first, trans)
            assert _path_total(first, trans, path) <= _brute_force_total(first, trans) + 1e-9


def test_greedy_walk_versus_maximum_total():
    # transitions that do not depend on the predecessor: greedy is provably the best total
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        first = torch.randn(3, generator=gen)
        rows = torch.randn(3, 1, 3, generator=gen).expand(3, 3, 3)
        path = greedy_walk(first, rows)
        assert math.isclose(_path_total(first, rows, path), _brute_force_total(first, rows), rel_tol=1e-6)
    # a trade-off: the better first step leads to a poor second one. The walk takes it anyway
    first = torch.tensor([1.0, 0.9])
    trans = torch.tensor([[[0.0, 0.1], [5.0, 0.0]]])
    assert greedy_walk(first, trans) == [0, 1]  # total 1.1
    assert _brute_force_total(first, trans) == pytest.approx(5.9)  # [1, 0]


def test_selector_lattice_is_the_published_score():
    gen = torch.Generator().manual_seed(2)
    V, r, E, k = 11, 3, 3, 4
    A, Bk = torch.randn(V, r, generator=gen), torch.randn(V, r, generator=gen)
    ph, unary = torch.randn(E, r, generator=gen), torch.randn(E, k, generator=gen)
    cand = torch.stack([torch.randperm(V, generator=gen)[:k] for _ in range(E)])
    first, trans = selector_lattice(unary, cand, ph, A, Bk, anchor=5)
    for c in range(k):
        assert float(first[c]) == pytest.approx(float(unary[0, c] + (A[5] * ph[0] * Bk[cand[0, c]]).sum()), abs=1e-5)
    for e in range(1, E):
        for p, c in itertools.product(range(k), range(k)):
            want = unary[e, c] + (A[cand[e - 1, p]] * ph[e] * Bk[cand[e, c]]).sum()
            assert float(trans[e - 1, p, c]) == pytest.approx(float(want), abs=1e-5)


def test_conv_matches_reference_and_is_local():
    gen = torch.Generator().manual_seed(3)
    rows, H, K, G = 5, 8, 3, 4
    x = torch.randn(rows, H, generator=gen)
    dyn = torch.randn(rows, K, H // G, generator=gen)
    base = torch.randn(K, H, generator=gen)
    y = grouped_dynamic_conv(x, dyn, base, G)
    assert torch.allclose(y, _conv_ref(x, dyn, base, G), atol=1e-6)
    # row j reaches rows j..j+K-1 only, never an earlier row
    for j in range(rows):
        x2 = x.clone()
        x2[j] += 1.0
        changed = (grouped_dynamic_conv(x2, dyn, base, G) - y).abs().sum(-1) > 0
        assert changed.tolist() == [j <= r < j + K for r in range(rows)]


def test_conv_never_reads_across_a_block_boundary(files):
    """The block at P reads its own rows (and the ring); whatever block ran before changes nothing.
    With only the anchor row of the block changed, rows beyond the conv's reach through attention
    still move, so the check is end to end: different previous blocks, identical drafts."""
    target, dr = _load(files, "conv_only")
    feats = target.forward(PROMPT[:-1], target.make_cache(), taps=dr.taps).hidden
    ring = dr.draft_head.new_state()
    dr.draft_head.catch_up(PROMPT[:-1], feats, 0, ring)
    P = len(PROMPT) - 1
    h0, l0 = dr.model.block_forward(PROMPT[-1], P, ring)
    for prev_anchor, prev_pos in ((3, P - 5), (200, P - 1), (17, P)):
        dr.model.block_forward(prev_anchor, prev_pos, ring)  # some previous block
        h1, l1 = dr.model.block_forward(PROMPT[-1], P, ring)
        assert torch.equal(l0, l1) and torch.equal(h0, h1)
    # and the conv is real: switched off, the logits differ
    dr.model.conv_enabled = False
    _, l2 = dr.model.block_forward(PROMPT[-1], P, ring)
    assert not torch.allclose(l0, l2, atol=1e-3)


def test_switches_turn_each_piece_off(files, monkeypatch):
    P = len(PROMPT) - 1

    def run(which):
        # the switches are read by tsspec.settings and handed down by the session
        session = Session.open(resolve_run(model=str(files["trunk"]), weights="f32"))
        target, dr = session.target, session.load_drafter(files[which])
        feats = target.forward(PROMPT[:-1], target.make_cache(), taps=dr.taps).hidden
        ring = dr.draft_head.new_state()
        dr.draft_head.catch_up(PROMPT[:-1], feats, 0, ring)
        anchors = [PROMPT[-1], 5, 77, 130, 201, 250]
        logits = [dr.model.block_forward(a, P, ring)[1] for a in anchors]
        return dr, logits, [dr.draft_head.walk_block(a, P, ring)[0] for a in anchors]

    _, plain_logits, plain_tokens = run("dflash")
    dr2, logits2, tokens2 = run("dflash2")
    assert not any(torch.allclose(a, b, atol=1e-3) for a, b in zip(plain_logits, logits2))

    monkeypatch.setenv("TS_DFLASH_CONV", "0")
    dr, logits, tokens = run("dflash2")
    assert not dr.model.conv_enabled and dr.model.selector_enabled and dr.model.generation == 2
    # same backbone weights as the DFlash file: with the conv off the logits are DFlash's
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(plain_logits, logits))
    # ... while the selector still walks its lattice, which does not always pick the argmax
    assert tokens != plain_tokens

    monkeypatch.setenv("TS_DFLASH_SELECTOR", "0")
    dr, logits, tokens = run("dflash2")
    assert tokens == plain_tokens == [lg.argmax(-1).tolist() for lg in logits]
    assert "(off)" in dr.describe()

    monkeypatch.delenv("TS_DFLASH_CONV")
    dr, logits, tokens = run("dflash2")
    assert all(torch.equal(a, b) for a, b in zip(logits2, logits))  # conv back on
    assert tokens == [lg.argmax(-1).tolist() for lg in logits]  # selector still off
    assert tokens != tokens2


# ----------------------------------------------------------------------------- hybrid trunk


def test_qwen35_hybrid_trunk(tmp_path):
    """A recurrent-state trunk: rejected drafts roll the state back; output still equals plain."""
    tiny_hybrid = pytest.importorskip("tiny_hybrid")
    pytest.importorskip("transformers")
    trunk, _ = tiny_hybrid.write_hybrid(tmp_path / "qwen35.gguf", "qwen35")
    drafter = write_tiny_dflash(tmp_path / "dflash2.gguf", trunk, dflash2=True)
    target = load_model(trunk, fmt="f32")
    dr = load_drafter(drafter, target)
    assert dr.taps == (1, 3)
    sampler = Sampler()
    plain = _plain(target, sampler)
    spec = BlockSpeculator(Steer(dr.draft_head, PROMPT + plain), dr.taps, 8, min_draft_prob=0.0)
    stats = SpecStats()
    assert decode(target, sampler, PROMPT, N_TOKENS, SpecPlan(spec, window=8), stats=stats) == plain
    assert 0 < stats.accepted < stats.drafted
    # the ring holds the committed tail, whichever way the trunk rolled back
    n = len(PROMPT) + len(plain) - 1
    spec.sync()
    ring = spec.state
    assert sorted(ring.pos_of[ring.pos_of >= 0].tolist()) == list(range(n - WINDOW, n))


def test_reduced_draft_vocabulary(files, tmp_path):
    """An own LM head over a subset of the vocabulary (d2t): drafts are always in that subset,
    and the softcap applies before the scatter (other tokens stay impossible)."""
    keep = list(range(0, 300, 3))
    p = write_tiny_dflash(tmp_path / "d2t.gguf", files["trunk"], dflash2=True, draft_vocab=keep, softcap=5.0)
    target = load_model(files["trunk"], fmt="f32")
    dr = load_drafter(p, target)
    feats = target.forward(PROMPT[:-1], target.make_cache(), taps=dr.taps).hidden
    ring = dr.draft_head.new_state()
    dr.draft_head.catch_up(PROMPT[:-1], feats, 0, ring)
    _, logits = dr.model.block_forward(PROMPT[-1], len(PROMPT) - 1, ring)
    assert logits.shape == (4, 300)
    assert torch.isinf(logits[:, 1]).all() and logits[:, keep].abs().max() <= 5.0
    tokens, _ = dr.draft_head.walk_block(PROMPT[-1], len(PROMPT) - 1, ring)
    assert all(t in keep for t in tokens)
    sampler = Sampler()
    spec = BlockSpeculator(dr.draft_head, dr.taps, 8, min_draft_prob=0.0)
    assert decode(target, sampler, PROMPT, N_TOKENS, SpecPlan(spec)) == _plain(target, sampler)


def test_one_loaded_block_drafter_serves_interleaved_sequences(files):
    """Two sequences on one trunk and ONE loaded DFlash2 drafter, stepped in turn and stepped
    together (shared forwards): each speculator holds its own KV ring (``new_state``), so each
    sequence gets exactly what it gets alone."""
    from tsspec.spec.loop import DecodeState, decode_batched, decode_interleaved

    target, dr = _load(files, "dflash2")
    sampler = Sampler()
    prompts = [PROMPT, PROMPT[5:] + PROMPT[:5]]
    alone = [decode(target, sampler, p, N_TOKENS) for p in prompts]
    specs = [BlockSpeculator(Steer(dr.draft_head, p + a), dr.taps, 8, min_draft_prob=0.0)
             for p, a in zip(prompts, alone)]
    assert specs[0].state is not specs[1].state
    seqs = [DecodeState(target, sampler, SpecPlan(s, window=8)) for s in specs]
    assert decode_interleaved(seqs, prompts, N_TOKENS) == alone
    assert all(0 < seq.stats.accepted < seq.stats.drafted for seq in seqs)
    # and stepped together, their rows (and the tap rows the drafter reads) from shared forwards
    specs = [BlockSpeculator(Steer(dr.draft_head, p + a), dr.taps, 8, min_draft_prob=0.0)
             for p, a in zip(prompts, alone)]
    seqs = [DecodeState(target, sampler, SpecPlan(s, window=8)) for s in specs]
    assert decode_batched(seqs, prompts, N_TOKENS) == alone
    assert all(0 < seq.stats.accepted < seq.stats.drafted for seq in seqs)


def test_commits_wait_for_the_next_proposal(files):
    """While nothing is proposed (a parked governor) commits only keep tap rows; the next proposal
    writes them in one pass, drafts what an eager ring would, and reports the long refill as setup."""
    target, dr = _load(files, "dflash")
    feats = target.forward(PROMPT[:-1], target.make_cache(), taps=dr.taps).hidden
    P = len(PROMPT) - 1
    lazy = BlockSpeculator(dr.draft_head, dr.taps, 8, min_draft_prob=0.0)
    lazy.begin(PROMPT[:4], feats[:4])
    for i in range(4, P):  # one committed token per plain step
        lazy.commit([PROMPT[i]], feats[i : i + 1], i)
    assert not (lazy.state.pos_of >= 0).any()  # nothing written yet
    eager = BlockSpeculator(dr.draft_head, dr.taps, 8, min_draft_prob=0.0)
    eager.begin(PROMPT[:-1], feats)
    eager.sync()
    ctx = DraftContext(PROMPT[-1], P, 4, PROMPT)
    a, b = lazy.propose(ctx), eager.propose(ctx)
    assert a.tokens == b.tokens and a.setup_ms > 0 and b.setup_ms == 0
    assert torch.equal(lazy.state.pos_of, eager.state.pos_of)
    assert torch.allclose(lazy.state.k, eager.state.k, atol=1e-5)


class _ParkedFor:
    """A governor parked for the first ``steps`` decode steps, drafting every step after;
    ``tells``: whether it answers ``drafts_within`` (a governor that does not is asked for taps
    every step)."""

    parks = 0
    state = "parked"

    def __init__(self, steps: int, tells: bool):
        self.left = steps
        if tells:
            self.drafts_within = lambda n: self.left <= n

    def begin_sequence(self):
        pass

    def should_draft(self):
        return self.left <= 0

    def draft_length(self, window):
        return window

    def min_draft_prob(self):
        return None

    def record(self, speculative, ms, tokens, drafted=None, setup_ms=0.0, shared=1):
        self.left -= 1


class _TapCounter:
    """The trunk, counting the forwards that carried taps and those that did not."""

    def __init__(self, target):
        self._t = target
        self.tapped = self.untapped = 0

    def __getattr__(self, name):
        return getattr(self._t, name)

    def forward(self, tokens, cache, **kw):
        if kw.get("taps"):
            self.tapped += 1
        else:
            self.untapped += 1
        return self._t.forward(tokens, cache, **kw)


class _Recording(BlockSpeculator):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen = []  # (position, ring positions held, drafted tokens) of every proposal

    def propose(self, ctx):
        d = super().propose(ctx)
        held = sorted(int(p) for p in self.state.pos_of if p >= 0)
        self.seen.append((ctx.position, held, list(d.tokens)))
        return d


@pytest.mark.parametrize("park", [0, 5, 20])
def test_a_parked_block_drafter_taps_only_its_horizon(files, park):
    """Parked for longer than its ring, a block drafter is forwarded no taps (the prompt's forward
    included) until its ring's worth of steps before the park ends; its first proposal then holds
    exactly the newest rows, drafts what it drafts when every row is tapped, and the output is plain's."""
    target, dr = _load(files, "dflash")
    sampler = Sampler(SamplingParams())
    plain = decode(target, sampler, PROMPT, N_TOKENS)
    runs = {}
    for tells in (False, True):
        spec = _Recording(dr.draft_head, dr.taps, 8, min_draft_prob=0.0)
        counted = _TapCounter(target)
        stats = SpecStats()
        assert decode(counted, sampler, PROMPT, N_TOKENS, SpecPlan(spec, _ParkedFor(park, tells), window=8),
                      stats=stats) == plain
        assert stats.drafted > 0
        runs[tells] = (spec, counted)
    horizon = runs[True][0].tap_horizon
    assert horizon == runs[True][0].state.rows == WINDOW  # the tiny drafter slides over 12 rows
    always, skipping = runs[False], runs[True]
    assert always[1].untapped == 0
    # untapped: the prompt's forward while parked beyond the horizon, and the steps before it
    assert skipping[1].untapped == (1 + park - horizon if park > horizon else 0)
    assert skipping[0].seen == always[0].seen  # a sliding ring loses nothing to the skipped rows
    first_pos, held, _ = skipping[0].seen[0]
    assert held == list(range(first_pos - horizon, first_pos))


class _SecondGuessBlock(Steer):
    """Drafts the plain continuation, but with its top two swapped at scattered positions: the
    chain is wrong there and its second guess (``others``) is right."""

    def walk_block(self, anchor, position, state, pick=None, others=None):
        assert pick is None
        n = self.block_size - 1
        tokens, chances = [], []
        for e in range(n):
            at = position + 1 + e
            right = self.full[at] if at < len(self.full) else 0
            if random.Random(at).random() < 0.3:  # scattered: at a fixed period both emit as much per verify
                tokens.append((right + 1) % 250)
                chances.append((0.6, 0.35, right))
            else:
                tokens.append(right)
                chances.append((0.9, 0.05, (right + 2) % 250))
        if others is not None:
            others.extend(chances)
        return tokens, [c[0] for c in chances]


def test_block_trees_take_the_second_guess_and_equal_plain(files):
    """With a node budget the block drafter hangs its rows' second guesses beside its chain as
    leaves: output equal to plain, trees verified, and more accepted per verify than the chain."""
    target, dr = _load(files, "dflash")
    sampler = Sampler(SamplingParams())
    plain = decode(target, sampler, PROMPT, N_TOKENS)
    per_verify = {}
    for tree_nodes in (0, 12):
        spec = BlockSpeculator(_SecondGuessBlock(dr.draft_head, PROMPT + plain), dr.taps, 8, min_draft_prob=0.0,
                               tree=tree_nodes, sibling_min=0.0)
        stats = SpecStats()
        assert decode(target, sampler, PROMPT, N_TOKENS, SpecPlan(spec, window=8), stats=stats) == plain
        assert (stats.tree_verifies > 0) == (tree_nodes > 0)
        per_verify[tree_nodes] = stats.accepted / stats.verify_calls
    assert per_verify[12] > per_verify[0] + 0.3, per_verify
    # the real drafter's walk reports a second guess for every position it drafts
    others = []
    tokens, conf = dr.draft_head.walk_block(PROMPT[-1], len(PROMPT) - 1, _primed(dr, target), None, others)
    assert len(others) == len(tokens) and all(o[2] != t and o[1] <= c + 1e-6 for o, t, c in zip(others, tokens, conf))


def _primed(dr, target):
    ring = dr.draft_head.new_state()
    feats = target.forward(PROMPT[:-1], target.make_cache(), taps=dr.taps).hidden
    dr.draft_head.catch_up(PROMPT[:-1], feats, 0, ring)
    return ring


def test_greedy_walk_over_a_draft_vocabulary_equals_the_full_row_walk(files, tmp_path):
    """The greedy walk's fast path (argmax and softmax over the draft vocabulary's rows) against its
    reference (the same over the target-sized row, -inf outside d2t): same tokens, same confidences."""
    keep = list(range(1, 300, 7))
    p = write_tiny_dflash(tmp_path / "d2t1.gguf", files["trunk"], dflash2=False, draft_vocab=keep)
    target = load_model(files["trunk"], fmt="f32")
    m = load_drafter(p, target).model
    feats = target.forward(PROMPT[:-1], target.make_cache(), taps=m.cfg.target_layers).hidden
    ring = m.new_state()
    m.inject(feats, 0, ring)
    for anchor in (PROMPT[-1], 5, 123):
        fast = m.walk(anchor, len(PROMPT) - 1, ring)
        ref = m.walk(anchor, len(PROMPT) - 1, ring, lambda e, row: int(torch.argmax(row)))
        assert fast[0] == ref[0] and all(t in keep for t in fast[0])
        assert fast[1] == pytest.approx(ref[1], abs=1e-6)
