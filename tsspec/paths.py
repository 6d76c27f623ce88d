"""Paths a user names: where a command is about to write a file (refused before any work when
writing there would harm something or could never succeed), and tests on a path that answer
False for a name the OS refuses to look up (too long, a NUL byte) instead of raising.

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
