"""The hybrid (GatedDeltaNet + gated attention) trunks: qwen35 and qwen3next.

What is shown, on tiny random weights (``tiny_hybrid``):

* logits match transformers' ``Qwen3_5ForCausalLM`` / ``Qwen3NextForCausalLM`` built from the same
  weights (f32 weights; max |diff| <= 2e-3 on logits of std ~4);
* the chunked delta rule equals the one-step recurrence to 1e-5; the row form is bit-exact whatever
  the row count; a long (chunked) prefill equals token-by-token to 1e-3 on logits;
* a row's logits are bit-for-bit independent of how many rows share the forward (bf16 weights);
* speculative decoding (n-gram; a scripted speculator forcing accept none / some / all) emits
  exactly the plain output, greedy and seeded, with the fast rollback and with
  ``TS_Q35_VERIFY_SNAPSHOTS=0``;
* after a partial accept the recurrent state is bit-for-bit the state of plain-decoding only the
  kept tokens, on both paths; the fast path never re-forwards and its snapshot copies nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from scripted import ScriptedSpeculator, keep_first
from tiny_hybrid import VOCAB, write_hybrid
from tsspec.spec.plan import SpecPlan
from tsspec.errors import ModelFileError
from tsspec.models import load_model
from tsspec.models.gated_delta import delta_rule_chunked, delta_rule_rows, delta_rule_step, l2norm
from tsspec.sampling import Sampler, SamplingParams
from tsspec.spec.loop import DecodeState, decode, decode_batched, decode_interleaved
from tsspec.spec.ngram import NGramSpeculator
from tsspec.spec.stats import SpecStats

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("hybrid")
    out = {}
    for arch in ("qwen35", "qwen3next"):
        out[arch] = write_hybrid(d / f"{arch}.gguf", arch)
    return out


def _prompt(n=24, seed=0):
    rng = np.random.default_rng(seed)
    base = [int(x) for x in rng.integers(0, 256, 8)]
    return (base * 4)[:n]  # repetitive, so n-gram drafting finds matches


# ----------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("arch", ["qwen35", "qwen3next"])
def test_logits_match_transformers(files, arch):
    path, hf = files[arch]
    m = load_model(path, fmt="f32")
    ids = [int(x) for x in np.random.default_rng(1).integers(0, VOCAB, 90)]
    got = m.forward(ids, m.make_cache(), all_logits=True).logits
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert float((got - ref).abs().max()) <= 2e-3, float((got - ref).abs().max())
    # the same rows token by token (row form throughout)
    c = m.make_cache()
    rows = torch.stack([m.forward([t], c).logits[0] for t in ids])
    assert float((rows - ref).abs().max()) <= 2e-3


def test_delta_rule_forms_agree():
    g = torch.Generator().manual_seed(0)
    n, H, dk, dv = 150, 4, 16, 32
    q = l2norm(torch.randn(n, H, dk, generator=g)) / dk**0.5
    k = l2norm(torch.randn(n, H, dk, generator=g))
    v = torch.randn(n, H, dv, generator=g)
    gate = -torch.rand(n, H, generator=g) * 2
    beta = torch.rand(n, H, generator=g)
    s0 = torch.randn(H, dk, dv, generator=g) * 0.1
    s_rows = s0.clone()
    o_rows = delta_rule_rows(s_rows, q, k, v, gate, beta)
    s_chunk = s0.clone()
    o_chunk = delta_rule_chunked(s_chunk, q, k, v, gate, beta, chunk=64)
    assert torch.allclose(o_chunk, o_rows, atol=1e-5) and torch.allclose(s_chunk, s_rows, atol=1e-5)
    # the row form: per-row slots, untouched initial state, bit-exact against single steps
    slots = torch.empty(n, H, dk, dv)
    s_keep = s0.clone()
    o_slots = delta_rule_rows(s_keep, q, k, v, gate, beta, slots)
    assert torch.equal(o_slots, o_rows) and torch.equal(slots[-1], s_rows) and torch.equal(s_keep, s0)
    s = s0.clone()
    for t in range(7):
        o = delta_rule_step(s, q[t], k[t], v[t], gate[t], beta[t], s)
        assert torch.equal(o, o_rows[t]) and torch.equal(s, slots[t])


def test_long_prefill_chunked_matches_token_by_token(files):
    path, _ = files["qwen35"]
    m = load_model(path, fmt="f32")
    ids = [int(x) for x in np.random.default_rng(2).integers(0, VOCAB, 150)]
    long = m.forward(ids, m.make_cache()).logits[-1]  # > ROW_FORM_MAX rows: chunked delta rule
    c = m.make_cache()
    for t in ids:
        one = m.forward([t], c).logits[-1]
    assert float((long - one).abs().max()) <= 1e-3
    # prefill in row-form chunks (<= 65 rows) is bit-exact against token by token
    c = m.make_cache()
    for i in range(0, 60, 20):
        chunked = m.forward(ids[i : i + 20], c).logits[-1]
    c = m.make_cache()
    for t in ids[:60]:
        one = m.forward([t], c).logits[-1]
    assert torch.equal(chunked, one)


@pytest.mark.parametrize("arch", ["qwen35", "qwen3next"])
def test_rows_are_batch_invariant(files, arch):
    m = load_model(files[arch][0])  # default bf16 weights
    prompt = _prompt()
    c = m.make_cache()
    m.forward(prompt, c)
    n0 = c.length
    verify = [5, 17, 200, 3, 99, 42, 7, 1, 250]
    many = m.forward(verify, c, all_logits=True).logits
    c.trim(len(verify))  # none kept: the state returns to the end of the prompt
    assert c.length == n0
    for i, t in enumerate(verify):
        one = m.forward([t], c).logits[0]
        assert torch.equal(one, many[i]), f"row {i} differs"


# ----------------------------------------------------------------------------- speculation


def scripted(truth, keep, k=4):
    return ScriptedSpeculator(truth, keep_first(keep, k), VOCAB, max_draft_tokens=k)


SAMPLERS = {"greedy": SamplingParams(), "seeded": SamplingParams(temperature=0.9, top_k=40, seed=1234)}


def _run(model, params, spec=None, n=40, window=4):
    stats = SpecStats()
    out = decode(model, Sampler(params), _prompt(), n, SpecPlan(spec, window=window), stats=stats)
    return out, stats


@pytest.mark.parametrize("fast", [True, False], ids=["fast-rollback", "snapshots-off"])
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
@pytest.mark.parametrize("arch", ["qwen35", "qwen3next"])
def test_speculation_equals_plain(files, arch, sampling, fast):
    m = load_model(files[arch][0], verify_snapshots=fast)
    assert m.make_cache().snapshots is fast
    params = SAMPLERS[sampling]
    plain, _ = _run(m, params)
    replayed = []
    real_forward = m.forward
    m.forward = lambda toks, cache, **kw: (replayed.append(len(cache.replay)), real_forward(toks, cache, **kw))[1]
    for keep in (0, 2, 4, -1):  # none / some / all / varying per step
        replayed.clear()
        out, st = _run(m, params, scripted(_prompt() + plain, keep))
        assert out == plain, f"keep={keep}"
        assert st.verify_calls > 0
        if keep == 4:
            assert st.accepted == st.drafted
        if keep == 0:
            assert st.accepted == 0
        # one forward per step (+ prefill); fast rollback never re-runs a kept row, copies do
        assert len(replayed) == st.verify_calls + st.plain_steps + 1
        if fast or keep == 4:
            assert sum(replayed) == 0
        else:
            assert sum(replayed) > 0
    out, st = _run(m, params, NGramSpeculator(max_draft_tokens=4))
    assert out == plain


@pytest.mark.parametrize("fast", [True, False], ids=["fast-rollback", "snapshots-off"])
def test_state_after_partial_accept_is_plain_state(files, fast):
    m = load_model(files["qwen35"][0], verify_snapshots=fast)
    a, b = m.make_cache(), m.make_cache()  # two sequences on one model
    prompt = _prompt()
    m.forward(prompt, a)
    m.forward(prompt, b)
    pos = a.length
    verify = [11, 22, 33, 44, 55]
    kept = verify[:3]
    live_before = [s.ssm.data_ptr() for s in a.live_states()]
    m.forward(verify, a, all_logits=True)
    if fast:  # the verify left the live state alone and copied nothing
        assert [s.ssm.data_ptr() for s in a.states] == live_before and a.saved is None
    else:
        assert a.saved is not None and a.saved.start == pos
    a.trim(len(verify) - len(kept))
    if not fast:  # the copy is back and the kept rows wait for the next forward
        assert a.replay == kept
    for t in kept:
        m.forward([t], b)
    assert a.length == b.length == pos + 3
    assert torch.equal(m.forward([77], a).logits, m.forward([77], b).logits)
    for sa, sb in zip(a.live_states(), b.live_states()):
        assert torch.equal(sa.ssm, sb.ssm) and torch.equal(sa.conv, sb.conv)
    with pytest.raises(ValueError):  # a recurrent state cannot go back past the last forward
        a.trim(5)


def test_rollback_memory_and_window(files):
    m = load_model(files["qwen35"][0])
    hy = m.hy
    per_row = 3 * hy.n_v_heads * hy.head_k_dim * hy.head_v_dim * 4  # 3 GatedDeltaNet layers of 4
    assert m.per_row_state_bytes() == per_row
    assert m.rollback_state_bytes(3) >= 2 * 4 * per_row
    assert m.rollback_state_bytes(8) > m.rollback_state_bytes(3)
    assert m.preferred_window == 3


def test_qwen3next_moe_is_declined(tmp_path):

    from tiny_hybrid import _write, gguf_tensors, hf_model

    hf = hf_model("qwen3next")
    t = gguf_tensors(hf, "qwen3next")
    t["blk.0.ffn_gate_inp.weight"] = np.zeros((4, 64), np.float32)
    path = _write(tmp_path / "moe.gguf", "qwen3next", hf.config, t, 4, 0)
    with pytest.raises(ModelFileError, match="mixture-of-experts"):
        load_model(path)


@pytest.mark.parametrize("store", ["f32", "f16"])
def test_qwen3next_fused_ssm_in_equals_the_split_layout(tmp_path, store):
    """Older converters store qwen3next's q, k, v, z in one ``ssm_in`` interleaved per key head; the
    loader splits it by rows, which keeps the file's blocks (and precision) in every format: the
    fused file gives the split file's logits bit for bit, f32 and default alike."""
    from tiny_hybrid import _write, gguf_tensors, hf_model

    hf = hf_model("qwen3next")
    c = hf.config
    nk, dk, dv = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_value_head_dim
    r = c.linear_num_value_heads // nk
    split = gguf_tensors(hf, "qwen3next")
    fused = dict(split)
    for i, kind in enumerate(c.layer_types):
        if kind == "full_attention":
            continue
        b = f"blk.{i}."
        qkv, z = fused.pop(b + "attn_qkv.weight"), fused.pop(b + "attn_gate.weight")
        d = qkv.shape[1]
        q, k = qkv[: nk * dk].reshape(nk, dk, d), qkv[nk * dk : 2 * nk * dk].reshape(nk, dk, d)
        v, zz = qkv[2 * nk * dk :].reshape(nk, r * dv, d), z.reshape(nk, r * dv, d)
        fused[b + "ssm_in.weight"] = np.concatenate([q, k, v, zz], axis=1).reshape(-1, d)
    if store == "f16":
        split, fused = ({n: a.astype(np.float16) if a.ndim == 2 and "conv1d" not in n else a for n, a in t.items()}
                        for t in (split, fused))
    paths = [_write(tmp_path / f"{name}.gguf", "qwen3next", c, t, c.num_hidden_layers, 0)
             for name, t in (("split", split), ("fused", fused))]
    ids = [int(x) for x in np.random.default_rng(2).integers(0, VOCAB, 40)]
    for fmt in ("f32", None):
        a, b = (load_model(p, fmt=fmt) for p in paths)
        assert b.blocks[0].in_proj.fmt == a.blocks[0].in_proj.fmt == ("f32" if fmt else "gguf")
        assert torch.equal(a.forward(ids, a.make_cache(), all_logits=True).logits,
                           b.forward(ids, b.make_cache(), all_logits=True).logits), fmt


