"""The operator contract the design document states, item by item (issue 37, section 4).

* a speculator that does not say whether it arms after a reused prefix is taken to say no;
* heads and block drafters load in the drafter format (``--draft-weights``, ``TSSPEC_DRAFT_WEIGHTS``);
* the window published as ``TS_SPEC_DRAFT``/``TS_MTP_DRAFT`` is the one that runs;
* the legacy spellings on every command that takes the speculation flags;
* what ``bench`` and ``info`` read of the two families;
* a hybrid trunk's rollback memory in ``info``, ``--json`` and the live display;
* ``TS_QWEN35_DFLASH`` attaches a drafter.
"""

from __future__ import annotations

import pytest

from scripted import ScriptedSpeculator
from tiny import write_tiny_model
from tsspec.spec.plan import SpecPlan
from tsspec.models import load_model
from tsspec.sampling import Sampler
from tsspec.spec.loop import decode
from tsspec.spec.stats import SpecStats

GREEDY = Sampler()
PROMPT = [(7 * i + 40) % 250 for i in range(20)]
MORE = [100, 101, 102, 103, 104, 50, 100, 101, 102]


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("contract") / "llama.gguf", "llama", seed=7, ctx=512)


@pytest.fixture(scope="module")
def llama(llama_path):
    return load_model(llama_path)


# ----------------------------------------------------------------------------- speculator defaults


class Silent:
    """A speculator that never mentions ``can_arm_after_prefix_reuse`` (everything else delegated)."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        if name == "can_arm_after_prefix_reuse":
            raise AttributeError(name)
        return getattr(self.inner, name)


def test_arming_after_prefix_reuse_defaults_to_false(llama):
    """The design's default: a speculator without ``can_arm_after_prefix_reuse`` is left out of a
    sequence that begins from a reused prefix (no AttributeError in ``DecodeState.begin``), and drafts
    as usual on a fresh cache."""
    m = llama
    turn2 = PROMPT + decode(m, GREEDY, PROMPT, 8) + MORE
    want = decode(m, GREEDY, turn2, 24)
    cache = m.make_cache()
    decode(m, GREEDY, PROMPT, 8, cache=cache)
    spec = Silent(ScriptedSpeculator(turn2 + want, lambda s, i: False, m.vocab_size))
    assert not hasattr(spec, "can_arm_after_prefix_reuse")
    stats = SpecStats()
    assert decode(m, GREEDY, turn2, 24, SpecPlan(spec), cache=cache, stats=stats) == want
    assert stats.speculator is None and spec.drafts == []
    fresh = Silent(ScriptedSpeculator(turn2 + want, lambda s, i: False, m.vocab_size))
    assert decode(m, GREEDY, turn2, 24, SpecPlan(fresh)) == want
    assert fresh.drafts  # no reused prefix: it drafts


# ----------------------------------------------------------------------------- drafter formats


def _linears(obj, seen=None) -> list:
    """Every ``Linear`` reachable from ``obj`` (attributes, lists, dicts), each once."""
    from tsspec.weights import Linear

    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, (str, bytes, int, float, type(None))):
        return []
    seen.add(id(obj))
    if isinstance(obj, Linear):
        return [obj]
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("tsspec"):
        items = list(vars(obj).values())
    elif hasattr(obj, "__slots__") and type(obj).__module__.startswith("tsspec"):
        items = [getattr(obj, s, None) for s in obj.__slots__]
    else:
        return []
    return [lin for it in items for lin in _linears(it, seen)]


def _own_formats(drafter, trunk) -> set[str]:
    """The formats of the drafter's own matrices (what it borrows from the trunk left out)."""
    theirs = {id(lin) for lin in _linears(trunk)}
    return {lin.fmt for lin in _linears(drafter) if id(lin) not in theirs}


@pytest.fixture(scope="module")
def drafter_files(tmp_path_factory):
    """One file of each drafter kind with the trunk each binds to: a draft model, a block drafter, a
    NextN head (for a hybrid trunk) and a trained per-token head (``tsspec distill``)."""
    from tiny_dflash import write_tiny_dflash
    from tiny_hybrid import write_hybrid, write_nextn_only

    d = tmp_path_factory.mktemp("drafters")
    trunk = write_tiny_model(d / "trunk.gguf", "qwen3", n_layers=4, seed=3)
    hybrid, hf = write_hybrid(d / "hybrid.gguf")
    return {
        "draft-model": (trunk, write_tiny_model(d / "small.gguf", "qwen3", n_layers=1, seed=4)),
        "block": (trunk, write_tiny_dflash(d / "block.gguf", trunk, dflash2=True)),
        "nextn": (hybrid, write_nextn_only(d / "nextn.gguf", hf)),
    }


