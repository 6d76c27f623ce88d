"""The command line end to end on tiny random-weight models: output, flags, legacy spellings,
environment variables, and one clear line (never a traceback) for every kind of bad input."""

from __future__ import annotations

import json
import sys

import pytest
from typer.testing import CliRunner

from tiny import write_bad_files, write_tiny_model
from tsspec.cli import app

PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("cli") / "tiny.gguf", arch="llama", seed=3))


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    return write_bad_files(tmp_path_factory.mktemp("bad"))


def run(*args, env=None, input=None):
    env = {k: "" for k in ("TS_SPEC_SPEC", "TS_MTP_SPEC", "TS_SPEC_DRAFT", "TS_MTP_DRAFT", "TS_SPEC_PMIN",
                           "TS_MTP_PMIN", "TS_SPEC_TYPE", "TS_MTP_TYPE")} | (env or {})
    return CliRunner().invoke(app, list(args), env=env, input=input)


def js(result) -> dict:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_generate_plain_text(model):
    r = run("generate", "-m", model, "-p", PROMPT, "-n", "12", "--quiet")
    assert r.exit_code == 0, r.output
    assert r.stdout.strip()  # some text came out
    assert "Traceback" not in r.output


def test_json_result_and_summary_fields(model):
    out = js(run("generate", "-m", model, "-p", PROMPT, "-n", "16", "--json", "--ignore-eos"))
    assert out["generated_tokens"] == 16 == len(out["token_ids"])
    assert out["prompt_tokens"] > 0 and out["decode_tok_s"] > 0
    assert out["stop_reason"] == "length"
    # start-up: the load, and the process's age at the first token (here pytest's: it began first)
    assert 0 < out["load_ms"] < out["first_token_ms"]


def test_spec_output_equals_plain(model):
    plain = js(run("generate", "-m", model, "-p", PROMPT, "-n", "24", "--json", "--ignore-eos"))
    spec = js(run("generate", "-m", model, "-p", PROMPT, "-n", "24", "--json", "--ignore-eos", "--spec",
                  "--spec-type", "ngram", "--spec-draft", "4", "--no-spec-adaptive"))
    assert spec["token_ids"] == plain["token_ids"]
    assert spec["spec"]["speculator"] == "ngram" and spec["spec"]["window"] == 4


def test_sampled_spec_output_equals_plain(model):
    args = ["generate", "-m", model, "-p", PROMPT, "-n", "24", "--json", "--ignore-eos", "--temp", "0.9",
            "--top-k", "40", "--seed", "7"]
    plain = js(run(*args))
    spec = js(run(*args, "--spec", "--spec-type", "ngram", "--no-spec-adaptive"))
    assert spec["token_ids"] == plain["token_ids"]


def test_legacy_spellings(model):
    out = js(run("generate", "-m", model, "-p", PROMPT, "-n", "8", "--json", "--mtp-spec", "--mtp-draft", "3",
                 "--mtp-pmin", "0.5", "--spec-type", "ngram"))
    assert out["spec"]["speculator"] == "ngram" and out["spec"]["window"] == 3


@pytest.mark.parametrize("family", ["TS_SPEC_", "TS_MTP_"])
def test_environment_enables_and_sizes(model, family):
    out = js(run("generate", "-m", model, "-p", PROMPT, "-n", "8", "--json",
                 env={family + "SPEC": "1", family + "TYPE": "ngram", family + "DRAFT": "5"}))
    assert out["spec"]["speculator"] == "ngram" and out["spec"]["window"] == 5


def test_flag_beats_environment_and_disagreement_warns(model):
    r = run("generate", "-m", model, "-p", PROMPT, "-n", "8", "--json", "--spec", "--spec-type", "ngram",
            env={"TS_SPEC_DRAFT": "2", "TS_MTP_DRAFT": "6"})
    assert js(r)["spec"]["window"] == 2
    assert "disagree" in r.stderr
    r = run("generate", "-m", model, "-p", PROMPT, "-n", "8", "--json", "--spec", "--spec-type", "ngram",
            "--spec-draft", "7", env={"TS_SPEC_DRAFT": "2"})
    assert js(r)["spec"]["window"] == 7