# ----------------------------------------------------------------------------- many sequences, one model


@pytest.mark.parametrize("fast", [True, False], ids=["fast-rollback", "snapshots-off"])
def test_sequences_interleaved_on_one_hybrid_equal_each_alone(files, fast):
    """Two sequences step by step on one loaded hybrid trunk, each with its own cache (recurrent
    state, slots or copies) and speculator: each gets exactly what it gets alone."""
    m = load_model(files["qwen35"][0], verify_snapshots=fast)
    jobs = [(_prompt(), Sampler(SAMPLERS["greedy"]), lambda ref: scripted(_prompt() + ref, -1), 4),
            (_prompt(20, seed=3), Sampler(SAMPLERS["seeded"]), lambda ref: scripted(_prompt(20, seed=3) + ref, 2, k=3), 3)]
    n = 30
    alone, seqs = [], []
    for prompt, sampler, make, window in jobs:
        ref = decode(m, sampler, prompt, n)
        alone.append(ref)
        assert decode(m, sampler, prompt, n, SpecPlan(make(ref), window=window)) == ref
        seqs.append(DecodeState(m, sampler, SpecPlan(make(ref), window=window)))
    assert decode_interleaved(seqs, [prompt for prompt, *_ in jobs], n) == alone
    assert all(seq.stats.verify_calls > 0 for seq in seqs)
    # stepped together: the hybrid declines to share a forward (batches_sequences False), so the
    # rows go through one forward per sequence, and the tokens are the same
    seqs = [DecodeState(m, sampler, SpecPlan(make(ref), window=window)) for (_, sampler, make, window), ref in zip(jobs, alone)]
    assert decode_batched(seqs, [prompt for prompt, *_ in jobs], n) == alone