@pytest.mark.parametrize("kind", ["draft-model", "block", "nextn"])
def test_every_drafter_kind_takes_the_drafter_format(drafter_files, kind):
    """``DrafterOptions.weights`` (``--draft-weights`` / ``TSSPEC_DRAFT_WEIGHTS``) sets the format
    of a head's and a block drafter's own matrices as it does a draft model's; unset, they follow
    the trunk's. (Heads and block drafters used to load in the trunk's format whatever was asked.)"""
    from tsspec.drafters import DrafterOptions, load_drafter

    trunk_path, path = drafter_files[kind]
    trunk = load_model(trunk_path, fmt="bf16")
    assert _own_formats(load_drafter(path, trunk, DrafterOptions(weights="f32")), trunk) == {"f32"}
    # int4 requantizes what its groups fit (a tiny matrix too narrow for them stays bf16)
    assert "int4" in _own_formats(load_drafter(path, trunk, DrafterOptions(weights="int4")), trunk)
    assert {lin.fmt for lin in _linears(trunk)} == {"bf16"}  # the trunk is untouched
    assert _own_formats(load_drafter(path, trunk), trunk) == {"bf16"}  # unset: the trunk's


def test_trained_head_takes_the_drafter_format(tmp_path, monkeypatch):
    """The per-token head ``tsspec distill`` writes, likewise."""
    from tsspec.distill.train import DistillConfig, distill
    from tsspec.drafters import DrafterOptions, load_drafter

    monkeypatch.setenv("TSSPEC_CACHE", str(tmp_path / "cache"))
    trunk_path = write_tiny_model(tmp_path / "trunk.gguf", arch="llama", vocab_size=300, d_model=64, n_layers=2)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"f{i}.txt").write_text(f"def add{i}(a, b):\n    return a + b\n" * 100)
    out = tmp_path / "head.gguf"
    distill(DistillConfig(model=str(trunk_path), out=str(out), corpus=(str(corpus),), tokens=1024,
                          heldout_tokens=256, steps=2, batch=16, chunk=64, draft_vocab=64, eval_every=2,
                          weights="f32", precision="f32", answers=0), lambda kind, **d: None)
    trunk = load_model(trunk_path, fmt="bf16")
    assert _own_formats(load_drafter(out, trunk, DrafterOptions(weights="f32")), trunk) == {"f32"}
    assert _own_formats(load_drafter(out, trunk), trunk) == {"bf16"}


def test_the_drafter_format_resolves_flag_over_environment_over_the_trunks():
    from tsspec.errors import BadInput
    from tsspec.settings import resolve_run

    assert resolve_run(env={}).draft_weights == "auto"
    assert resolve_run(weights="f32", env={}).draft_weights == "f32"  # like the trunk
    assert resolve_run(env={"TSSPEC_WEIGHTS": "bf16"}).draft_weights == "bf16"
    assert resolve_run(weights="f32", env={"TSSPEC_DRAFT_WEIGHTS": "int4"}).draft_weights == "int4"
    assert resolve_run(draft_weights="bf16", env={"TSSPEC_DRAFT_WEIGHTS": "int4"}).draft_weights == "bf16"
    with pytest.raises(BadInput, match="--draft-weights 'q3'"):
        resolve_run(draft_weights="q3", env={})
    with pytest.raises(BadInput, match="TSSPEC_DRAFT_WEIGHTS"):
        resolve_run(env={"TSSPEC_DRAFT_WEIGHTS": "q3"})


# ----------------------------------------------------------------------------- the published environment


@pytest.fixture(scope="module")
def hybrid_path(tmp_path_factory):
    from tiny_hybrid import write_hybrid

    return write_hybrid(tmp_path_factory.mktemp("hybrid") / "q35.gguf")[0]


def _published(monkeypatch, *args, env=None, input=None) -> dict:
    """What ``tsspec ARGS`` publishes for child processes (``tsspec.settings.publish_spec``)."""
    import tsspec.settings
    from clirun import run

    seen: dict[str, str] = {}
    real = tsspec.settings.publish_spec
    monkeypatch.setattr(tsspec.settings, "publish_spec", lambda opts, env=None: real(opts, seen))
    r = run(*args, env=env, input=input)
    assert r.exit_code == 0, r.output
    return seen