def test_no_spec_with_tuning_flags_warns(model):
    r = run("generate", "-m", model, "-p", PROMPT, "-n", "4", "--no-spec", "--spec-draft", "4", "--quiet")
    assert r.exit_code == 0 and "inert" in r.stderr


def test_prompts_jsonl_one_line_each(model, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"id": "a", "text": "hello"}\n{"id": "b", "text": "world"}\n')
    r = run("generate", "-m", model, "--prompts", str(f), "-n", "4", "--json")
    assert r.exit_code == 0, r.output
    lines = [json.loads(x) for x in r.stdout.strip().splitlines()]
    assert [x["id"] for x in lines] == ["a", "b"]


def test_prompt_from_stdin_and_file(model, tmp_path):
    a = js(run("generate", "-m", model, "-n", "6", "--json", "--ignore-eos", input=PROMPT))
    f = tmp_path / "p.txt"
    f.write_text(PROMPT)
    b = js(run("generate", "-m", model, "-f", str(f), "-n", "6", "--json", "--ignore-eos"))
    assert a["token_ids"] == b["token_ids"]


def test_help_keeps_square_brackets():
    """rich reads [word] in help text as markup and drops it: such text must be escaped."""
    r = CliRunner().invoke(app, ["bench", "--help"], env={"COLUMNS": "250"})
    assert r.exit_code == 0
    assert "[configs.NAME] tables" in r.output and "tsspec[plot]" in r.output


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "info", "pull", "distill", "export-hf", "models", "bench"])
def test_help_description_wraps_to_the_terminal(command):
    """A command's description fills an 80-column terminal line by line: no line inside a paragraph
    ends early because the docstring's own line break was kept."""
    r = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    start = next(i for i, x in enumerate(lines) if "Usage:" in x) + 1
    end = next(i for i, x in enumerate(lines) if x.lstrip().startswith("╭"))  # the first panel
    body = [x.strip() for x in lines[start:end]]
    for i, line in enumerate(body[:-1]):
        if line and body[i + 1]:  # not the last line of its paragraph
            assert len(line) >= 60, f"{command}: {line!r} breaks early, before {body[i + 1]!r}"


def test_ctx_size_above_the_trained_context_is_capped_with_a_warning(model):
    """The tiny model is trained to 256 tokens: a larger --ctx-size runs at 256 and says so once."""
    r = run("generate", "-m", model, "-p", PROMPT, "-n", "4", "-c", "100000", "--json")
    assert js(r)["generated_tokens"] >= 1
    warns = [x for x in r.stderr.splitlines() if "trained context" in x]
    assert len(warns) == 1 and "--ctx-size 100000" in warns[0] and "(256 tokens); using 256" in warns[0], r.stderr
    quiet = run("generate", "-m", model, "-p", PROMPT, "-n", "4", "-c", "256", "--json")
    assert "trained context" not in quiet.stderr, quiet.stderr


def test_info(model):
    r = run("info", model)
    assert r.exit_code == 0, r.output
    assert "llama" in r.stdout and "ngram" in r.stdout


def one_error_line(r, code, needle):
    assert r.exit_code == code, r.output
    assert "Traceback" not in r.output
    lines = [x for x in r.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    assert needle in lines[0], lines[0]


@pytest.mark.parametrize(
    "which, code, needle",
    [
        ("truncated", 3, "truncated"),
        ("bad_magic", 3, "not a GGUF"),
        ("empty", 3, "GGUF"),
        ("unknown_arch", 3, "mamba9"),
        ("missing_tensor", 3, "missing tensor"),
        ("shape_mismatch", 3, "ffn_gate"),
    ],
)
def test_bad_model_files(bad, which, code, needle):
    one_error_line(run("generate", "-m", str(bad[which]), "-p", "hi", "-n", "2"), code, needle)


def test_missing_file_and_unknown_name():
    one_error_line(run("generate", "-m", "/nonexistent/x.gguf", "-p", "hi"), 2, "model not found")
    one_error_line(run("generate", "-m", "smollm3-999m", "-p", "hi"), 2, "known model")


def test_prompt_longer_than_context(model):
    one_error_line(run("generate", "-m", model, "-p", PROMPT * 20, "-n", "8", "-c", "64"), 2, "exceeds the context")


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--spec-draft", "0", "--spec"], "--spec-draft"),
        (["--spec-draft", "65", "--spec"], "out of range"),
        (["--spec-pmin", "2", "--spec"], "--spec-pmin"),
        (["--temp", "-1"], "--temp"),
        (["--top-p", "0"], "--top-p"),
        (["-n", "0"], "--max-tokens"),
        (["--spec-type", "medusa", "--spec"], "unknown speculator"),
        (["--chat-template-kwargs", "{bad", "--chat"], "--chat-template-kwargs"),
        (["--weights", "int3"], "--weights"),
    ],
)
def test_bad_flag_values(model, args, needle):
    one_error_line(run("generate", "-m", model, "-p", "hi", *args), 2, needle)


