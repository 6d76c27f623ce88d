"""``tsspec bench --peer llama.cpp``: the peer's server lifecycle, requests and timings, and the
bench's per-engine judgement (ratios against the engine's own plain runs, text equal to its own
plain text), against a stand-in ``llama-server`` executable on loopback.

The stand-in is a small Python HTTP server that takes llama-server's command line, so what is
tested is tsspec's side: the command lines it starts, the bodies it sends, how it reads the answers,
and what the bench makes of them. The real llama-server is exercised by
``scripts/reproduce_results.sh`` (it needs the ~10 minute peer build).
"""

from __future__ import annotations

import json
import stat
import sys
import textwrap
from pathlib import Path

import pytest

from tsspec.bench import llama_server
from tsspec.bench.configs import BenchConfig, parse_configs
from tsspec.bench.runner import RunRecord, run_bench
from tsspec.bench.workloads import Prompt, Workload
from tsspec.errors import BadInput, TsspecError

FAKE = textwrap.dedent('''\
    #!{python}
    """Stand-in llama-server: greedy "continuation" = prompt ids reversed, cycled; a speculative mode
    changes one token on prompts whose first id is odd (llama.cpp's drift at near-ties)."""
    import json, sys, time
    from http.server import BaseHTTPRequestHandler, HTTPServer
    argv = sys.argv[1:]
    port = int(argv[argv.index("--port") + 1])
    mode = argv[argv.index("--spec-type") + 1] if "--spec-type" in argv else "?"
    log = open({log!r}, "a")
    log.write(json.dumps({{"argv": argv}}) + "\\n"); log.flush()
    if "--fail" in argv or mode == "ngram-cache":
        sys.exit(3)
    # a model named *sigill*: the server dies with SIGILL while starting, as llama.cpp b11434's
    # repacked buffers do on a machine that advertises AMX without granting it, unless it runs with
    # --no-repack; *sigill-request*: at its first request instead
    model_name = argv[argv.index("-m") + 1]
    sigill = "sigill" in model_name and "--no-repack" not in argv
    if sigill and "sigill-request" not in model_name:
        import os, signal
        os.kill(os.getpid(), signal.SIGILL)
    # *segv*: SIGSEGV while starting, as the same buffers die on other hosts of that kind
    if "segv" in model_name and "--no-repack" not in argv:
        import os, signal
        os.kill(os.getpid(), signal.SIGSEGV)

    class H(BaseHTTPRequestHandler):
        def _send(self, obj):
            data = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._send({{"status": "ok"}})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if sigill:
                import os, signal
                os.kill(os.getpid(), signal.SIGILL)
            log.write(json.dumps({{"mode": mode, "body": body}}) + "\\n"); log.flush()
            p, n = body["prompt"], body["n_predict"]
            toks = [p[::-1][i % len(p)] for i in range(n)]
            spec = mode not in ("none", "?")
            if spec and p[0] % 2 == 1:
                toks[n // 2] += 1
            speed = 50.0 * (1.5 if spec else 1.0)
            t = {{"prompt_n": len(p), "prompt_ms": 2.0 * len(p), "predicted_n": n,
                 "predicted_ms": 1000.0 * n / speed, "predicted_per_second": speed}}
            if spec:
                t.update(draft_n=10, draft_n_accepted=6)
            self._send({{"content": " ".join(map(str, toks)), "tokens": toks, "timings": t}})

        def log_message(self, *a):
            pass

    HTTPServer(("127.0.0.1", port), H).serve_forever()
''')


@pytest.fixture
def fake_bin(tmp_path):
    d = tmp_path / "bin"
    d.mkdir()
    log = tmp_path / "server.log"
    exe = d / "llama-server"
    exe.write_text(FAKE.format(python=sys.executable, log=str(log)))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return d, log


def _log(log: Path) -> list[dict]:
    return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []


def test_peer_configs_put_plain_first_and_refuse_unknown_modes():
    cs = llama_server.peer_configs(["ngram-mod", "ngram-simple", "ngram-mod"])
    assert [c.name for c in cs] == ["llama.cpp/plain", "llama.cpp/ngram-mod", "llama.cpp/ngram-simple"]
    assert all(c.engine == "llama.cpp" for c in cs)
    assert cs[1].spec() == "llama.cpp/ngram-mod"
    with pytest.raises(BadInput, match="'ngram-fast': unknown llama.cpp mode .*ngram-simple"):
        llama_server.peer_configs(["ngram-fast"])
    with pytest.raises(BadInput, match="--draft-model"):
        llama_server.peer_configs(["draft"])
    (d,) = [c for c in llama_server.peer_configs(["draft"], "/x/drafter.gguf") if c.algo == "draft"]
    assert d.draft_model == "/x/drafter.gguf"