@pytest.mark.parametrize("extra, env, want", [
    ((), None, "3"),  # the hybrid trunk's preference
    (("--spec-draft", "5"), None, "5"),  # the user's choice wins
    ((), {"TS_MTP_DRAFT": "6"}, "6"),
])
def test_generate_publishes_the_window_that_runs(monkeypatch, hybrid_path, extra, env, want):
    """A hybrid trunk runs a window of 3 under the default 8: ``TS_SPEC_DRAFT`` and ``TS_MTP_DRAFT``
    say 3 (they said 8, the value before the model's preference)."""
    seen = _published(monkeypatch, "generate", "-m", str(hybrid_path), "-p", "abc", "-n", "3", "-q",
                      "--spec", "--spec-type", "ngram", *extra, env=env)
    assert seen["TS_SPEC_DRAFT"] == seen["TS_MTP_DRAFT"] == want
    assert seen["TS_SPEC_SPEC"] == seen["TS_MTP_SPEC"] == "1" and seen["TS_MTP_TYPE"] == "ngram"


def test_a_draft_models_window_is_published(tmp_path):
    """A draft model prefers 4: the session's options say so, and so does what is published."""
    from tsspec.options import SpecOptions
    from tsspec.session import Session
    from tsspec.settings import publish_spec, resolve_run

    trunk = write_tiny_model(tmp_path / "t.gguf", "llama", seed=2)
    small = write_tiny_model(tmp_path / "d.gguf", "llama", seed=3, n_layers=1)
    s = Session.open(resolve_run(model=str(trunk), env={}))
    spec = s.speculation(SpecOptions(enabled=True, draft_model=str(small)))
    assert spec.plan.window == spec.options.draft == 4
    env: dict[str, str] = {}
    publish_spec(spec.options, env)
    assert env["TS_SPEC_DRAFT"] == env["TS_MTP_DRAFT"] == "4" and env["TS_MTP_DRAFT_MODEL"] == str(small)
    off = s.speculation(SpecOptions())
    assert off.options == SpecOptions()  # speculation off: the settings as resolved


LEGACY = {"--mtp-spec", "--no-mtp-spec", "--mtp-draft", "--mtp-pmin", "--mtp-draft-model", "--mtp-tree"}


def _option_names(command: str) -> set[str]:
    import typer.main

    from tsspec.cli import app

    cmd = typer.main.get_command(app).commands[command]
    return {n for p in cmd.params for n in (*p.opts, *p.secondary_opts)}


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_legacy_spellings_on_every_speculating_command(command):
    assert LEGACY <= _option_names(command)


def test_bench_takes_the_drafter_flag_in_every_spelling():
    """``bench``'s configurations carry the speculation settings; the one it takes from a flag is
    the drafter, spelled as ``--draft-model``, ``--spec-draft-model`` or ``--mtp-draft-model``."""
    from clirun import entry

    assert {"--draft-model", "--spec-draft-model", "--mtp-draft-model"} <= _option_names("bench")
    code, _out, err = entry("bench", "--mtp-draft-model", "/nonexistent/d.gguf", "-n", "4")
    assert code in (2, 3) and err.count("error:") == 1 and "--draft-model" in err and "/nonexistent/d.gguf" in err


@pytest.mark.parametrize("command", ["chat", "serve"])
def test_mtp_spec_disagreeing_with_spec_is_refused(command):
    from clirun import entry

    code, _out, err = entry(command, "--mtp-spec", "--no-spec", "-m", "/nonexistent.gguf")
    assert code == 2 and "--spec and --mtp-spec disagree" in err


def test_chat_takes_mtp_spec(monkeypatch, llama_path):
    seen = _published(monkeypatch, "chat", "-m", str(llama_path), "-n", "2", "--mtp-spec", "--spec-type", "ngram",
                      input="hello\n")
    assert seen["TS_SPEC_SPEC"] == "1" and seen["TS_MTP_TYPE"] == "ngram"


def test_serve_takes_mtp_spec(monkeypatch, llama_path):
    import tsspec.cli

    monkeypatch.setattr(tsspec.cli, "_serve_until_stopped", lambda *a, **k: True)
    seen = _published(monkeypatch, "serve", "-m", str(llama_path), "--port", "18093", "--mtp-spec", "--mtp-draft", "3")
    assert seen["TS_SPEC_SPEC"] == "1" and seen["TS_MTP_DRAFT"] == "3"