def test_extending_a_kept_hybrid_cache_equals_a_fresh_run(files):
    """Both runs stay in the row form (every forward <= ROW_FORM_MAX rows), so they agree bit for bit."""
    m = load_model(files["qwen35"][0])
    first = _prompt(16)
    cache = m.make_cache()
    out1 = decode(m, Sampler(), first, 12, SpecPlan(NGramSpeculator(max_draft_tokens=3), window=3), cache=cache)
    turn2 = first + out1 + _prompt(10, seed=5)
    assert len(turn2) <= 65
    got = decode(m, Sampler(), turn2, 16, SpecPlan(NGramSpeculator(max_draft_tokens=3), window=3), cache=cache)
    assert got == decode(m, Sampler(), turn2, 16)


def test_hybrid_cache_keep_goes_back_inside_the_last_forward_or_starts_over(files):
    """``keep(n)``: inside the last multi-row forward it is a trim (equal to a fresh run); further
    back the recurrent state cannot return, so the cache starts over (0 kept)."""
    m = load_model(files["qwen35"][0])
    prompt = _prompt()
    c = m.make_cache()
    m.forward(prompt[:16], c)
    m.forward(prompt[16:], c)  # the last multi-row forward: positions 16..23
    assert c.keep(20) == 20
    fresh = m.make_cache()
    m.forward(prompt[:16], fresh)
    m.forward(prompt[16:20], fresh)
    assert torch.equal(m.forward([7], c).logits, m.forward([7], fresh).logits)
    assert c.keep(10) == 0 and c.length == 0  # behind the last forward: start over
    assert torch.equal(m.forward(prompt, c).logits, m.forward(prompt, m.make_cache()).logits)


