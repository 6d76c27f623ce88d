"""llama.cpp beside the bench: llama-server processes started from the peer build, timed by their own
clocks on the same prompt tokens and budgets as tsspec.

``tsspec bench --peer llama.cpp`` adds one configuration per llama.cpp mode (``plain``, and by
default its ``ngram-simple`` and ``ngram-mod`` speculation, plus ``draft`` (``-md``) when a drafter is
given). Each mode is its own llama-server on a loopback port, started once, idle while the others run;
the bench's rotation interleaves them with tsspec's configurations prompt by prompt.

Each request sends the prompt as token ids (exactly the ids tsspec prefilled), greedy (``top_k`` 1,
temperature 0), no prompt cache, ``n_predict`` = the bench's token budget, and asks for the generated
token ids back, so llama.cpp's speculative text can be compared with its own plain text. The server's
``timings`` give the figures: ``predicted_ms`` (decode), ``prompt_ms`` (prefill, whole prompt),
``draft_n``/``draft_n_accepted`` (acceptance).
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Sequence

from ..env import llama_cpp_dir
from ..errors import BadInput, TsspecError
from .configs import BenchConfig

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
PEER_BUILD = "bash ../shared/tools/build_llamacpp.sh"  # builds the peer and prints its bin directory
ENGINE = "llama.cpp"
# what a server killed by SIGILL while starting is started again with: llama.cpp's plain CPU
# buffers (see LlamaServer.__enter__)
NO_REPACK = "--no-repack"
# llama.cpp's speculative modes the bench knows how to start; "draft" is ``-md FILE``
PEER_MODES = ("plain", "ngram-simple", "ngram-mod", "ngram-map-k", "ngram-cache", "draft")
DEFAULT_PEER_MODES = ("plain", "ngram-simple", "ngram-mod")


def llama_tool(name: str, bin_dir: str | os.PathLike | None = None) -> Path:
    """The llama.cpp executable ``name`` (llama-bench, llama-server, ...) in ``bin_dir``, else where
    the peer build puts it ($LLAMA_CPP_DIR/build/bin or ~/.cache/tsspec-peer/llama.cpp/build/bin)."""
    if bin_dir:
        d = Path(bin_dir).expanduser()
    else:
        d = llama_cpp_dir() / "build" / "bin"
    exe = d / name
    if not (exe.is_file() and os.access(exe, os.X_OK)):
        raise BadInput(f"{name} not found in {d}; build llama.cpp with `{PEER_BUILD}` (it prints the bin "
                       "directory) or pass --llama-bin DIR")
    return exe


def check_url(url: str) -> str:
    """A loopback http URL without its trailing slash: engines are compared on one machine."""
    u = urllib.parse.urlparse(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise BadInput(f"llama-server URL {url!r}: expected http://HOST:PORT")
    if u.hostname not in LOOPBACK and not u.hostname.startswith("127."):
        raise BadInput(f"llama-server URL {url!r}: only a server on this machine (loopback) is compared")
    return url.rstrip("/")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- configurations


def peer_configs(modes: Sequence[str], draft_model: str | None = None) -> list[BenchConfig]:
    """One bench configuration per llama.cpp mode; ``plain`` is always included (each speculative
    mode is judged against it) and comes first."""
    out: list[str] = ["plain"]
    for m in modes:
        m = m.strip().lower()
        if m not in PEER_MODES:
            raise BadInput(f"--peer-spec {m!r}: unknown llama.cpp mode (known: {', '.join(PEER_MODES)})")
        if m == "draft" and not draft_model:
            raise BadInput("--peer-spec draft needs a drafter: pass --draft-model NAME_OR_PATH")
        if m not in out:
            out.append(m)
    return [BenchConfig(name=f"{ENGINE}/{m}", algo=m, engine=ENGINE,
                        draft_model=draft_model if m == "draft" else None) for m in out]


def server_argv(exe: Path, model: Path, port: int, *, threads: int, ctx: int, mode: str = "plain",
                draft_model: Path | None = None) -> list[str]:
    """llama-server for one mode: greedy defaults, one slot, no prompt cache across requests."""
    argv = [str(exe), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(threads), "-tb", str(threads), "-c", str(ctx), "-np", "1",
            "--temp", "0", "--top-k", "1", "--samplers", "top_k", "-cram", "0", "--no-webui"]
    if mode == "plain":
        argv += ["--spec-type", "none"]
    elif mode == "draft":
        if draft_model is None:
            raise BadInput("llama.cpp draft mode needs a draft model file")
        # a plain language-model drafter must be named: b11434 infers only sidecar drafter types
        # (dflash, eagle3, ...) from the file, and without a type the server does not speculate
        argv += ["-md", str(draft_model), "--spec-type", "draft-simple", "-td", str(threads), "-tbd", str(threads)]
    else:
        argv += ["--spec-type", mode]
    return argv


def request_body(prompt_ids: Sequence[int], n_predict: int, *, ignore_eos: bool) -> dict:
    return {
        "prompt": [int(t) for t in prompt_ids], "n_predict": int(n_predict), "cache_prompt": False,
        "stream": False, "samplers": ["top_k"], "top_k": 1, "temperature": 0.0, "seed": 0,
        "return_tokens": True, "ignore_eos": ignore_eos,
    }


def parse_timings(obj: dict, where: str) -> dict:
    """A /completion answer -> text, token ids and the server's own timings and draft counts."""
    t = obj.get("timings")
    if not isinstance(t, dict):
        raise TsspecError(f"{where}: the answer has no timings")
    try:
        out = {
            "text": str(obj.get("content", "")),
            "tokens": [int(x) for x in obj.get("tokens") or []],
            "n": int(t["predicted_n"]),
            "decode_s": float(t["predicted_ms"]) / 1000.0,
            "tok_s": float(t["predicted_per_second"]),
            "prefill_s": float(t["prompt_ms"]) / 1000.0,
            "prompt_n": int(t.get("prompt_n", 0)),
            "drafted": int(t.get("draft_n", 0)),
            "accepted": int(t.get("draft_n_accepted", 0)),
        }
    except (KeyError, TypeError, ValueError) as e:
        raise TsspecError(f"{where}: timings lack or garble {e}") from None
    return out