# ----------------------------------------------------------------------------- TS_QWEN35_DFLASH


def test_ts_qwen35_dflash_attaches_a_block_drafter_to_a_qwen35_trunk(monkeypatch, hybrid_path, tmp_path):
    """``TS_QWEN35_DFLASH=FILE tsspec generate`` speculates with that block drafter, as
    ``--draft-model FILE`` would; what runs is published for child processes."""
    from tiny_dflash import write_tiny_dflash

    drafter = write_tiny_dflash(tmp_path / "dflash2.gguf", hybrid_path, dflash2=True)
    seen = _published(monkeypatch, "generate", "-m", str(hybrid_path), "-p", "abc", "-n", "3", "-q",
                      env={"TS_QWEN35_DFLASH": str(drafter)})
    assert seen["TS_SPEC_SPEC"] == "1" and seen["TS_SPEC_DRAFT_MODEL"] == str(drafter)
    assert seen["TS_SPEC_DRAFT"] == "3"  # the hybrid trunk's window

    from tsspec.session import Session
    from tsspec.settings import resolve_run

    none = dict(enabled=None, type=None, draft=None, pmin=None, draft_model=None, accept=None, adaptive=None,
                block_drafter=None)
    s = Session.open(resolve_run(model=str(hybrid_path), speculation=none, env={"TS_QWEN35_DFLASH": str(drafter)}))
    assert s.speculation().plan.speculator.name == "block"


def test_ts_qwen35_dflash_is_not_attached_to_another_trunk(llama_path, hybrid_path, tmp_path):
    """Exported for a Qwen 3.5 trunk, the variable does not refuse a run of another model: a
    warning says it is not attached, the run is plain (or speculates as its flags say), and
    ``info`` reports no drafter."""
    import json

    from clirun import run
    from tiny_dflash import write_tiny_dflash

    drafter = str(write_tiny_dflash(tmp_path / "dflash2.gguf", hybrid_path, dflash2=True))
    env = {"TS_QWEN35_DFLASH": drafter}
    r = run("generate", "-m", str(llama_path), "-p", "abc", "-n", "3", "--json", env=env)
    assert r.exit_code == 0, r.output
    assert "TS_QWEN35_DFLASH names a drafter for qwen35 trunks; llama.gguf is llama: not attached" in " ".join(
        r.stderr.split())
    assert json.loads(r.stdout.strip().splitlines()[-1])["spec"]["speculator"] is None
    r = run("generate", "-m", str(llama_path), "-p", "abc", "-n", "3", "--json", "--spec", "--spec-type", "ngram",
            env=env)
    assert r.exit_code == 0 and json.loads(r.stdout.strip().splitlines()[-1])["spec"]["speculator"] == "ngram"
    r = run("info", str(llama_path), env=env)
    assert r.exit_code == 0 and "auto would use: draft-head -> ngram" in r.stdout and "not attached" in r.stderr


# ----------------------------------------------------------------------------- rollback memory


def test_rollback_memory_of_each_trunk_kind(hybrid_path, llama):
    from tsspec.spec.loop import rollback_memory_bytes

    slots = load_model(hybrid_path, fmt="f32")
    assert rollback_memory_bytes(llama, 3) == 0  # a KV cache's trim is arithmetic
    assert rollback_memory_bytes(slots, 3) == slots.rollback_state_bytes(3) > 0
    assert rollback_memory_bytes(slots, 8) > rollback_memory_bytes(slots, 3)
    copy = load_model(hybrid_path, fmt="f32", verify_snapshots=False)
    assert rollback_memory_bytes(copy, 3) == copy.state_bytes() == rollback_memory_bytes(copy, 8)


