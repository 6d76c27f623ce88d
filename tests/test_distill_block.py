"""`tsspec distill --kind block`: a DFlash-style block drafter trained on a tiny trunk."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.distill_corpus import TEXT, own_cache, write_corpus  # noqa: F401 (own_cache: an autouse fixture)
from tests.tiny import write_tiny_model
from tsspec.spec.plan import SpecPlan
from tsspec.distill.block import BlockModule, BlockShape, choose_taps, make_block_batch
from tsspec.distill.features import Features
from tsspec.distill.train import DistillConfig, distill
from tsspec.drafters import load_drafter
from tsspec.drafters.dflash import DFlashHead
from tsspec.errors import BadInput
from tsspec.gguf_file import GGUFFile
from tsspec.models import load_model
from tsspec.sampling import Sampler, SamplingParams
from tsspec.spec.block import BlockSpeculator
from tsspec.spec.loop import decode
from tsspec.spec.stats import SpecStats
from tsspec.tokenizer import Tokenizer



@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("distill-block")
    trunk = write_tiny_model(d / "trunk.gguf", arch="llama", vocab_size=300, d_model=64, n_layers=3)
    corpus = write_corpus(d / "corpus")
    return {"dir": d, "trunk": trunk, "corpus": corpus}


def _cfg(world, out, **kw):
    base = dict(model=str(world["trunk"]), out=str(out), kind="block", corpus=(str(world["corpus"]),), tokens=4096,
                heldout_tokens=512, steps=60, batch=32, chunk=64, draft_vocab=128, eval_every=20, lr=3e-3,
                weights="f32", precision="f32", block_size=5, taps=2)
    base.update(kw)
    return DistillConfig(**base)


@pytest.fixture(scope="module")
def trained(world, tmp_path_factory):
    out = tmp_path_factory.mktemp("out") / "block.gguf"
    events = []
    result = distill(_cfg(world, out, steps=300, eval_every=150, batch=64), lambda kind, **d: events.append((kind, d)))
    return result, events


def test_training_lowers_the_loss_and_raises_acceptance(trained):
    result, events = trained
    losses = [d["loss"] for k, d in events if k == "advance" and "loss" in d]
    assert len(losses) == 300
    assert np.mean(losses[-10:]) < 0.8 * np.mean(losses[:10])
    metrics = [d for k, d in events if k == "metrics"]
    assert [m["step"] for m in metrics] == [0, 150, 300]
    first = [m["first"] for m in metrics]
    # a random tiny trunk is hard to predict a token ahead from its residuals (its greedy path
    # seldom follows the text, so mostly the first draft is judged): some learning, not much
    assert first[-1] > first[0] + 0.06, first
    assert len(result.heldout["accept"]) == 4  # block 5: four drafts per forward
    assert result.heldout["tokens_per_verify"] == pytest.approx(1 + sum(result.heldout["accept"]))
    assert result.heldout["tokens_per_verify"] > 1.06


def test_taps_spread_over_the_trunk():
    assert choose_taps(30, 4) == (1, 10, 20, 29)
    assert choose_taps(3, 2) == (1, 2)
    assert choose_taps(2, 4) == (1,)
    assert all(t < 24 for t in choose_taps(24, 16))


def test_the_file_is_a_dflash_drafter_and_runs_the_trained_math(world, trained):
    """The loaded drafter's block forward (the decode path: ring + pass C) equals the batched
    training module on the same rows: one definition of the math, two implementations compared."""
    result, _ = trained
    g = GGUFFile(result.out)
    assert g.arch == "dflash" and g.get("dflash.block_size") == 5 and list(g.get("dflash.target_layers")) == [1, 2]
    target = load_model(world["trunk"], fmt="f32")
    dr = load_drafter(result.out, target)
    assert dr.speculator_name == "block" and isinstance(dr.draft_head, DFlashHead)
    model = dr.model
    ck = torch.load(str(result.out) + ".ckpt", weights_only=False)
    s = BlockShape.for_trunk(64, 2, 1, 128, 5, float(target.cfg.rms_eps), float(target.cfg.layers[0].rope_base))
    m = BlockModule(s, target.out_norm, 0)
    m.load_state_dict(ck["head"])
    tokens = [ord(c) % 256 for c in TEXT[:40]]
    out = target.forward(tokens, target.make_cache(), all_logits=True, taps=dr.taps)
    taps = out.hidden.float()
    embed = target.embed[list(range(target.vocab_size))].float()
    for p in (1, 17, 35):
        ring = model.new_state()
        model.inject(taps[:p], 0, ring)
        h_dec, logits = model.block_forward(tokens[p], p, ring)
        with torch.no_grad():
            h_train = m(taps[None], torch.tensor([tokens]), torch.tensor([[p]]), embed,
                        model.cfg.mask_token_id)[0, 0]
        assert torch.allclose(h_dec, h_train, atol=1e-4), (h_dec - h_train).abs().max()
        # the read-out: the trunk's own head rows for the draft vocabulary, -inf elsewhere
        d2t = model.d2t
        assert torch.allclose(logits[:, d2t], target.lm_head(h_train)[:, d2t], atol=1e-3)
        assert torch.isinf(logits).sum() == logits.numel() - logits.shape[0] * d2t.numel()


def test_the_file_carries_what_llama_cpp_needs_to_load_it(world, trained):
    """llama.cpp b11434's loader builds a vocabulary for the drafter too (the trunk's tokenizer keys,
    stored types kept), reads the MASK token from ``tokenizer.ggml.mask_token_id`` and the context
    length from ``dflash.context_length``, and asserts ``d2t`` is I64; without any of these it
    refuses the file (scripts/llamacpp_dflash_check.py loads a trained one there)."""
    import gguf

    result, _ = trained
    drafter, trunk = gguf.GGUFReader(str(result.out)), gguf.GGUFReader(str(world["trunk"]))
    tok_keys = [k for k in trunk.fields if k.startswith("tokenizer.")]
    assert "tokenizer.ggml.tokens" in tok_keys
    for k in tok_keys:
        a, b = drafter.fields[k], trunk.fields[k]
        assert a.types == b.types and a.contents() == b.contents(), k
    mask = drafter.fields["dflash.mask_token_id"].contents()
    assert drafter.fields["tokenizer.ggml.mask_token_id"].contents() == mask
    assert drafter.fields["tokenizer.ggml.mask_token_id"].types == [gguf.GGUFValueType.UINT32]
    assert drafter.fields["dflash.context_length"].contents() == trunk.fields["llama.context_length"].contents()
    d2t = next(t for t in drafter.tensors if t.name == "d2t")
    assert d2t.tensor_type == gguf.GGMLQuantizationType.I64 and d2t.n_elements == 128


def test_tokenizer_keys_copy_with_their_types_and_an_empty_array_is_left_out(tmp_path):
    """A trunk written by llama.cpp can hold an empty array (gguf-py cannot write one): copying it
    would fail the drafter's export after the whole training run, with a traceback."""
    import gguf
    from types import SimpleNamespace

    from tsspec.distill.block import copy_tokenizer_keys

    T = gguf.GGUFValueType
    fields = {"tokenizer.ggml.tokens": [T.ARRAY, T.STRING], "tokenizer.ggml.token_type": [T.ARRAY, T.INT32],
              "tokenizer.ggml.merges": [T.ARRAY, T.STRING], "tokenizer.ggml.bos_token_id": [T.UINT32],
              "tokenizer.ggml.mask_token_id": [T.UINT32], "llama.context_length": [T.UINT32]}
    metadata = {"tokenizer.ggml.tokens": ["a", "b"], "tokenizer.ggml.token_type": np.array([1, 3], dtype=np.int32),
                "tokenizer.ggml.merges": [], "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.mask_token_id": 0,
                "llama.context_length": 64}
    trunk = SimpleNamespace(metadata=metadata,
                            reader=SimpleNamespace(fields={k: SimpleNamespace(types=v) for k, v in fields.items()}))
    w = gguf.GGUFWriter(str(tmp_path / "d.gguf"), "dflash")
    copy_tokenizer_keys(w, trunk)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = gguf.GGUFReader(str(tmp_path / "d.gguf"))
    got = {k: (f.types, f.contents()) for k, f in r.fields.items() if k.startswith("tokenizer.")}
    assert got == {"tokenizer.ggml.tokens": ([T.ARRAY, T.STRING], ["a", "b"]),
                   "tokenizer.ggml.token_type": ([T.ARRAY, T.INT32], [1, 3]),
                   "tokenizer.ggml.bos_token_id": ([T.UINT32], 1)}


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, top_k=40, seed=7)],
                         ids=["greedy", "seeded"])
