"""Training text for ``tsspec distill``: what a fresh machine already holds, or the user's files.

The default corpus needs no download:

* code: the Python standard library's own sources (tests left out);
* prose: Python's built-in help topics (``pydoc_data/topics.py``), the long descriptions of the
  installed packages (``*.dist-info/METADATA``) and the text documentation under ``/usr/share/doc``.

Files are split into training and held-out sets by a hash of their path relative to where they were
found (the standard library, site-packages, /usr/share/doc, a --corpus directory), so the split does
not move when files are added or the corpus sits somewhere else, and read in a seeded order up to a
character budget per kind.
"""

from __future__ import annotations

import hashlib
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from ..errors import BadInput
from ..paths import check_input_file, exists, is_dir

TEXT_SUFFIXES = {".md", ".txt", ".rst", ".markdown", ""}
MAX_FILE_CHARS = 200_000  # one huge file must not be the whole corpus


@dataclass(frozen=True)
class Source:
    path: Path
    kind: str  # "code" or "prose" (or "user")
    # the path relative to where it was found: what the held-out split hashes (empty: the path)
    key: str = ""


def _found(path: Path, root: Path, kind: str) -> Source:
    try:
        key = path.relative_to(root).as_posix()
    except ValueError:
        key = path.name
    return Source(path, kind, key)


def default_sources() -> list[Source]:
    """Code and prose already on this machine, in a stable order."""
    std = Path(sysconfig.get_paths()["stdlib"])
    code = sorted(p for p in std.rglob("*.py")
                  if "site-packages" not in p.parts and not any(part in ("test", "tests", "idle_test") for part in p.parts))
    prose = [_found(std / "pydoc_data" / "topics.py", std, "prose")]
    pure = Path(sysconfig.get_paths()["purelib"])
    prose += [_found(p, pure, "prose") for p in sorted(pure.glob("*.dist-info/METADATA"))]
    doc = Path("/usr/share/doc")
    if doc.is_dir():
        prose += [_found(p, doc, "prose") for p in sorted(
            p for p in doc.rglob("*") if p.is_file() and not p.is_symlink()
            and (p.suffix.lower() in TEXT_SUFFIXES or p.name.upper().startswith("README"))
            and p.name != "copyright" and p.stat().st_size > 500)]
    out = [_found(p, std, "code") for p in code] + [s for s in prose if s.path.is_file()]
    if not out:
        raise BadInput("no default corpus found on this machine; give one with --corpus PATH")
    return out


def user_sources(paths: Sequence[str | Path]) -> list[Source]:
    """--corpus PATH ...: files, or directories read recursively for text files."""
    out: list[Source] = []
    for raw in paths:
        p = Path(raw).expanduser()
        if is_dir(p):  # regular files only (is_file is False for a FIFO, a socket, a device)
            out += [_found(f, p, "user") for f in sorted(p.rglob("*")) if f.is_file() and _looks_textual(f)]
        elif not exists(p):
            raise BadInput(f"--corpus {raw}: no such file or directory")
        else:  # a FIFO, a socket or a device is refused here, in one line
            out.append(Source(check_input_file(p, "--corpus"), "user", p.name))
    if not out:
        raise BadInput("--corpus: no text files found in " + ", ".join(str(p) for p in paths))
    return out


def _looks_textual(p: Path) -> bool:
    try:
        head = p.read_bytes()[:4096]
    except OSError:
        return False
    return b"\0" not in head


def is_heldout(key: str | Path, fraction: float) -> bool:
    """Whether the file ``key`` names (its path relative to where it was found) belongs to the
    held-out set: a stable hash, independent of the seed and of where the corpus sits."""
    h = int.from_bytes(hashlib.sha256(str(key).encode()).digest()[:8], "big")
    return (h % 10_000) < fraction * 10_000


def read_text(path: Path) -> str:
    """A file's text (a ``.gz`` decompressed, as Debian ships most of /usr/share/doc), or "" when
    it cannot be read or is not text (more than 1% undecodable: a binary file is no training text)."""
    try:
        if path.suffix == ".gz":
            import gzip

            with gzip.open(path, "rb") as f:
                data = f.read(4 * MAX_FILE_CHARS)
        else:
            data = path.read_bytes()[: 4 * MAX_FILE_CHARS]
    except (OSError, EOFError, ValueError):  # gzip raises BadGzipFile (an OSError) or EOFError
        return ""
    text = data.decode("utf-8", errors="replace")[:MAX_FILE_CHARS]
    if b"\0" in data[:4096] or text.count("\ufffd") > 0.01 * max(1, len(text)):
        return ""
    return text


def sample_texts(sources: Iterable[Source], chars: int, seed: int) -> list[tuple[str, str]]:
    """(kind, text) from ``sources`` in a seeded order, each kind up to an equal share of ``chars``."""
    by_kind: dict[str, list[Source]] = {}
    for s in sources:
        by_kind.setdefault(s.kind, []).append(s)
    out: list[str] = []
    share = chars // max(1, len(by_kind))
    for kind in sorted(by_kind):
        files = list(by_kind[kind])
        random.Random(f"{seed}:{kind}").shuffle(files)
        got = 0
        for s in files:
            if got >= share:
                break
            text = read_text(s.path)
            if len(text.strip()) < 200:
                continue
            text = text[: share - got + 2000]
            out.append((kind, text))
            got += len(text)
    return out


def split_sources(sources: Sequence[Source], heldout: float) -> tuple[list[Source], list[Source]]:
    train = [s for s in sources if not is_heldout(s.key or s.path, heldout)]
    held = [s for s in sources if is_heldout(s.key or s.path, heldout)]
    if not held and len(train) > 1:  # a tiny user corpus: hold out its last file
        held, train = train[-1:], train[:-1]
    return train, held


def chunk_ids(texts: Iterable[list[int]], length: int) -> list[list[int]]:
    """Token lists cut into chunks of exactly ``length`` (a text's short tail is dropped when it is
    under a quarter chunk, else left-filled from the text's previous tokens)."""
    out = []
    for ids in texts:
        for i in range(0, len(ids), length):
            piece = ids[i : i + length]
            if len(piece) == length:
                out.append(piece)
            elif len(piece) >= length // 4 and len(ids) >= length:
                out.append(ids[len(ids) - length :])
    return out