def test_server_argv_per_mode(tmp_path):
    exe, m = Path("/b/llama-server"), Path("/m/x.gguf")
    plain = llama_server.server_argv(exe, m, 8080, threads=2, ctx=4096)
    assert plain[plain.index("--spec-type") + 1] == "none"
    assert plain[plain.index("-t") + 1] == "2" and plain[plain.index("-c") + 1] == "4096"
    assert "-cram" in plain  # no prompt cache carried between requests
    mod = llama_server.server_argv(exe, m, 8080, threads=2, ctx=4096, mode="ngram-mod")
    assert mod[mod.index("--spec-type") + 1] == "ngram-mod"
    dr = llama_server.server_argv(exe, m, 8080, threads=2, ctx=4096, mode="draft", draft_model=Path("/d.gguf"))
    assert dr[dr.index("-md") + 1] == "/d.gguf" and dr[dr.index("--spec-type") + 1] == "draft-simple"
    with pytest.raises(BadInput):
        llama_server.server_argv(exe, m, 8080, threads=2, ctx=4096, mode="draft")


def test_request_is_greedy_on_token_ids_without_prompt_cache():
    b = llama_server.request_body([1, 2, 3], 16, ignore_eos=True)
    assert b["prompt"] == [1, 2, 3] and b["n_predict"] == 16 and b["ignore_eos"] is True
    assert b["top_k"] == 1 and b["temperature"] == 0 and b["cache_prompt"] is False and b["return_tokens"]


def test_parse_timings_reads_the_servers_own_clock_and_refuses_garbage():
    obj = {"content": "a b", "tokens": [5, 6], "timings": {"predicted_n": 2, "predicted_ms": 40.0,
                                                            "predicted_per_second": 50.0, "prompt_ms": 8.0,
                                                            "draft_n": 4, "draft_n_accepted": 3}}
    r = llama_server.parse_timings(obj, "x")
    assert (r["n"], r["decode_s"], r["prefill_s"], r["drafted"], r["accepted"]) == (2, 0.04, 0.008, 4, 3)
    assert r["tokens"] == [5, 6]
    with pytest.raises(TsspecError, match="no timings"):
        llama_server.parse_timings({"content": ""}, "x")
    with pytest.raises(TsspecError, match="garble"):
        llama_server.parse_timings({"timings": {"predicted_n": "many"}}, "x")


def test_refuses_non_loopback_and_bad_urls():
    with pytest.raises(BadInput, match="loopback"):
        llama_server.check_url("http://10.0.0.5:8080")
    with pytest.raises(BadInput, match="expected"):
        llama_server.check_url("localhost:8080")


def test_missing_binary_names_the_build_script(tmp_path):
    with pytest.raises(BadInput, match="build_llamacpp.sh"):
        llama_server.llama_tool("llama-server", tmp_path)


def test_peer_starts_one_server_per_mode_and_stops_them(fake_bin, tmp_path):
    d, log = fake_bin
    cfgs = llama_server.peer_configs(["ngram-simple"])
    with llama_server.Peer(cfgs, tmp_path / "m.gguf", exe=d / "llama-server", threads=2, ctx=512) as peer:
        procs = [s.proc for s in peer.servers.values()]
        r = peer.run(cfgs[1], [3, 4, 5], 6, ignore_eos=True)
        assert r["tokens"] == [5, 4, 3, 5 + 1, 4, 3]  # odd first id: the "speculative" drift at n // 2
        assert r["drafted"] == 10 and r["accepted"] == 6
        prov = peer.provenance()
        assert set(prov["servers"]) == {"llama.cpp/plain", "llama.cpp/ngram-simple"}
    assert all(p.poll() is not None for p in procs)  # stopped on leaving the block
    modes = [e["argv"][e["argv"].index("--spec-type") + 1] for e in _log(log) if "argv" in e]
    assert modes == ["none", "ngram-simple"]


def test_a_server_that_dies_at_start_is_one_error_and_stops_the_others(fake_bin, tmp_path):
    d, log = fake_bin
    cfgs = llama_server.peer_configs(["ngram-simple", "ngram-cache"])  # the stand-in exits on ngram-cache
    peer = llama_server.Peer(cfgs, tmp_path / "m.gguf", exe=d / "llama-server", threads=2, ctx=512)
    with pytest.raises(TsspecError, match="exited with 3 while starting"):
        peer.__enter__()
    assert peer.servers and all(s.proc.poll() is not None for s in peer.servers.values())  # started ones stopped


