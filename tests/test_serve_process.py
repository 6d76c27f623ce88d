"""A real ``tsspec serve`` process on loopback, 8 clients at once over raw HTTP (plain, n-gram and
``auto``, which takes the suffix speculator on a server; greedy and seeded): every response is the text ``tsspec generate`` (another real process) gives for
the same prompt and seed, and the requests were decoded together (``tsspec_shared_steps_total`` in
/metrics counts the steps several sequences shared). A malformed body and an unknown route over a
real socket get JSON errors, and the server keeps serving.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from serve_proc import ROOT, clean_env, serve
from tiny import write_tiny_model

N_TOKENS = 24
PROMPTS = [f"red green blue {i} the cat sat on the mat {i} red green" for i in range(8)]
# (temperature, seed) per prompt: greedy and seeded
SAMPLING = [(0.0, 0), (0.9, 11), (0.0, 0), (0.9, 11), (0.0, 0), (0.9, 11), (0.0, 0), (0.9, 11)]


def _post(port: int, route: str, body: bytes | dict, timeout: float = 120) -> tuple[int, dict]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        c.request("POST", route, body=data, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, json.loads(r.read())
    finally:
        c.close()


def _get(port: int, route: str) -> tuple[int, str]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        c.request("GET", route)
        r = c.getresponse()
        return r.status, r.read().decode()
    finally:
        c.close()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("serve_proc") / "tiny.gguf", "qwen2", seed=8, vocab_size=400,
                            ctx=1024)


def generate_texts(model, tmp_path) -> list[str]:
    """What `tsspec generate` gives for each prompt and its sampling (one process per setting)."""
    texts = [None] * len(PROMPTS)
    for temp, seed in sorted(set(SAMPLING)):
        idx = [i for i, s in enumerate(SAMPLING) if s == (temp, seed)]
        f = tmp_path / f"p-{temp}-{seed}.jsonl"
        f.write_text("".join(json.dumps({"id": i, "text": PROMPTS[i]}) + "\n" for i in idx))
        r = subprocess.run([sys.executable, "-m", "tsspec", "generate", "-m", str(model), "--prompts", str(f),
                            "--json", "-n", str(N_TOKENS), "--temp", str(temp), "--seed", str(seed), "-t", "1"],
                           cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        for line in r.stdout.splitlines():
            obj = json.loads(line)
            texts[int(obj["id"])] = obj["text"]
    return texts


@pytest.mark.parametrize("spec", [[], ["--spec", "--spec-type", "ngram"], ["--spec"]],
                         ids=["plain", "ngram", "auto-suffix"])
def test_real_serve_process_eight_clients_equal_generate(model, tmp_path, spec):
    want = generate_texts(model, tmp_path)
    with serve(model, "--parallel", "8", "-t", "1", *spec) as (p, port):
        def ask(i: int) -> str:
            temp, seed = SAMPLING[i]
            status, body = _post(port, "/v1/completions", {"prompt": PROMPTS[i], "max_tokens": N_TOKENS,
                                                           "temperature": temp, "seed": seed})
            assert status == 200, body
            return body["choices"][0]["text"]

        for _ in range(2):  # the second round also meets the prefix cache's kept caches
            with ThreadPoolExecutor(max_workers=8) as pool:
                got = list(pool.map(ask, range(len(PROMPTS))))
            assert got == want
        status, err = _post(port, "/v1/completions", b"{not json")
        assert status == 400 and "JSON" in err["error"]["message"]
        assert _get(port, "/v1/nothing")[0] == 404
        metrics = _get(port, "/metrics")[1]
        assert f"tsspec_requests_total {2 * len(PROMPTS)}" in metrics
        shared = [line for line in metrics.splitlines() if line.startswith("tsspec_shared_steps_total")]
        assert float(shared[0].split()[1]) > 0, "the requests were never decoded together"
        if spec == ["--spec"]:  # auto on a server: the suffix store, read across requests
            hits = [line for line in metrics.splitlines() if line.startswith("tsspec_suffix_hits_total")]
            assert hits and float(hits[0].split()[1]) > 0, metrics
        assert ask(5) == want[5]


def test_ctrl_c_answers_what_is_running_and_ends_the_server(tmp_path):
    """Ctrl-C (SIGINT) while a request streams: the running request gets the server's 503 error
    event (not a dropped connection), the process exits 0 within seconds, and says nothing more."""
    import signal

    path = write_tiny_model(tmp_path / "slow.gguf", "qwen2", seed=5, vocab_size=400, ctx=4096, d_model=256,
                            n_layers=8, ffn_dim=1024)  # ~2 ms a token: 4000 tokens outlast the test's signal
    with serve(path, "-t", "1", stdout=subprocess.PIPE) as (p, port):
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        c.request("POST", "/v1/completions", body=json.dumps({"prompt": "red green", "max_tokens": 4000,
                                                              "temperature": 0, "stream": True}),
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        assert r.status == 200
        first = r.readline()
        assert first.startswith(b"data: ")
        t0 = time.time()
        p.send_signal(signal.SIGINT)
        rest = r.read().decode()
        c.close()
        assert '"shutting_down"' in rest and rest.rstrip().endswith("data: [DONE]")
        assert p.wait(30) == 0
        assert time.time() - t0 < 20
        err = p.stderr.read().decode()
        assert "Traceback" not in err, err
