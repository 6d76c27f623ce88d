"""tsspec distill --kind head: the trainer, the file it writes, and the head the registry loads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.tiny import write_tiny_model
from tsspec.spec.plan import SpecPlan
from tsspec.distill import corpus as C
from tsspec.distill.head import HeadModule, export_gguf
from tsspec.distill.train import DistillConfig, distill, lr_at, resolve_precision
from tsspec.drafters import load_drafter
from tsspec.drafters.eagle import EagleHead, head_step, trunk_identity
from tsspec.gguf_file import GGUFFile
from tsspec.errors import BadInput, ModelFileError
from tsspec.models import load_model
from tsspec.sampling import Sampler, SamplingParams
from tsspec.spec.draft_head import DraftHeadSpeculator
from tsspec.spec.loop import decode
from tsspec.spec.stats import SpecStats

TEXT = ("def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"
        "        self.y = y\n\nThe quick brown fox jumps over the lazy dog. ")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("distill")
    trunk = write_tiny_model(d / "trunk.gguf", arch="llama", vocab_size=300, d_model=64, n_layers=2)
    other = write_tiny_model(d / "other.gguf", arch="qwen2", vocab_size=300, d_model=64, n_layers=2, seed=5)
    corpus = d / "corpus"
    corpus.mkdir()
    rng = np.random.default_rng(0)
    for i in range(12):  # varied, repetitive text the byte-level tokenizer turns into long token runs
        words = TEXT.split(" ")
        body = " ".join(words[j % len(words)] for j in rng.integers(0, len(words), 600))
        (corpus / f"f{i:02d}.txt").write_text(body)
    return {"dir": d, "trunk": trunk, "other": other, "corpus": corpus}


def _cfg(world, out, **kw):
    base = dict(model=str(world["trunk"]), out=str(out), corpus=(str(world["corpus"]),), tokens=4096,
                heldout_tokens=512, steps=60, batch=32, chunk=64, draft_vocab=128, eval_every=20, lr=3e-3,
                weights="f32", precision="f32")
    base.update(kw)
    return DistillConfig(**base)


@pytest.fixture(scope="module")
def trained(world, tmp_path_factory, monkeypatch_module):
    out = tmp_path_factory.mktemp("out") / "head.gguf"
    events = []
    result = distill(_cfg(world, out, steps=100, eval_every=50), lambda kind, **d: events.append((kind, d)))
    return result, events


@pytest.fixture(scope="module", autouse=True)
def monkeypatch_module(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    # features and answers are cached beside the model cache: never the user's
    mp.setenv("TSSPEC_CACHE", str(tmp_path_factory.mktemp("cache") / "models"))
    yield mp
    mp.undo()


def test_training_lowers_the_loss_and_raises_acceptance(trained):
    result, events = trained
    losses = [d["loss"] for k, d in events if k == "advance" and "loss" in d]
    assert len(losses) == 100
    assert np.mean(losses[-10:]) < 0.8 * np.mean(losses[:10])
    firsts = [d["first"] for k, d in events if k == "metrics"]
    # step 0 (untrained), 50, 100: the head learns the trunk's greedy choices on text it never saw
    assert len(firsts) == 3 and min(firsts[1:]) > firsts[0] and max(firsts[1:]) > firsts[0] + 0.05
    assert result.heldout["tokens_per_verify"] == pytest.approx(1 + sum(result.heldout["accept"]))
    assert [c[0] for c in result.curve] == [0, 50, 100]


def test_the_file_loads_and_matches_the_trained_module(world, trained):
    result, _ = trained
    target = load_model(world["trunk"], fmt="f32")
    dr = load_drafter(result.out, target)
    assert dr.speculator_name == "draft-head" and isinstance(dr.draft_head, EagleHead)
    assert "held-out first-token acceptance" in dr.notes[0]
    head = dr.draft_head
    assert head.native is None  # f32 weights: no native step, the torch head_step runs
    # the loaded head's step is the trained math on the written weights
    ck = torch.load(str(result.out) + ".ckpt", weights_only=False)
    m = HeadModule(64, 128, float(target.cfg.rms_eps), target.out_norm, 0)
    m.load_state_dict(ck["head"])
    h = torch.randn(3, 64)
    toks = [5, 77, 123]
    logits, h_out = head.step_rows(toks, h)
    with torch.no_grad():
        want = m.step(target.embed[toks].float(), h)
    assert torch.allclose(h_out, want, atol=1e-5)
    # logits over the draft vocabulary: the trunk's own head rows d2t
    assert logits.shape == (3, 128) and head.d2t.numel() == 128
    assert torch.allclose(logits, target.lm_head(want)[:, head.d2t], atol=1e-4)
    # pick: the trunk id of the best draft and its softmax probability
    tok, p = head.pick(logits[0])
    assert tok == int(head.d2t[logits[0].argmax()]) and p == pytest.approx(float(torch.softmax(logits[0], -1).max()))


def test_q8_0_file_is_close_to_f32(world, trained, tmp_path):
    result, _ = trained
    target = load_model(world["trunk"], fmt="f32")
    a = load_drafter(result.out, target).draft_head
    m = HeadModule(64, 128, float(target.cfg.rms_eps), target.out_norm, 0)
    m.load_state_dict(torch.load(str(result.out) + ".ckpt", weights_only=False)["head"])
    out = tmp_path / "q8.gguf"
    export_gguf(out, m, a.d2t.numpy(), trunk_identity(GGUFFile(world["trunk"]), target), {}, weights="q8_0")
    assert GGUFFile(out).tensor_info("fc.weight").type_name == "Q8_0"
    b = load_drafter(out, target).draft_head
    h = torch.randn(4, 64)
    _, ha = a.step_rows([1, 2, 3, 4], h)
    _, hb = b.step_rows([1, 2, 3, 4], h)
    assert torch.allclose(ha, hb, atol=0.05) and not torch.equal(ha, hb)


@pytest.fixture(scope="module")
def native_head(world, trained, tmp_path_factory):
    """The trained head as Q8_0 on a Q8_0 trunk, where its step runs as one native call."""
    from tsspec import kernels

    if not kernels.available():
        pytest.skip(f"the native draft head step needs the native kernels: {kernels.unavailable_reason()}")
    result, _ = trained
    d = tmp_path_factory.mktemp("native")
    trunk = write_tiny_model(d / "trunk-q8.gguf", arch="llama", vocab_size=300, d_model=64, n_layers=2, quant="Q8_0")
    target = load_model(trunk)
    m = HeadModule(64, 128, float(target.cfg.rms_eps), target.out_norm, 0)
    m.load_state_dict(torch.load(str(result.out) + ".ckpt", weights_only=False)["head"])
    out = d / "head-q8.gguf"
    d2t = load_drafter(result.out, load_model(world["trunk"], fmt="f32")).draft_head.d2t.numpy()
    export_gguf(out, m, d2t, trunk_identity(GGUFFile(trunk), target), {}, weights="q8_0")
    return target, load_drafter(out, target).draft_head


def test_native_head_step_matches_the_torch_reference(native_head):
    target, head = native_head
    assert head.native is not None  # Q8_0 matrices on a Q8_0 trunk: the one native call
    torch.manual_seed(3)
    h = torch.randn(7, 64)
    toks = [5, 77, 123, 9, 0, 299, 41]
    logits, h_out = head.step_rows(toks, h)
    native, head.native = head.native, None  # the torch reference: head_step and the head rows' product
    try:
        ref_logits, ref_h = head.step_rows(toks, h)
    finally:
        head.native = native
    # the same products (batch invariant kernels), norms summed in double here and in float in torch
    assert (h_out - ref_h).abs().max() <= 1e-4 * ref_h.abs().max()
    assert (logits - ref_logits).abs().max() <= 1e-3 * ref_logits.abs().max()
    with pytest.raises(ValueError, match="rows of width 64"):
        head.native(torch.zeros(1, 32), torch.zeros(1, 32))
    # a row's bits do not depend on how many rows share the call
    for r in range(len(toks)):
        lr, hr = head.step_rows([toks[r]], h[r : r + 1])
        assert torch.equal(lr[0], logits[r]) and torch.equal(hr[0], h_out[r])


def test_native_head_drafts_and_output_equals_plain(native_head):
    target, head = native_head
    prompt = [ord(c) % 256 for c in TEXT[:40]]
    plain = decode(target, Sampler(SamplingParams()), prompt, 40)
    stats = SpecStats()
    spec = DraftHeadSpeculator(head, target.n_layers, max_draft_tokens=4, min_draft_prob=0.0)
    assert decode(target, Sampler(SamplingParams()), prompt, 40, SpecPlan(spec, window=4), stats=stats) == plain
    assert stats.drafted > 0 and stats.accepted > 0


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, top_k=40, seed=7)],
                         ids=["greedy", "seeded"])
def test_speculative_output_equals_plain_with_the_trained_head(world, trained, params):
    result, _ = trained
    target = load_model(world["trunk"], fmt="f32")
    head = load_drafter(result.out, target).draft_head
    prompt = [ord(c) % 256 for c in TEXT[:40]]
    plain = decode(target, Sampler(params), prompt, 40)
    stats = SpecStats()
    spec = DraftHeadSpeculator(head, target.n_layers, max_draft_tokens=4, min_draft_prob=0.0)
    assert decode(target, Sampler(params), prompt, 40, SpecPlan(spec, window=4), stats=stats) == plain
    assert stats.drafted > 0
    if params.temperature == 0:
        assert stats.accepted > 0  # a trained head: some drafts land


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, top_k=40, seed=7)],
                         ids=["greedy", "seeded"])
def test_output_equals_plain_with_the_trained_head_under_the_cost_gate(world, trained, params):
    """No --spec-pmin: the trained head gates at the governor's measured gate (DraftContext.min_prob)
    once there is one; what it drafts changes, the output does not."""
    from tsspec.spec.governor import GovernorConfig, SpeculationCostGovernor

    result, _ = trained
    target = load_model(world["trunk"], fmt="f32")
    head = load_drafter(result.out, target).draft_head
    prompt = [ord(c) % 256 for c in TEXT[:40]]
    plain = decode(target, Sampler(params), prompt, 60)
    spec = DraftHeadSpeculator(head, target.n_layers, max_draft_tokens=4)
    assert spec.gate_follows_cost
    gates = []
    propose = spec.propose
    spec.propose = lambda ctx: (gates.append(ctx.min_prob), propose(ctx))[1]
    gov = SpeculationCostGovernor(GovernorConfig(margin=100.0))  # no park on a loss mid-hold
    out = decode(target, Sampler(params), prompt, 60, SpecPlan(spec, governor=gov, window=4))
    assert out == plain
    assert any(g is not None for g in gates)  # the measured gate reached the speculator


def test_refuses_another_trunk(world, trained):
    result, _ = trained
    with pytest.raises(BadInput, match="architecture llama.*qwen2.*tsspec distill"):
        load_drafter(result.out, load_model(world["other"]))
    wide = write_tiny_model(world["dir"] / "wide.gguf", arch="llama", d_model=96)
    with pytest.raises(BadInput, match="embedding length 64.*96"):
        load_drafter(result.out, load_model(wide))
    seeded = write_tiny_model(world["dir"] / "seed9.gguf", arch="llama", seed=9)  # same shapes, other weights
    assert load_drafter(result.out, load_model(seeded))  # the vocabulary decides, not the weights


def test_a_trunk_refuses_to_load_a_head_file(trained):
    result, _ = trained
    with pytest.raises(ModelFileError, match="drafter, not a language model"):
        load_model(result.out)


def test_resume_after_interruption_gives_the_uninterrupted_result(world, tmp_path):
    cfg = _cfg(world, tmp_path / "a.gguf", steps=30, eval_every=10)
    full = distill(cfg)

    cut = _cfg(world, tmp_path / "b.gguf", steps=30, eval_every=10)

    def stop_at_15(kind, **d):
        if kind == "metrics" and d["step"] == 20:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        distill(cut, stop_at_15)
    ck = torch.load(str(cut.out) + ".ckpt", weights_only=False)
    assert ck["step"] == 20 and not (tmp_path / "b.gguf").exists()
    seen = []
    resumed = distill(cut, lambda kind, **d: seen.append((kind, d)))
    assert ("resumed", {"step": 20}) in seen
    assert sum(1 for k, d in seen if k == "advance" and "loss" in d) == 10
    assert [d["step"] for k, d in seen if k == "metrics"] == [30]  # no second step-0 measurement
    a = torch.load(str(cfg.out) + ".ckpt", weights_only=False)["head"]
    b = torch.load(str(cut.out) + ".ckpt", weights_only=False)["head"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.heldout == full.heldout
    # a checkpoint from other settings is not silently continued
    with pytest.raises(BadInput, match="other settings"):
        distill(_cfg(world, tmp_path / "b.gguf", steps=30, lr=1e-3))


def test_features_are_the_same_fresh_or_from_the_cache(world, tmp_path):
    """A run trains on what the features cache would give back: the first run (computing them)
    and every later one (loading them) see the same numbers, so the same seed gives the same head."""
    from tsspec.distill.features import Features, collect

    model = load_model(world["trunk"], fmt="f32")
    chunks = [[(7 * i + j) % 250 for j in range(24)] for i in range(3)]
    for taps in (None, (1, 2)):
        fresh = collect(model, chunks, 8, taps=taps)
        fresh.save(tmp_path / "f.pt")
        back = Features.load(tmp_path / "f.pt")
        for f in ("tokens", "hidden", "top_ids", "top_p"):
            a, b = getattr(fresh, f), getattr(back, f)
            assert a.dtype == b.dtype and torch.equal(a, b), (taps, f)


def test_a_checkpoint_resumes_however_its_paths_are_spelled(tmp_path):
    """The same run named through another path (a relative or ``..`` spelling of the model, the
    output reached another way) continues; other training settings do not."""
    (tmp_path / "models").mkdir()
    model = tmp_path / "models" / "m.gguf"
    model.write_bytes(b"")
    a = DistillConfig(model=str(model), out=str(tmp_path / "heads" / "h.gguf"))
    b = DistillConfig(model=str(tmp_path / "models" / ".." / "models" / "m.gguf"),
                      out=str(tmp_path / "models" / ".." / "heads" / "h.gguf"), steps=9000, eval_every=50)
    assert a.resumable_with(b) and b.resumable_with(a)
    assert not a.resumable_with(DistillConfig(model=str(model), out=a.out, lr=1e-3))
    assert not a.resumable_with(DistillConfig(model=str(tmp_path / "other.gguf"), out=a.out))


def test_same_seed_same_head(world, tmp_path):
    a = distill(_cfg(world, tmp_path / "a.gguf", steps=8, eval_every=8))
    b = distill(_cfg(world, tmp_path / "b.gguf", steps=8, eval_every=8))
    c = distill(_cfg(world, tmp_path / "c.gguf", steps=8, eval_every=8, seed=1))
    ta, tb, tc = (load_drafter(r.out, load_model(world["trunk"], fmt="f32")).draft_head for r in (a, b, c))
    h = torch.randn(2, 64)
    assert torch.equal(ta.step_rows([3, 4], h)[1], tb.step_rows([3, 4], h)[1])
    assert not torch.equal(ta.step_rows([3, 4], h)[1], tc.step_rows([3, 4], h)[1])


@pytest.mark.parametrize("kw, msg", [
    (dict(kind="tree"), "--kind 'tree'"),
    (dict(tokens=10), "--tokens must be >= 1024"),
    (dict(unroll=64), "--unroll 64 must be smaller than --chunk 64"),
    (dict(lr=0.0), "--lr must be in"),
    (dict(weights="q4"), "--weights 'q4'"),
    (dict(precision="fp16"), "--precision 'fp16'"),
    (dict(corpus=("/no/such/dir",)), "no such file"),
])
def test_bad_settings_are_one_clear_error(world, tmp_path, kw, msg):
    with pytest.raises(BadInput, match=msg.replace("(", r"\(").replace("'", "'")):
        distill(_cfg(world, tmp_path / "x.gguf", **kw))


def test_out_never_names_a_model(world, tmp_path):
    """-o naming the trunk (however spelled) or another model: refused before any work, the file
    untouched. It used to train, then write the head over the trunk (the cache lost its model)."""
    import shutil

    from clirun import run

    trunk = tmp_path / "trunk.gguf"
    shutil.copyfile(world["trunk"], trunk)
    other = tmp_path / "other.gguf"
    shutil.copyfile(world["other"], other)
    before = trunk.read_bytes(), other.read_bytes()
    (tmp_path / "sub").mkdir()
    for out, msg in ((trunk, "is the trunk's own file"), (tmp_path / "sub" / ".." / "trunk.gguf", "is the trunk's own file"),
                     (other, "is a qwen2 model, not a drafter")):
        with pytest.raises(BadInput, match=msg):
            distill(_cfg(world, out, model=str(trunk)))
        r = run("distill", "-m", str(trunk), "-o", str(out), "--corpus", str(world["corpus"]), "--tokens", "4096")
        assert r.exit_code == 2 and msg in r.output, r.output
    assert (trunk.read_bytes(), other.read_bytes()) == before


def test_bf16_training_learns_and_says_so_in_the_file(world, tmp_path):
    """--precision bf16 runs the training forward under bfloat16 autocast (parameters, optimiser
    and held-out checks stay f32): it still learns, the file loads, and it records the precision."""
    events = []
    r = distill(_cfg(world, tmp_path / "h.gguf", steps=80, eval_every=40, precision="bf16"),
                lambda kind, **d: events.append((kind, d)))
    assert r.precision == "bf16"
    losses = [d["loss"] for k, d in events if k == "advance" and "loss" in d]
    assert np.mean(losses[-10:]) < 0.8 * np.mean(losses[:10])
    assert r.heldout["first"] > r.curve[0][2]
    assert GGUFFile(r.out).get("tsspec-eagle.training.precision") == "bf16"
    head = load_drafter(r.out, load_model(world["trunk"], fmt="f32")).draft_head
    assert torch.isfinite(head.step_rows([3, 4], torch.randn(2, 64))[1]).all()
    # another precision is another run: its checkpoint does not resume this one
    assert not _cfg(world, r.out, precision="bf16").resumable_with(_cfg(world, r.out, precision="f32"))


def test_auto_precision_is_bf16_only_where_the_device_has_it():
    flags = "flags\t\t: fpu vme avx512f avx512_vnni"
    assert resolve_precision("auto", "cpu", flags) == "f32"
    assert resolve_precision("auto", "cpu", flags + " avx512_bf16 amx_tile") == "bf16"
    assert resolve_precision("f32", "cpu", flags + " avx512_bf16") == "f32"
    assert resolve_precision("bf16", "cpu", flags) == "bf16"


# ----------------------------------------------------------------------------- pure pieces


def test_heldout_split_is_stable_and_seed_free(tmp_path):
    srcs = [C.Source(tmp_path / f"f{i}.txt", "user") for i in range(200)]
    train, held = C.split_sources(srcs, 0.1)
    assert 5 < len(held) < 40 and len(train) + len(held) == 200
    assert set(s.path for s in held).isdisjoint(s.path for s in train)
    train2, held2 = C.split_sources(srcs[:100], 0.1)
    assert set(s.path for s in held2) == {s.path for s in held if s in srcs[:100]}


def test_heldout_split_does_not_depend_on_where_the_corpus_sits(tmp_path):
    """The same files under two directories split the same way (a corpus copied elsewhere, or the
    tests' temporary directories, must not change what is trained on)."""
    for root in (tmp_path / "a", tmp_path / "b" / "deeper"):
        (root / "sub").mkdir(parents=True)
        for i in range(60):
            (root / "sub" / f"f{i}.txt").write_text("some text " * 40)
    split = [{s.key for s in C.split_sources(C.user_sources([root]), 0.2)[1]}
             for root in (tmp_path / "a", tmp_path / "b" / "deeper")]
    assert split[0] == split[1] and 0 < len(split[0]) < 60


def test_chunks_are_exact_length():
    chunks = C.chunk_ids([list(range(10)), list(range(100, 103)), list(range(200, 207))], 4)
    assert chunks == [[0, 1, 2, 3], [4, 5, 6, 7], [6, 7, 8, 9], [200, 201, 202, 203], [203, 204, 205, 206]]


def test_default_corpus_has_code_and_prose():
    kinds = {s.kind for s in C.default_sources()}
    assert kinds == {"code", "prose"}


def test_learning_rate_schedule():
    assert lr_at(0, 1000, 1.0) == pytest.approx(0.01)
    assert lr_at(99, 1000, 1.0) == pytest.approx(1.0)
    assert lr_at(1000, 1000, 1.0) == pytest.approx(0.1)
    assert all(lr_at(s, 1000, 1.0) >= lr_at(s + 1, 1000, 1.0) for s in range(100, 1000))


def test_head_step_is_one_definition():
    """The module trains through the same function the adapter runs."""
    m = HeadModule(16, 32, 1e-6, torch.ones(16), 0)
    e, h = torch.randn(2, 16), torch.randn(2, 16)
    assert torch.equal(m.step(e, h), head_step(m.weights(), e, h, 1e-6))
    # the untrained head passes the trunk row through (the best first guess), give or take the init noise
    with torch.no_grad():
        out = m.step(torch.zeros(2, 16), h)
    assert torch.nn.functional.cosine_similarity(out, h).min() > 0.9


# ----------------------------------------------------------------------------- the trunk's own answers


def test_answers_are_the_trunks_greedy_replies_and_are_cached(world, tmp_path, monkeypatch):
    from tsspec.chat import chat_prompt_ids
    from tsspec.distill.selfgen import answer, make_prompts
    from tsspec.tokenizer import Tokenizer

    model = load_model(world["trunk"])
    tok = Tokenizer.from_gguf(world["trunk"])
    texts = [("code", TEXT * 8), ("prose", "Some words about foxes and dogs. " * 30)]
    prompts = make_prompts(texts, 6, 0)
    assert len(prompts) == 6 and prompts == make_prompts(texts, 6, 0) and prompts != make_prompts(texts, 6, 1)
    assert any("```python" in p for p in prompts)
    ticks = []
    convs = answer(model, tok, prompts, 12, 30, tmp_path, "m", progress=ticks.append)
    assert 30 <= sum(ticks) < 30 + 12 and len(convs) >= 3
    for p, c in zip(prompts, convs):
        ids = chat_prompt_ids(tok, [{"role": "user", "content": p}])
        if len(ids) + 12 > model.max_context:  # a long prompt keeps its end
            ids = ids[-(model.max_context - 12):]
        assert c[: len(ids)] == ids
        assert c[len(ids):] == decode(model, Sampler(), ids, len(c) - len(ids))  # greedy, exactly
    # a second call (a resumed run) reads them back instead of decoding again
    monkeypatch.setattr("tsspec.spec.loop.decode", lambda *a, **k: pytest.fail("decoded again"))
    assert answer(model, tok, prompts, 12, 30, tmp_path, "m") == convs


def test_training_with_answers(world, tmp_path):
    events = []
    r = distill(_cfg(world, tmp_path / "a.gguf", steps=4, eval_every=4, answers=200, answer_length=16),
                lambda kind, **d: events.append((kind, d)))
    phases = [d["name"].replace(", cached", "") for k, d in events if k == "phase"]
    assert phases[:3] == ["trunk features (train)", "trunk answers (train)", "trunk features (train answers)"]
    assert "trunk answers (held-out)" in phases
    assert r.train_tokens > 4096  # the corpus chunks plus the packed conversations


# ----------------------------------------------------------------------------- the command


@pytest.mark.parametrize("args, msg", [
    (["--kind", "tree"], "--kind 'tree': choose head or block"),
    (["--device", "tpu"], "--device 'tpu': choose cpu or cuda"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--corpus", "/no/such/place"], "--corpus /no/such/place: no such file or directory"),
])
def test_cli_bad_input_is_one_error_line(world, tmp_path, capsys, args, msg):
    from tsspec.cli import run

    rc = run(["distill", "-m", str(world["trunk"]), "-o", str(tmp_path / "h.gguf"), *args])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert rc != 0 and len(lines) == 1 and lines[0].startswith("error:") and msg in " ".join(err.split()), err
    assert not (tmp_path / "h.gguf").exists()


def test_cli_trains_and_reports(world, tmp_path, capsys, monkeypatch):
    import os

    from tsspec.cli import run

    monkeypatch.setattr(os, "environ", dict(os.environ))  # generate publishes TS_SPEC_* for child processes

    out = tmp_path / "h.gguf"
    rc = run(["distill", "-m", str(world["trunk"]), "-o", str(out), "--corpus", str(world["corpus"]), "--tokens", "2048",
              "--answers", "0", "--steps", "10", "--eval-every", "5", "--batch", "16", "--draft-vocab", "64"])
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 0 and out.exists(), err
    assert "wrote" in err and "held-out acceptance" in err and "--spec-draft-model" in err
    # and generate takes it
    rc = run(["generate", "-m", str(world["trunk"]), "--spec", "--spec-draft-model", str(out), "-p", "def f", "-n", "8"])
    assert rc == 0, capsys.readouterr().err


def test_info_on_a_head_file_says_what_it_is(trained, capsys):
    from tsspec.cli import run

    result, _ = trained
    assert run(["info", str(result.out), "--no-load"]) != 0
    err = " ".join(capsys.readouterr().err.split())
    assert "a tsspec-eagle drafter, not a language model; attach it with --draft-model" in err


def test_residual_keeps_the_trunk_distribution_with_the_trained_heads_q(world, trained, monkeypatch):
    """Under sampling the trained head draws its drafts from its own distribution q (over the trunk's
    vocabulary, zero outside the draft vocabulary) and hands q to the verifier: the ``residual`` rule
    then reproduces the trunk's distribution exactly (chi-square over the first three tokens, as
    tests/test_residual.py does with a draft model), and a wrong rule is caught with this q."""
    import collections

    import tsspec.spec.verify as verify_mod
    from tests.test_residual import PROMPT, TOP_K, chi_square, exact_distribution, resample_from_p
    from tsspec.spec.protocols import DraftContext

    result, _ = trained
    target = load_model(world["trunk"])
    head = load_drafter(result.out, target).draft_head
    spec = DraftHeadSpeculator(head, target.n_layers, max_draft_tokens=2, min_draft_prob=0.0)
    # q is the head's real distribution: spread over several tokens, none outside the draft vocabulary
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=TOP_K, seed=1))
    decode(target, sampler, PROMPT, 1, SpecPlan(spec, window=2))  # gives the head its trunk rows
    draft = spec.propose(DraftContext(PROMPT[-1], len(PROMPT) - 1, 2, PROMPT, sampler=sampler))
    assert draft.probs is not None and len(draft.tokens) == 2
    q = draft.probs[0]
    assert float(q.sum()) == pytest.approx(1.0, abs=1e-5) and 1 < int((q > 0).sum()) <= TOP_K
    assert float(q.max()) < 0.99
    outside = torch.ones(target.vocab_size, dtype=torch.bool)
    outside[head.d2t] = False
    assert float(q[outside].sum()) == 0.0

    n = 2000
    exact = exact_distribution(target, Sampler(SamplingParams(temperature=1.0, top_k=TOP_K)))

    def empirical(stats):
        counts = collections.Counter()
        for seed in range(n):
            s = Sampler(SamplingParams(temperature=1.0, top_k=TOP_K, seed=seed))
            counts[tuple(decode(target, s, PROMPT, 3, SpecPlan(spec, window=2, accept_rule="residual"), stats=stats))] += 1
        return counts

    stats = SpecStats()
    stat, crit = chi_square(empirical(stats), exact, n)
    assert stat < crit, f"residual with the head's q: chi2 {stat:.1f} >= {crit:.1f}"
    assert stats.drafted > 0 and stats.accepted > 0.1 * stats.drafted, (stats.drafted, stats.accepted)
    monkeypatch.setattr(verify_mod, "verify_residual", resample_from_p)
    bad, _ = chi_square(empirical(SpecStats()), exact, n)
    assert bad > crit, f"a wrong rule passed with the head's q: chi2 {bad:.1f} < {crit:.1f}"