def test_hybrid_cache_restores_a_snapshot_after_one_row_forwards(files):
    """``snapshot()`` then one-row forwards (a recurrent draft model drafting) then ``restore``: the
    cache is where it was, bit for bit (the next forward equals a fresh run's)."""
    m = load_model(files["qwen35"][0])
    prompt = _prompt()
    c = m.make_cache()
    m.forward(prompt[:16], c)
    snap = c.snapshot()
    for t in (3, 4, 5):
        m.forward([t], c)
    c.restore(snap)
    assert c.length == 16
    fresh = m.make_cache()
    m.forward(prompt[:16], fresh)
    assert torch.equal(m.forward(prompt[16:20], c).logits, m.forward(prompt[16:20], fresh).logits)
    with pytest.raises(ValueError, match="cannot restore"):
        c.restore((40, snap[1]))


@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "seeded"])
def test_a_recurrent_draft_model_equals_plain_and_keeps_its_state(files, sampling):
    """A hybrid draft model (for a hybrid trunk) drafts in one-row forwards its state cannot step back
    over: at a commit it returns to its state before the drafts, and the drafts that landed go
    through again with its next catch-up. Output equals plain; some drafts land, some do not; and
    after the run the drafter's state is a fresh drafter's over the committed tokens."""
    from tsspec.spec.draft_model import DraftModelSpeculator

    trunk = load_model(files["qwen35"][0])
    drafter = load_model(files["qwen3next"][0])  # another hybrid, the same vocabulary
    params = SamplingParams(temperature=0.8, top_k=40, seed=5) if sampling else SamplingParams()
    spec = DraftModelSpeculator(drafter, vocab_size=trunk.vocab_size, max_draft_tokens=3)
    prompt = _prompt()
    st = SpecStats()
    got = decode(trunk, Sampler(params), prompt, 24, SpecPlan(spec, window=3), stats=st)
    assert got == decode(trunk, Sampler(params), prompt, 24)
    assert 0 < st.accepted < st.drafted
    spec.sync()  # every committed token through the drafter
    seq = spec.cached_tokens
    fresh = drafter.make_cache()
    drafter.forward(seq[:-1], fresh)
    last = spec.cache.length
    assert last == len(seq)
    c = spec.cache
    c.restore(c.snapshot())  # no-op, settles
    assert torch.equal(drafter.forward([7], c).logits, drafter.forward([seq[-1], 7], fresh).logits[-1:])