def test_a_server_killed_by_sigill_while_starting_is_started_again_without_repacking(fake_bin, tmp_path):
    d, log = fake_bin
    cfgs = llama_server.peer_configs(["ngram-simple"])
    with llama_server.Peer(cfgs, tmp_path / "sigill.gguf", exe=d / "llama-server", threads=2, ctx=512) as peer:
        assert peer.run(cfgs[1], [3, 4, 5], 6, ignore_eos=True)["tokens"] == [5, 4, 3, 6, 4, 3]
        assert set(peer.fallback) == {c.name for c in cfgs} and all("while starting" in w for w in peer.fallback.values())
        assert all(a[-1] == "--no-repack" for a in peer.provenance()["servers"].values())
    starts = [e["argv"] for e in _log(log) if "argv" in e]
    assert [a.count("--no-repack") for a in starts] == [0, 1, 0, 1]
    assert set(peer.fallback) == {c.name for c in cfgs}  # the record outlives the servers (bench prints it after)


def test_a_server_killed_by_sigsegv_while_starting_is_started_again_without_repacking(fake_bin, tmp_path):
    d, log = fake_bin
    cfgs = llama_server.peer_configs([])
    with llama_server.Peer(cfgs, tmp_path / "segv.gguf", exe=d / "llama-server", threads=2, ctx=512) as peer:
        assert peer.run(cfgs[0], [3, 4, 5], 6, ignore_eos=True)["tokens"]
        assert all("killed by SIGSEGV while starting" in w for w in peer.fallback.values()) and peer.fallback
    starts = [e["argv"] for e in _log(log) if "argv" in e]
    assert [a.count("--no-repack") for a in starts] == [0, 1]


def test_a_server_that_exits_with_an_error_status_is_not_started_again(fake_bin, tmp_path):
    d, log = fake_bin
    cfgs = llama_server.peer_configs(["ngram-cache"])  # the fake exits with status 3 in this mode
    with pytest.raises(TsspecError, match="exited with 3 while starting"):
        with llama_server.Peer(cfgs, tmp_path / "m.gguf", exe=d / "llama-server", threads=2, ctx=512) as peer:
            for c in cfgs:
                peer.run(c, [3, 4, 5], 6, ignore_eos=True)
    starts = [e["argv"] for e in _log(log) if "argv" in e]
    assert all(a.count("--no-repack") == 0 for a in starts)


def test_a_server_killed_by_sigill_at_a_request_is_one_error_line(fake_bin, tmp_path):
    """Only a death while starting is retried (where b11434 dies); one mid-answer is an error that
    names the request and ends with the server's log, not a RemoteDisconnected traceback."""
    d, _ = fake_bin
    cfgs = llama_server.peer_configs([])
    with llama_server.Peer(cfgs, tmp_path / "sigill-request.gguf", exe=d / "llama-server", threads=2, ctx=512) as peer:
        with pytest.raises(TsspecError, match="llama-server /completion"):
            peer.run(cfgs[0], [3, 4, 5], 6, ignore_eos=True)
        assert not peer.fallback


# ----------------------------------------------------------------------------- the bench's judgement


def _peer_run_one(cfg: BenchConfig, p: Prompt) -> RunRecord:
    """Synthetic engines: tsspec exact; the peer's speculative mode drifts on prompt 'b'."""
    ids = [ord(ch) for ch in p.text][:8]
    speed = {"plain": 100.0, "ngram": 150.0, "llama.cpp/plain": 80.0, "llama.cpp/ngram-simple": 100.0}[cfg.name]
    if cfg.name == "llama.cpp/ngram-simple" and p.id == "b":
        ids = ids[:3] + [0] + ids[4:]
    return RunRecord(text="", token_ids=ids, n_tokens=len(ids), decode_s=len(ids) / speed, tok_s=speed,
                     prefill_s=0.01, counters={"drafted": 4, "accepted": 2} if cfg.algo != "plain" else {})


