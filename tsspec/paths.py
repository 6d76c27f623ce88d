"""Paths a user names: the one guarded open for every file a command reads (``read_user_file``,
``check_input_file``), where a command is about to write a file (refused before any work when
writing there would harm something or could never succeed), and tests on a path that answer
False for a name the OS refuses to look up (too long, a NUL byte) instead of raising.

Reading: a prompt file, a prompts or workload file, a bench config file, a distill corpus file, a
model or drafter: whatever is not a regular file (a FIFO blocked the reader for ever, ``/dev/zero``
never ends, a directory is no text) is refused before any work, as is a file too large for its
purpose and one that cannot be read, each in one ``BadInput`` line that names the option and the
path. The file is opened without blocking and checked again once open, so a FIFO put in its place
between the two looks cannot hang the command either.

Every command that writes a file (distill, export-hf, bench --json/--csv/--plot, chat /save,
scripts/trace_steps.py) asks here first. A target that exists and is not a regular file is refused:
run as root, ``distill -o /dev/full`` replaced the character device with the drafter, and a FIFO
blocks the writer for ever. A directory that is not there, or one the OS will not create a file in
(``/proc``, a read-only mount), is found by creating and removing an empty file, now rather than
after a run that is then lost.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .errors import BadInput

MB = 1 << 20
# what each kind of file a command reads may weigh at most (a prompt file past this is no prompt:
# check_fits refuses far smaller ones; a TOML config of 16 MB is a mistake)
MAX_TEXT_BYTES = 256 * MB
MAX_CONFIG_BYTES = 16 * MB


def _kind(mode: int) -> str:
    return ("a directory" if stat.S_ISDIR(mode) else "a named pipe (FIFO)" if stat.S_ISFIFO(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "something else")


def check_input_file(path: str | os.PathLike, label: str, *, max_bytes: int | None = None,
                     error: type[Exception] = BadInput) -> Path:
    """``path`` (``~`` expanded) if it is a regular file no larger than ``max_bytes``; else one
    ``error`` line, ``"{label} {path}: ..."``, that says why (not there, a directory, a FIFO, a
    socket, a device, too large, a name the OS refuses)."""
    p = Path(path).expanduser()
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise error(f"{label} {p}: no such file or directory") from None
    except (OSError, ValueError) as e:  # a name too long, a parent that is a file, a NUL byte: not there
        raise error(f"{label} {p}: no such file or directory ({getattr(e, 'strerror', None) or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{label} {p}: is {_kind(st.st_mode)}, not a regular file")
    if max_bytes is not None and st.st_size > max_bytes:
        raise error(f"{label} {p}: {st.st_size / MB:.0f} MB is too large (at most {max_bytes / MB:.0f} MB)")
    return p


def read_user_file(path: str | os.PathLike, label: str, *, max_bytes: int = MAX_TEXT_BYTES,
                   encoding: str | None = "utf-8-sig") -> str | bytes:
    """The contents of a file a user named: text decoded with ``encoding`` (a BOM dropped), or bytes
    with ``encoding=None``. Refused in one ``BadInput`` line, before anything is read, where
    ``check_input_file`` refuses it; also where it cannot be opened or read, or is not text in that
    encoding. Opened with O_NONBLOCK and checked again by its descriptor, so a FIFO swapped in
    after the check is refused rather than waited on."""
    p = check_input_file(path, label, max_bytes=max_bytes)
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise BadInput(f"{label} {p}: cannot be read ({e.strerror or e})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadInput(f"{label} {p}: is {_kind(st.st_mode)}, not a regular file")
        chunks, total = [], 0
        while True:
            b = os.read(fd, 1 << 20)
            if not b:
                break
            total += len(b)
            if total > max_bytes:  # it grew since the check
                raise BadInput(f"{label} {p}: too large (at most {max_bytes / MB:.0f} MB)")
            chunks.append(b)
    except OSError as e:
        raise BadInput(f"{label} {p}: cannot be read ({e.strerror or e})") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if encoding is None:
        return data
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as e:
        what = "UTF-8" if encoding.startswith("utf-8") else encoding
        raise BadInput(f"{label} {p}: is not {what} text (byte {e.start})") from None


def check_output_file(path: str | os.PathLike, label: str) -> Path:
    """``path`` with ``~`` expanded, if a file can be written there; else one ``BadInput`` line that
    starts with ``label`` (e.g. ``"--json out.json"``) and says why."""
    p = Path(path).expanduser()
    try:
        st = os.stat(p)
    except FileNotFoundError:
        st = None
    except (OSError, ValueError) as e:  # a name too long, a loop of links, a NUL byte
        raise BadInput(f"{label}: cannot be written ({getattr(e, 'strerror', None) or e})") from None
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise BadInput(f"{label}: is a directory, not a file to write")
        if not stat.S_ISREG(st.st_mode):
            raise BadInput(f"{label}: exists and is not a regular file (a device, pipe or socket); "
                           "give the name of a file")
        if not os.access(p, os.W_OK):
            raise BadInput(f"{label}: the file is not writable")
        return p
    if not p.parent.is_dir():
        raise BadInput(f"{label}: directory {p.parent} does not exist")
    try:  # the only sure test that a file can be created here
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        raise BadInput(f"{label}: cannot be written ({e.strerror or e})") from None
    os.close(fd)
    os.unlink(p)
    return p


def is_file(path: str | os.PathLike) -> bool:
    """``Path.is_file``, False (not OSError) for a name too long for the file system or one with a
    NUL byte: a 300-character ``-m`` was a traceback from every command."""
    try:
        return stat.S_ISREG(os.stat(Path(path).expanduser()).st_mode)
    except (OSError, ValueError):
        return False


def is_dir(path: str | os.PathLike) -> bool:
    """``Path.is_dir``, False for a name the OS refuses (see ``is_file``)."""
    try:
        return stat.S_ISDIR(os.stat(Path(path).expanduser()).st_mode)
    except (OSError, ValueError):
        return False


def exists(path: str | os.PathLike) -> bool:
    """``Path.exists``, False for a name the OS refuses (see ``is_file``)."""
    try:
        os.stat(Path(path).expanduser())
    except (OSError, ValueError):
        return False
    return True
