"""Another engine beside the bench: a running llama.cpp server's ``/completion`` endpoint.

The server does its own timing (``timings.predicted_per_second``), so its figure is what llama.cpp
itself reports. Start it with the same file, greedy sampling and thinking disabled, e.g.::

    llama-server -m MODEL.gguf -t 2 --port 8080 --temp 0 --chat-template-kwargs '{"enable_thinking":false}'
    tsspec bench -m MODEL.gguf --vs-llama-server http://127.0.0.1:8080

Only loopback addresses are accepted: this compares engines on one machine.
"""

from __future__ import annotations

import json
import os
import statistics
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import BadInput, TsspecError

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
PEER_BUILD = "bash ../shared/tools/build_llamacpp.sh"  # builds the peer and prints its bin directory


def llama_tool(name: str, bin_dir: str | os.PathLike | None = None) -> Path:
    """The llama.cpp executable ``name`` (llama-bench, llama-server, ...) in ``bin_dir``, else where
    the peer build puts it ($LLAMA_CPP_DIR/build/bin or ~/.cache/tsspec-peer/llama.cpp/build/bin)."""
    if bin_dir:
        d = Path(bin_dir).expanduser()
    else:
        root = os.environ.get("LLAMA_CPP_DIR") or str(Path.home() / ".cache" / "tsspec-peer" / "llama.cpp")
        d = Path(root).expanduser() / "build" / "bin"
    exe = d / name
    if not (exe.is_file() and os.access(exe, os.X_OK)):
        raise BadInput(f"{name} not found in {d}; build llama.cpp with `{PEER_BUILD}` (it prints the bin "
                       "directory) or pass --llama-bin DIR")
    return exe


def check_url(url: str) -> str:
    u = urllib.parse.urlparse(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise BadInput(f"--vs-llama-server {url!r}: expected http://HOST:PORT")
    if u.hostname not in LOOPBACK and not u.hostname.startswith("127."):
        raise BadInput(f"--vs-llama-server {url!r}: only a server on this machine (loopback) is compared")
    return url.rstrip("/")


def complete(url: str, prompt: str, n_predict: int, *, ignore_eos: bool, timeout: float = 600.0) -> dict:
    """One greedy completion; -> {"text", "n", "tok_s", "prompt_tok_s"} from the server's own timings."""
    body = json.dumps({
        "prompt": prompt, "n_predict": n_predict, "temperature": 0.0, "top_k": 1, "cache_prompt": False,
        "ignore_eos": ignore_eos, "stream": False,
    }).encode()
    req = urllib.request.Request(url + "/completion", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            obj = json.loads(r.read().decode())
    except urllib.error.URLError as e:
        raise TsspecError(f"cannot reach llama-server at {url}: {getattr(e, 'reason', e)}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise TsspecError(f"llama-server at {url} answered something that is not JSON") from None
    t = obj.get("timings") or {}
    if "predicted_per_second" not in t:
        raise TsspecError(f"llama-server at {url} reported no timings.predicted_per_second")
    return {
        "text": obj.get("content", ""),
        "n": int(t.get("predicted_n", 0)),
        "tok_s": float(t["predicted_per_second"]),
        "prompt_tok_s": float(t.get("prompt_per_second", 0.0)),
    }


@dataclass
class ServerResult:
    url: str
    per_workload: dict[str, list[float]] = field(default_factory=dict)

    def medians(self) -> dict[str, float]:
        return {w: statistics.median(v) for w, v in self.per_workload.items() if v}

    def to_dict(self) -> dict:
        return {"url": self.url, "tok_s": self.per_workload, "median_tok_s": self.medians()}


def run(url: str, workloads, render, *, reps: int, max_tokens: int, ignore_eos: bool) -> ServerResult:
    """Every prompt of every workload ``reps`` times, after one warm-up request."""
    url = check_url(url)
    res = ServerResult(url)
    first = workloads[0].prompts[0]
    complete(url, render(first.text), 8, ignore_eos=True)
    for w in workloads:
        vals = res.per_workload.setdefault(w.name, [])
        for _ in range(reps):
            for p in w.prompts:
                vals.append(complete(url, render(p.text), max_tokens, ignore_eos=ignore_eos)["tok_s"])
    return res