def test_compressed_docs_are_read_and_binary_files_are_not(tmp_path):
    import gzip

    with gzip.open(tmp_path / "README.gz", "wt") as f:
        f.write("Introduction\n============\n" * 20)
    (tmp_path / "README").write_bytes(bytes(range(256)) * 20)  # binary under a text-looking name
    (tmp_path / "broken.gz").write_bytes(b"\x1f\x8b not really gzip")
    assert C.read_text(tmp_path / "README.gz").startswith("Introduction\n====")
    assert C.read_text(tmp_path / "README") == ""
    assert C.read_text(tmp_path / "broken.gz") == ""


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, top_k=40, seed=7)],
                         ids=["greedy", "seeded"])
def test_trained_head_trees_equal_plain(world, trained, params):
    """With a node budget the trained head grows its trees (its rows are independent: a depth's best
    nodes step together): the output stays plain's, trees are verified, and greedy they accept more
    a verify than the chains."""
    result, _ = trained
    target = load_model(world["trunk"], fmt="f32")
    head = load_drafter(result.out, target).draft_head
    prompts = [[ord(c) % 256 for c in TEXT[i : i + 40]] for i in (0, 30, 60)]
    got = {}
    for tree in (0, 10):
        accepted = verifies = trees = 0
        for prompt in prompts:
            plain = decode(target, Sampler(params), prompt, 40)
            stats = SpecStats()
            spec = DraftHeadSpeculator(head, target.n_layers, max_draft_tokens=4, min_draft_prob=0.0, tree=tree,
                                       sibling_min=0.0)
            assert spec.grows
            assert decode(target, Sampler(params), prompt, 40, SpecPlan(spec, window=4), stats=stats) == plain
            accepted, verifies, trees = accepted + stats.accepted, verifies + stats.verify_calls, trees + stats.tree_verifies
        got[tree] = (accepted / verifies, trees)
    assert got[0][1] == 0 and got[10][1] > 0
    if params.temperature == 0:
        assert got[10][0] > got[0][0], got