def test_rollback_memory_in_the_json_and_the_live_display(hybrid_path):
    """``generate --json`` carries a hybrid trunk's rollback memory per sequence (``spec.rollback_bytes``,
    0 with speculation off), and the live panel and the summary line show it."""
    import json

    from clirun import run

    from tsspec.display import human_bytes, stats_table, summary_line

    want = load_model(hybrid_path, fmt="f32").rollback_state_bytes(3)
    args = ("generate", "-m", str(hybrid_path), "-p", "abc", "-n", "3", "--json")
    r = run(*args, "--spec", "--spec-type", "ngram")
    assert r.exit_code == 0, r.output
    spec = json.loads(r.stdout.strip().splitlines()[-1])["spec"]
    # what the cache holds at the end, as allocated (issue 50): never past the window's two buffers
    # of window + 1 rows; here the 3-token prompt's rows (tests/test_hybrid_memory.py checks the bytes)
    assert spec["window"] == 3 and 0 < spec["rollback_bytes"] <= want
    r = run(*args)
    assert json.loads(r.stdout.strip().splitlines()[-1])["spec"]["rollback_bytes"] == 0

    from rich.console import Console

    stats = SpecStats(speculator="ngram", window=3, rollback_bytes=want)
    con = Console(width=100, record=True)
    con.print(stats_table(stats))
    assert f"rollback memory  {human_bytes(want)}" in con.export_text()

    class Result:
        prompt_tokens, token_ids = 3, [1, 2]

    Result.stats = stats
    assert f"rollback memory {human_bytes(want)}" in summary_line(Result)
    Result.stats = SpecStats(speculator="ngram", window=3)
    assert "rollback memory" not in summary_line(Result)  # a KV-cache trunk holds none


def test_human_bytes():
    from tsspec.display import human_bytes

    assert [human_bytes(n) for n in (0, 999, 1000, 123456, 151_000_000, 2_500_000_000)] == [
        "0 B", "999 B", "1 KB", "123 KB", "151 MB", "2.5 GB"]


# ----------------------------------------------------------------------------- what info and bench read


def test_info_shows_the_rollback_memory_and_reads_the_window(hybrid_path):
    """``tsspec info`` on a hybrid trunk: its rollback memory per sequence at the window that would
    run (the trunk's 3, or ``TS_SPEC_DRAFT`` / ``TS_MTP_DRAFT``: info reads the window and the
    drafter of both families), or one state copy in copy mode."""
    from clirun import run

    from tsspec.display import human_bytes

    m = load_model(hybrid_path, fmt="f32")
    r = run("info", str(hybrid_path))
    assert r.exit_code == 0, r.output
    assert f"rollback memory: {human_bytes(m.rollback_state_bytes(3))} per sequence at window 3" in r.stdout
    r = run("info", str(hybrid_path), env={"TS_MTP_DRAFT": "6"})
    assert f"rollback memory: {human_bytes(m.rollback_state_bytes(6))} per sequence at window 6" in r.stdout
    r = run("info", str(hybrid_path), env={"TS_Q35_VERIFY_SNAPSHOTS": "0"})
    assert f"rollback memory: {human_bytes(m.state_bytes())} per sequence at window 3 (one copy" in r.stdout


def test_info_reads_the_drafter_from_the_environment(llama_path, tmp_path):
    from clirun import run

    small = write_tiny_model(tmp_path / "d.gguf", "llama", seed=3, n_layers=1)
    r = run("info", str(llama_path))
    assert "auto would use: draft-head -> ngram" in r.stdout
    for name in ("TS_SPEC_DRAFT_MODEL", "TS_MTP_DRAFT_MODEL"):
        r = run("info", str(llama_path), env={name: str(small)})
        assert r.exit_code == 0, r.output
        assert "auto would use: draft-model -> draft-head -> ngram" in r.stdout, name
    assert "rollback memory" not in r.stdout  # a KV-cache trunk


def test_bench_names_the_speculation_variables_it_does_not_read(llama_path, tmp_path):
    """``bench``'s configurations say what each one runs: a set variable of either family (or
    ``TS_QWEN35_DFLASH``) changes nothing, and a warning names it."""
    from clirun import entry

    prompts = tmp_path / "p.txt"
    prompts.write_text("one two three four\n")
    args = ("bench", "-m", str(llama_path), "-w", str(prompts), "--config", "ngram", "-n", "3", "--reps", "1",
            "--warmup", "0")
    code, out, err = entry(*args, env={"TS_SPEC_DRAFT": "2", "TS_MTP_SPEC": "0", "TS_QWEN35_DFLASH": "x.gguf"})
    assert code == 0, err
    assert ("bench reads no speculation variable (each --config says what it runs): "
            "TS_MTP_SPEC, TS_QWEN35_DFLASH, TS_SPEC_DRAFT ignored") in " ".join(err.split())
    code, out, err = entry(*args)
    assert code == 0 and "speculation variable" not in err