def test_speculative_output_equals_plain_with_the_trained_block_drafter(world, trained, params):
    result, _ = trained
    target = load_model(world["trunk"], fmt="f32")
    dr = load_drafter(result.out, target)
    # text like the corpus, through the trunk's own tokenizer: a prompt of raw byte ids sends this
    # random trunk into repeating a token the corpus never holds, which no trained drafter proposes
    prompt = Tokenizer.from_gguf(str(world["trunk"])).encode(TEXT[:60], add_special=False, parse_special=False)
    plain = decode(target, Sampler(params), prompt, 40)
    stats = SpecStats()
    spec = BlockSpeculator(dr.draft_head, dr.taps, max_draft_tokens=4, min_draft_prob=0.0,
                           sample_drafts=params.temperature > 0)
    assert decode(target, Sampler(params), prompt, 40, SpecPlan(spec, window=4), stats=stats) == plain
    assert stats.drafted > 0
    if params.temperature == 0:
        assert stats.accepted > 0  # trained: some drafts land


def test_refuses_another_trunk(world, trained):
    result, _ = trained
    other = write_tiny_model(world["dir"] / "other.gguf", arch="qwen2", vocab_size=300, d_model=64, n_layers=3, seed=5)
    with pytest.raises(BadInput, match="block drafter was trained for a trunk with architecture llama.*qwen2"):
        load_drafter(result.out, load_model(other))
    shallow = write_tiny_model(world["dir"] / "shallow.gguf", arch="llama", vocab_size=300, d_model=64, n_layers=2)
    with pytest.raises(BadInput, match="block count 3.*2"):
        load_drafter(result.out, load_model(shallow))
    same = write_tiny_model(world["dir"] / "seed9.gguf", arch="llama", vocab_size=300, d_model=64, n_layers=3, seed=9)
    assert load_drafter(result.out, load_model(same))  # same shapes and token list: the vocabulary decides