def test_bench_config_typo_is_one_line(model):
    """``bench --config ngram:drfat=4`` used to run ngram's defaults and report them as asked."""
    one_error_line(run("bench", "-m", model, "--config", "ngram:drfat=4", "-n", "4"), 2, "did you mean draft")


@pytest.mark.parametrize("args, needle", [
    (["--reps", "0"], "--reps must be >= 1, got 0"),
    (["--warmup", "-1"], "--warmup must be >= 0, got -1"),
    (["--config", "draft-head:path=/nonexistent/head.gguf"], "config draft-head:path=/nonexistent/head.gguf: model not found"),
    (["--config", "d=draft-model", "--draft-model", "qwen9"], "--draft-model: model not found: qwen9"),
    # an output path that is a directory: IsADirectoryError (a traceback) after the whole run
    (["--json", "/"], "--json /: is a directory"),
    (["--csv", "/tmp"], "--csv /tmp: is a directory"),
    (["--plot", "/"], "--plot /: is a directory"),
])
def test_bench_refuses_bad_settings_before_loading_the_trunk(args, needle):
    """The trunk named here does not exist: the error about the setting comes first, so a user does
    not wait for a model to load to learn it (the checks used to run inside the rotation)."""
    one_error_line(run("bench", "-m", "/nonexistent/trunk.gguf", "-n", "4", *args), 2, needle)


def test_bad_environment_value(model):
    one_error_line(run("generate", "-m", model, "-p", "hi", env={"TS_MTP_DRAFT": "lots"}), 2, "TS_MTP_DRAFT")


def test_declined_speculator_is_one_line(model):
    one_error_line(run("generate", "-m", model, "-p", "hi", "--spec", "--spec-type", "draft-head"), 2, "draft head")


def test_no_prompt(model):
    one_error_line(run("generate", "-m", model, input=""), 2, "no prompt")


def test_bad_kernels_switch_is_one_line(model, monkeypatch):
    from test_kernels import fresh_kernels

    fresh_kernels(monkeypatch)  # the value is read when the library is first wanted
    r = run("generate", "-m", model, "-n", "2", "-p", "hi", env={"TSSPEC_KERNELS": "maybe"})
    one_error_line(r, 2, "TSSPEC_KERNELS")


def test_absurd_omp_num_threads_is_one_line_not_a_segfault(model, monkeypatch):
    """OMP_NUM_THREADS=100000: the native kernels' repack (an OpenMP region in a loader thread)
    segfaulted, exit 139. A count the runtime can hold still runs."""
    from test_kernels import fresh_kernels
    from tsspec.settings import MAX_THREADS_PER_CPU, check_omp_threads

    for value in ("100000", "2,100000"):
        fresh_kernels(monkeypatch)  # the value is read when the library is first wanted
        r = run("generate", "-m", model, "-n", "2", "-p", "hi", env={"OMP_NUM_THREADS": value})
        one_error_line(r, 2, f"OMP_NUM_THREADS={value!r}: at most")
    for fine in ("1", "abc", "", str(MAX_THREADS_PER_CPU)):
        check_omp_threads({"OMP_NUM_THREADS": fine})