def test_bench_judges_each_engine_against_its_own_plain_runs():
    wl = Workload("w", [Prompt(i, f"prompt {i} text") for i in "abcdef"])
    configs = parse_configs(["ngram"]) + llama_server.peer_configs(["ngram-simple"])
    res = run_bench(configs, [wl], run_one=_peer_run_one, reps=2, warmup=0, n_resamples=200)
    assert res.ok  # a peer's drift is counted, never a tsspec correctness failure
    by = {cr.config.name: cr for cr in res.workloads[0].configs}
    assert by["ngram"].reference == "plain" and by["ngram"].same_text == (6, 6)
    assert by["llama.cpp/plain"].reference is None and by["llama.cpp/plain"].identical is None
    peer = by["llama.cpp/ngram-simple"]
    assert peer.reference == "llama.cpp/plain"
    assert peer.same_text == (5, 6)
    assert peer.identical is None and not peer.mismatches
    assert peer.vs_reference_decode.ratio.estimate == pytest.approx(100 / 80)
    assert peer.comparison.ratio.estimate == pytest.approx(1.0)  # vs tsspec plain, the baseline
    e2e = (8 / (0.01 + 8 / 100)) / (8 / (0.01 + 8 / 80))
    assert peer.vs_reference.ratio.estimate == pytest.approx(e2e)


def test_bench_cli_runs_the_peer_beside_tsspec(fake_bin, tmp_path):
    from typer.testing import CliRunner

    from tiny import write_tiny_model
    from tsspec.cli import app

    d, log = fake_bin
    model = write_tiny_model(tmp_path / "m.gguf", arch="qwen2", seed=1)
    wl = tmp_path / "w.txt"
    wl.write_text("one two three one two three\n\nfour five six four five six\n")
    out, table = tmp_path / "r.json", tmp_path / "r.csv"
    r = CliRunner().invoke(app, ["bench", "-m", str(model), "-w", str(wl), "-n", "8", "--reps", "2", "--warmup", "0",
                                 "--config", "ngram", "--peer", "llama.cpp", "--peer-spec", "ngram-mod",
                                 "--llama-bin", str(d), "--json", str(out), "--csv", str(table)])
    assert r.exit_code == 0, r.output
    assert "each engine against its own plain decoding" in r.stdout
    obj = json.loads(out.read_text())
    rows = {c["config"]["name"]: c for c in obj["workloads"][0]["configs"]}
    assert set(rows) == {"plain", "ngram", "llama.cpp/plain", "llama.cpp/ngram-mod"}
    mod = rows["llama.cpp/ngram-mod"]
    assert mod["config"]["engine"] == "llama.cpp" and mod["reference"] == "llama.cpp/plain"
    assert mod["ratio_vs_reference_decode"]["estimate"] == pytest.approx(1.5, rel=1e-3)  # the stand-in's speeds
    assert mod["acceptance_rate"] == pytest.approx(0.6)
    assert rows["ngram"]["same_text_as_reference"]["prompts_equal"] == 2
    assert set(obj["metadata"]["peer"]["servers"]) == {"llama.cpp/plain", "llama.cpp/ngram-mod"}
    # every request carried the prompt ids tsspec prefilled, greedy, the bench's budget
    bodies = [e["body"] for e in _log(log) if "body" in e]
    assert len(bodies) == 2 * 2 * 2  # 2 servers x 2 prompts x 2 reps
    assert all(b["n_predict"] == 8 and b["top_k"] == 1 and isinstance(b["prompt"][0], int) for b in bodies)
    assert "llama.cpp/ngram-mod" in table.read_text()


def test_bench_cli_peer_errors_are_one_line(fake_bin, tmp_path):
    from typer.testing import CliRunner

    from tsspec.cli import app

    d, _ = fake_bin
    r = CliRunner().invoke(app, ["bench", "--peer", "vllm"])
    assert r.exit_code != 0 and "the peer engine is llama.cpp" in r.output
    r = CliRunner().invoke(app, ["bench", "--peer-spec", "ngram-mod"])
    assert r.exit_code != 0 and "go with --peer" in r.output
    r = CliRunner().invoke(app, ["bench", "--peer", "llama.cpp", "--llama-bin", str(tmp_path / "none")])
    assert r.exit_code != 0 and "llama-server not found" in r.output
    r = CliRunner().invoke(app, ["bench", "--peer", "llama.cpp", "--baseline", "llama.cpp/plain"])
    assert r.exit_code != 0 and "the baseline is one of tsspec's configurations" in r.output
    r = CliRunner().invoke(app, ["bench", "--json", str(tmp_path / "no" / "r.json")])
    assert r.exit_code != 0 and "--json" in r.output and f"directory {tmp_path / 'no'} does not exist" in r.output.replace("\n", "")
    assert "Traceback" not in r.output