def test_resume_after_interruption_gives_the_uninterrupted_result(world, tmp_path):
    full = distill(_cfg(world, tmp_path / "a.gguf", steps=20, eval_every=10))
    cut = _cfg(world, tmp_path / "b.gguf", steps=20, eval_every=10)

    def stop(kind, **d):
        if kind == "metrics" and d["step"] == 10:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        distill(cut, stop)
    assert torch.load(str(cut.out) + ".ckpt", weights_only=False)["step"] == 10
    resumed = distill(cut)
    a = torch.load(str(full.out) + ".ckpt", weights_only=False)["head"]
    b = torch.load(str(cut.out) + ".ckpt", weights_only=False)["head"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.heldout == full.heldout


@pytest.mark.parametrize("kw, msg", [
    (dict(block_size=1), "--block-size must be in [2, 32]"),
    (dict(layers=0), "--layers must be in [1, 16]"),
    (dict(block_size=20, chunk=20), "--block-size 20 needs chunks of at least 22 tokens"),
])
def test_bad_block_settings_are_one_clear_error(world, tmp_path, kw, msg):
    with pytest.raises(BadInput, match=msg.replace("[", r"\[").replace("]", r"\]")):
        distill(_cfg(world, tmp_path / "x.gguf", **kw))


def test_batch_targets_are_the_trunks_next_token_at_each_block_row():
    """Row e of the block at anchor p drafts the token at p + e: its target is the trunk's
    distribution at p + e - 1, and it is on the greedy path when the text there is greedy."""
    C, L, k = 2, 12, 3
    tokens = torch.arange(C * L).reshape(C, L)
    top_ids = (tokens[..., None] * 10 + torch.arange(k))
    top_ids[..., 0] = torch.roll(tokens, -1, dims=1)  # the trunk's greedy token = the text's next token
    top_ids[1, 6, 0] = 999  # ... except once
    feats = Features(tokens, torch.zeros(C, L, 4, dtype=torch.bfloat16), top_ids, torch.ones(C, L, k) / k)
    b = make_block_batch(feats, torch.tensor([1]), torch.tensor([[4]]), 4)
    assert b.greedy.tolist() == [[[top_ids[1, 4, 0], top_ids[1, 5, 0], 999]]]
    assert b.follows.tolist() == [[[True, True, False]]]
    assert b.tokens[0, 4] == tokens[1, 4]


def test_cli_trains_a_block_drafter_and_generate_drafts_with_it(world, tmp_path, capsys, monkeypatch):
    import os

    from tsspec.cli import run

    monkeypatch.setattr(os, "environ", dict(os.environ))  # generate publishes TS_SPEC_* for child processes
    out = tmp_path / "b.gguf"
    rc = run(["distill", "-m", str(world["trunk"]), "--kind", "block", "--block-size", "4", "--taps", "2",
              "-o", str(out), "--corpus", str(world["corpus"]), "--tokens", "2048", "--answers", "0",
              "--steps", "10", "--eval-every", "5", "--batch", "16", "--draft-vocab", "64"])
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 0 and out.exists(), err
    assert "run of 1..3" in err and "with 3 drafts" in err
    assert f"tsspec generate -m {world['trunk']} --spec --spec-draft-model {out}" in err
    rc = run(["generate", "-m", str(world["trunk"]), "--spec", "--spec-draft-model", str(out), "--spec-pmin", "0",
              "-p", "def add(a, b):", "-n", "12"])
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 0 and "spec block" in err, err
    # bad block settings at the command line: one line
    rc = run(["distill", "-m", str(world["trunk"]), "--kind", "block", "--layers", "0", "-o", str(tmp_path / "x.gguf")])
    lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert rc != 0 and len(lines) == 1 and "--layers must be in [1, 16]" in lines[0]