def test_bench_json_records_what_ran(model, tmp_path):
    """Provenance: the trunk's formats as used (not the requested name), the drafter's format, the
    spec environment, the commit, and per-prompt ratios over prompt-level intervals."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("one two three\n\nfour five six seven\n\neight nine\n", encoding="utf-8")
    out = tmp_path / "b.json"
    r = run("bench", "-m", model, "-w", str(prompts), "--config", "ngram", "-n", "4", "--reps", "1",
            "--warmup", "0", "--json", str(out), env={"TSSPEC_DRAFT_WEIGHTS": "bf16"})
    assert r.exit_code == 0, r.output
    d = json.loads(out.read_text())
    meta = d["metadata"]
    assert meta["weights"] and all(isinstance(n, int) for n in meta["weights"].values())
    assert meta["draft_weights"] == "bf16" and meta["env"]["TSSPEC_DRAFT_WEIGHTS"] == "bf16"
    assert set(meta["git"]) == {"commit", "dirty", "dirty_files"}
    assert "model" in meta["machine"]["cpu"] and "native" in meta["kernels"]
    assert meta["load_ms"] > 0
    ng = [c for c in d["workloads"][0]["configs"] if c["config"]["name"] == "ngram"][0]
    assert len(ng["per_prompt_ratio"]) == 3 and ng["ratio"]["n_groups"] == 3


def test_bench_keep_cache_is_recorded_and_refused_beside_a_peer(model, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("the same long instruction, then one\n\nthe same long instruction, then two\n", encoding="utf-8")
    out = tmp_path / "b.json"
    r = run("bench", "-m", model, "-w", str(prompts), "--config", "ngram", "-n", "4", "--reps", "1",
            "--warmup", "0", "--keep-cache", "--json", str(out))
    assert r.exit_code == 0, r.output
    d = json.loads(out.read_text())
    assert d["metadata"]["keep_cache"] is True and d["ok"]
    assert "--keep-cache" in " ".join(r.output.split())  # the table says how its runs started
    r = run("bench", "-m", model, "-w", str(prompts), "--keep-cache", "--peer", "llama.cpp")
    assert r.exit_code != 0 and "--keep-cache" in r.output and "Traceback" not in r.output


def test_a_scripted_run_reports_its_time_to_first_token(model):
    """A process of its own: the first token's time counts from that process's start, so it lies
    between the load (inside it) and the wall time seen from outside."""
    import subprocess
    import sys
    import time

    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "tsspec", "generate", "-m", model, "-p", PROMPT, "-n", "2", "--json",
                        "--no-spec"], capture_output=True, text=True, timeout=300)
    wall_ms = (time.perf_counter() - t0) * 1000.0
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    # the process's start is read from /proc in clock ticks, and /proc/uptime in hundredths: the age
    # may run up to two ticks over (a run without torch takes ~0.4 s here, so the margin shows)
    tick_ms = 1000.0 / __import__("os").sysconf("SC_CLK_TCK")
    assert 0 < out["load_ms"] < out["first_token_ms"] < wall_ms + 2 * tick_ms


def test_python_dash_m_runs_the_cli():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "tsspec", "models"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "smollm2-135m" in r.stdout


def test_the_process_ends_without_teardown_once_its_output_is_flushed(tmp_path):
    """``tsspec``'s entry point flushes what the command wrote and ends the process with its status
    at once (``__main__.quick_exit``); ``cli.main`` called as a function still raises SystemExit, so a
    script that wraps it goes on; a flush that fails takes the ordinary exit."""
    import subprocess

    code = ("import sys, tsspec.__main__ as m, tsspec.cli as c\n"
            "c.main = lambda: (print('out', end=''), print('err', end='', file=sys.stderr), sys.exit(3))\n"
            "m.main()\n"
            "print('never')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout, r.stderr) == (3, "out", "err")
    wrapped = ("import tsspec.cli as c\n"
               "try:\n    c.main(['info', '--help'])\nexcept SystemExit as e:\n    print('went on', e.code)\n")
    r = subprocess.run([sys.executable, "-c", wrapped], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.rstrip().endswith("went on 0"), r.stdout + r.stderr

    class Refuses:
        def flush(self):
            raise OSError("no space left")

    from tsspec.__main__ import quick_exit

    real = sys.stdout
    sys.stdout = Refuses()
    try:
        with pytest.raises(SystemExit) as e:
            quick_exit(5)
    finally:
        sys.stdout = real
    assert e.value.code == 5
