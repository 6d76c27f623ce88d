"""--vs-llama-server against a fake llama.cpp server on loopback (no network beyond this machine)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from tsspec.bench import llama_server
from tsspec.bench.workloads import Prompt, Workload
from tsspec.errors import BadInput, TsspecError


class Fake(BaseHTTPRequestHandler):
    seen: list = []

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Fake.seen.append(body)
        out = {"content": "x" * body["n_predict"],
               "timings": {"predicted_per_second": 40.0 + len(Fake.seen), "predicted_n": body["n_predict"],
                           "prompt_per_second": 300.0}}
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


@pytest.fixture
def server():
    Fake.seen = []
    srv = HTTPServer(("127.0.0.1", 0), Fake)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_runs_every_prompt_greedy_and_reads_server_timings(server):
    wl = [Workload("a", [Prompt("1", "hello"), Prompt("2", "world")])]
    res = llama_server.run(server, wl, lambda t: "<" + t + ">", reps=2, max_tokens=16, ignore_eos=True)
    assert len(res.per_workload["a"]) == 4
    bodies = Fake.seen[1:]  # after the warm-up
    assert [b["prompt"] for b in bodies] == ["<hello>", "<world>"] * 2
    assert all(b["temperature"] == 0 and b["n_predict"] == 16 and b["ignore_eos"] for b in bodies)
    assert res.per_workload["a"] == [42.0, 43.0, 44.0, 45.0]
    assert res.medians()["a"] == 43.5


def test_refuses_non_loopback_and_bad_urls():
    with pytest.raises(BadInput, match="loopback"):
        llama_server.check_url("http://10.0.0.5:8080")
    with pytest.raises(BadInput, match="expected"):
        llama_server.check_url("localhost:8080")


def test_unreachable_server_is_one_clear_error():
    with pytest.raises(TsspecError, match="cannot reach llama-server"):
        llama_server.complete("http://127.0.0.1:9", "hi", 4, ignore_eos=True, timeout=5)


def test_bench_cli_prints_the_server_beside_tsspec(server, tmp_path):
    from typer.testing import CliRunner

    from tiny import write_tiny_model
    from tsspec.cli import app

    model = write_tiny_model(tmp_path / "m.gguf", arch="qwen2", seed=1)
    wl = tmp_path / "w.txt"
    wl.write_text("one two three one two three\n\nfour five six four five six\n")
    out = tmp_path / "r.json"
    r = CliRunner().invoke(app, ["bench", "-m", str(model), "-w", str(wl), "-n", "8", "--reps", "2", "--warmup", "0",
                                 "--config", "ngram", "--vs-llama-server", server, "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "llama-server" in r.stdout
    obj = json.loads(out.read_text())
    assert obj["llama_server"]["median_tok_s"]
    assert len(Fake.seen) == 1 + 2 * 2  # warm-up + reps x prompts
