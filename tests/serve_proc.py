"""A real ``tsspec serve`` process for the tests: started on a free loopback port with the repo on
its path and no speculation variables from the caller's environment, waited for until /health
answers, and stopped (SIGTERM, then SIGKILL) however the test ends."""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]


def clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TS_SPEC_", "TS_MTP_", "OPENAI_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(port: int) -> bool:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        c.request("GET", "/health")
        return c.getresponse().status == 200
    except OSError:
        return False
    finally:
        c.close()


def interruptible() -> None:
    """``preexec_fn``: SIGINT at its default action in the child, as a terminal's Ctrl-C finds it.
    A suite run under ``nohup`` or as a script's background job starts with SIGINT ignored, and a
    child inherits that: the tests that send it SIGINT then failed there and only there."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextlib.contextmanager
def serve(model, *args: str, stdout=subprocess.DEVNULL, timeout: float = 120) -> Iterator[tuple[subprocess.Popen, int]]:
    """(process, port) of ``tsspec serve -m MODEL --port PORT ARGS...`` once it answers /health."""
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "tsspec", "serve", "-m", str(model), "--port", str(port), *args],
                         cwd=ROOT, env=clean_env(), stdin=subprocess.DEVNULL, stdout=stdout, stderr=subprocess.PIPE,
                         preexec_fn=interruptible)
    try:
        deadline = time.time() + timeout
        while not _healthy(port):
            assert p.poll() is None, p.stderr.read().decode()[-2000:]
            assert time.time() < deadline, "the server did not come up"
            time.sleep(0.2)
        yield p, port
    finally:
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