# ----------------------------------------------------------------------------- a running server


class LlamaServer:
    """``with LlamaServer(argv, url, log) as s:`` starts llama-server, waits for ``/health`` and always
    stops it (terminate, then kill) on leaving the block, errors included."""

    def __init__(self, argv: list[str], url: str, log: Path, startup_timeout: float = 300.0):
        self.argv, self.url, self.log, self.startup_timeout = argv, check_url(url), Path(log), startup_timeout
        self.proc: subprocess.Popen | None = None
        self._log_fh = None
        self.fallback: str | None = None  # why it runs with NO_REPACK, if it does

    def __enter__(self) -> "LlamaServer":
        """Start it and wait until it answers. On a virtual machine that advertises AMX without
        granting it, llama.cpp's repacked CPU buffers die while starting (b11434, in the warm-up:
        SIGILL on some hosts of this kind, SIGSEGV on others); its plain buffers run, so a server
        killed by one of those signals while starting is started once more with NO_REPACK and
        ``fallback`` says so."""
        try:
            self._launch()
        except TsspecError:
            sig = self.killed_by_fault()
            if sig is None or NO_REPACK in self.argv:
                raise
            self.fallback = f"llama-server was killed by {sig} while starting; started again with {NO_REPACK}"
            self.argv = [*self.argv, NO_REPACK]
            self._launch()
        return self

    def _launch(self) -> None:
        self._log_fh = open(self.log, "wb")
        try:
            self.proc = subprocess.Popen(self.argv, stdout=self._log_fh, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def killed_by_fault(self) -> str | None:
        """The signal's name when the server died of an illegal instruction, a segmentation fault or
        a bus error (what the repacked buffers' AMX path does where AMX is not granted), else None."""
        rc = self.proc.poll() if self.proc is not None else None
        faults = {-signal.SIGILL: "SIGILL", -signal.SIGSEGV: "SIGSEGV", -signal.SIGBUS: "SIGBUS"}
        return faults.get(rc)

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise TsspecError(f"llama-server exited with {self.proc.returncode} while starting "
                                  f"({' '.join(self.argv)}):\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass  # not listening yet, or 503 while loading
            time.sleep(0.25)
        raise TsspecError(f"llama-server not ready after {self.startup_timeout:.0f}s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)
        if self._log_fh is not None:
            self._log_fh.close()
            self._log_fh = None

    def post(self, path: str, body: dict, timeout: float = 600.0) -> dict:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read().decode())
        except urllib.error.HTTPError as e:
            raise TsspecError(f"llama-server {path}: HTTP {e.code}: {e.read().decode(errors='replace')[:500]}") from None
        except urllib.error.URLError as e:
            raise TsspecError(f"llama-server {path}: {getattr(e, 'reason', e)}\n{self.log_tail()}") from None
        except (http.client.HTTPException, ConnectionError) as e:  # the server died mid-answer
            raise TsspecError(f"llama-server {path}: {type(e).__name__}: {e}\n{self.log_tail()}") from None
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise TsspecError(f"llama-server {path}: the answer is not JSON") from None

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return json.loads(r.read().decode())


class Peer:
    """One llama-server per peer configuration, for the length of a ``with`` block.

    ``run(config, prompt_ids, max_tokens, ignore_eos)`` answers with the parsed timings (see
    ``parse_timings``); ``argv`` keeps each server's command line for the provenance record.
    """

    def __init__(self, configs: Sequence[BenchConfig], model: Path, *, exe: Path, threads: int, ctx: int,
                 draft_model: Path | None = None, startup_timeout: float = 300.0):
        self.configs = list(configs)
        self.model, self.exe, self.threads, self.ctx = Path(model), Path(exe), threads, ctx
        self.draft_model, self.startup_timeout = draft_model, startup_timeout
        self.servers: dict[str, LlamaServer] = {}
        self._tmp: tempfile.TemporaryDirectory | None = None

    def __enter__(self) -> "Peer":
        self._tmp = tempfile.TemporaryDirectory(prefix="tsspec-peer-")
        try:
            for c in self.configs:
                self._start(c)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start(self, c: BenchConfig) -> None:
        port = free_port()
        argv = server_argv(self.exe, self.model, port, threads=self.threads, ctx=self.ctx, mode=c.algo,
                           draft_model=self.draft_model)
        srv = LlamaServer(argv, f"http://127.0.0.1:{port}", Path(self._tmp.name) / f"{c.algo}.log",
                          startup_timeout=self.startup_timeout)
        srv.__enter__()
        self.servers[c.name] = srv

    @property
    def argv(self) -> dict[str, list[str]]:
        """config name -> its server's command line (as started: NO_REPACK included if it fell back)"""
        return {name: srv.argv for name, srv in self.servers.items()}

    @property
    def fallback(self) -> dict[str, str]:
        """config name -> why its server runs with NO_REPACK, for those that do"""
        return {name: srv.fallback for name, srv in self.servers.items() if srv.fallback}

    def __exit__(self, *exc) -> None:
        for srv in self.servers.values():  # stopped, kept: their argv and fallback are the record
            srv.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def run(self, c: BenchConfig, prompt_ids: Sequence[int], max_tokens: int, *, ignore_eos: bool) -> dict:
        srv = self.servers.get(c.name)
        if srv is None:
            raise TsspecError(f"no llama-server was started for {c.name}")
        obj = srv.post("/completion", request_body(prompt_ids, max_tokens, ignore_eos=ignore_eos))
        return parse_timings(obj, f"llama-server {c.name}")

    def provenance(self) -> dict:
        """What the peer was: binary, version line, and each server's command line."""
        version = None
        try:
            p = subprocess.run([str(self.exe), "--version"], capture_output=True, text=True, timeout=30)
            version = (p.stdout + p.stderr).strip().splitlines()[-2:] or None
        except (OSError, subprocess.SubprocessError):
            pass
        return {"engine": ENGINE, "exe": str(self.exe), "version": version, "fallback": dict(self.fallback),
                "servers": {name: [Path(a).name if a in (str(self.exe), str(self.model)) else a for a in argv]
                            for name, argv in self.argv.items()}}
