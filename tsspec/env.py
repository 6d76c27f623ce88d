"""The process environment, read in one place, below everything else in the package.

Two kinds of reader use it:

* **Process-wide switches**, read when first needed because they belong to the process rather than
  to one run: the cache root (``TSSPEC_CACHE``: ``tsspec.hub`` and the kernels' build cache), the
  native kernels (``TSSPEC_KERNELS``, ``CC``, ``OMP_NUM_THREADS``: ``tsspec.kernels``) and where
  the llama.cpp peer build lives (``LLAMA_CPP_DIR``: ``tsspec.bench.llama_server``).
* **The run configuration**: ``tsspec.settings`` resolves a run's flags and variables from a
  mapping, the process's own (``environ``) unless a caller passes another.

This module imports nothing of tsspec but ``errors``, so the bottom layer (the kernels) can ask it
without reaching the run configuration, the speculation options or the registry above them.

One rule for every variable: set to the empty string (the shell's ``VAR= tsspec ...``) it counts as
unset; any other value must be valid (blanks around it are ignored), or the run stops with one
``BadInput`` line naming the variable. A switch takes only the boolean words (``0``/``1``,
``true``/``false``, ``yes``/``no``, ``on``/``off``): a typo is refused, not read as "on".
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, MutableMapping

from .errors import BadInput

ENV_CACHE = "TSSPEC_CACHE"
ENV_KERNELS = "TSSPEC_KERNELS"
ENV_AMX = "TSSPEC_AMX"  # auto | 0 | 1: the AMX tile products (kernels/amx.c)
ENV_PROMPT_TILES = "TSSPEC_PROMPT_TILES"  # 0 | 1: prompt rows' quantized products on AMX tiles (kernels/prompt_tiles.c)
ENV_DRAFT_VOCAB = "TSSPEC_DRAFT_VOCAB"  # auto | 0 | N: the ids a draft model chooses among (models/head_rows.py)
ENV_ISA = "TSSPEC_ISA"  # auto | avx512 | avx2 | neon | scalar: the native kernels' instruction-set level
ISA_WORDS = ("auto", "avx512", "avx2", "neon", "scalar")
ENV_CC = "CC"
ENV_LLAMA_CPP_DIR = "LLAMA_CPP_DIR"
ENV_OMP_THREADS = "OMP_NUM_THREADS"  # not tsspec's, but the native kernels' OpenMP runtime obeys it

MAX_THREADS_PER_CPU = 4  # torch/OpenMP crash on absurd counts (100000 segfaults)

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def environ(env: Mapping[str, str] | None = None) -> MutableMapping[str, str] | Mapping[str, str]:
    """``env``, or the process environment when None: every reader's one way to the real one."""
    return os.environ if env is None else env


def value(env: Mapping[str, str], name: str) -> str | None:
    """``name``'s value; None when unset or set to the empty string."""
    raw = env.get(name)
    return None if raw is None or raw == "" else raw


def bool_word(raw: str) -> bool | None:
    """A boolean spelled as flags and environment variables spell it; None for anything else."""
    v = raw.strip().lower()
    return True if v in TRUE_WORDS else False if v in FALSE_WORDS else None


def parse_bool(name: str, raw: str) -> bool:
    v = bool_word(raw)
    if v is None:
        raise BadInput(f"{name}={raw!r}: expected 0/1, true/false, yes/no or on/off")
    return v


def max_threads() -> int:
    """The most threads a run may ask for: ``MAX_THREADS_PER_CPU`` per CPU."""
    return MAX_THREADS_PER_CPU * (os.cpu_count() or 1)


def cache_root(env: Mapping[str, str] | None = None) -> Path | None:
    """``$TSSPEC_CACHE`` (expanded) if set and non-empty, else None (the caller's default). Any path
    the operating system takes is a path (relative ones are relative to the working directory);
    only blanks are refused."""
    raw = value(environ(env), ENV_CACHE)
    if raw is None:
        return None
    if not raw.strip():
        raise BadInput(f"{ENV_CACHE}={raw!r}: a blank path (unset it for the default cache)")
    return Path(raw).expanduser()


def cache_home(env: Mapping[str, str] | None = None) -> Path:
    """The folder the built kernels and the tokenizers' merges are cached under (each in a folder
    of its own): ``$TSSPEC_CACHE``, else ~/.cache/tsspec."""
    root = cache_root(env)
    return root if root is not None else Path.home() / ".cache" / "tsspec"


def kernels_enabled(env: Mapping[str, str] | None = None) -> bool:
    """``TSSPEC_KERNELS`` (default on); a value that is not a boolean is a BadInput, not a silent on."""
    raw = value(environ(env), ENV_KERNELS)
    return True if raw is None else parse_bool(ENV_KERNELS, raw)


def isa_choice(env: Mapping[str, str] | None = None) -> str:
    """``TSSPEC_ISA``: "auto" (default: the best level this CPU runs), or one of avx512, avx2, neon,
    scalar (case and blanks ignored). Whether the CPU has a forced level is the kernels' check."""
    raw = value(environ(env), ENV_ISA)
    if raw is None:
        return "auto"
    v = raw.strip().lower()
    if v not in ISA_WORDS:
        raise BadInput(f"{ENV_ISA}={raw!r}: expected {', '.join(ISA_WORDS)}")
    return v


def amx_mode(env: Mapping[str, str] | None = None) -> str:
    """``TSSPEC_AMX``: "auto" (default: the tiles only where measured faster than the SIMD path,
    which is nowhere yet, so off), "0" (never) or "1" (always: a machine without them is an error); booleans' other spellings
    read as 0/1. Anything else is a BadInput."""
    raw = value(environ(env), ENV_AMX)
    if raw is None or raw.strip().lower() == "auto":
        return "auto"
    v = bool_word(raw)
    if v is None:
        raise BadInput(f"{ENV_AMX}={raw!r}: expected auto, 0 or 1")
    return "1" if v else "0"


def prompt_tiles_mode(env: Mapping[str, str] | None = None) -> bool:
    """``TSSPEC_PROMPT_TILES``: 1 puts prompt rows' Q4_K and Q6_K products on the AMX tiles in the super-block
    arithmetic, and their Q4_0, Q4_1, Q5_0 and Q8_0 products in the 32-element one (faster prefill; prompt rows then round otherwise than generated ones, so a kept
    cache reuses prompt rows only); 0 (default) keeps every row on one arithmetic. Booleans' other
    spellings read as 0/1; anything else is a BadInput."""
    raw = value(environ(env), ENV_PROMPT_TILES)
    if raw is None or not raw.strip():
        return False
    v = bool_word(raw)
    if v is None:
        raise BadInput(f"{ENV_PROMPT_TILES}={raw!r}: expected 0 or 1")
    return v


def draft_vocab(env: Mapping[str, str] | None = None) -> int | None:
    """``TSSPEC_DRAFT_VOCAB``: how many of the first vocabulary ids a draft model chooses among,
    beside every id its sequence has used (``models/head_rows.py``); 0: the whole vocabulary; unset or
    "auto": None (the draft model's default). Anything else is a BadInput."""
    raw = value(environ(env), ENV_DRAFT_VOCAB)
    if raw is None or raw.strip().lower() == "auto":
        return None
    try:
        v = int(raw.strip())
    except ValueError:
        v = -1
    if v < 0:
        raise BadInput(f"{ENV_DRAFT_VOCAB}={raw!r}: expected auto, 0 (the whole vocabulary) or a count of ids")
    return v


def check_omp_threads(env: Mapping[str, str] | None = None) -> None:
    """``OMP_NUM_THREADS`` past ``MAX_THREADS_PER_CPU`` per CPU is one BadInput: the native kernels'
    OpenMP runtime segfaulted on 100000 (exit 139). A value the runtime cannot read it ignores
    itself (and says so), so only a readable count is checked."""
    raw = value(environ(env), ENV_OMP_THREADS)
    if raw is None:
        return
    most = max_threads()
    for part in raw.split(","):  # OpenMP's list form: one count per nesting level
        try:
            n = int(part.strip())
        except ValueError:
            return
        if n > most:
            raise BadInput(f"{ENV_OMP_THREADS}={raw!r}: at most {most} threads ({MAX_THREADS_PER_CPU} per CPU); "
                           f"lower it, or unset it and use --threads")


def omp_threads(env: Mapping[str, str] | None = None) -> int | None:
    """``OMP_NUM_THREADS`` as the OpenMP runtime reads it for the outer level (the first of its
    list form), where that is a positive integer; else None."""
    raw = value(environ(env), ENV_OMP_THREADS)
    first = raw.split(",")[0].strip() if raw is not None else ""
    return int(first) if first.isdigit() and int(first) > 0 else None


def c_compilers(env: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The C compilers to try for the native kernels, in order: ``$CC`` first."""
    return tuple(cc for cc in (environ(env).get(ENV_CC), "cc", "gcc", "clang") if cc)


def llama_cpp_dir(env: Mapping[str, str] | None = None) -> Path:
    """The llama.cpp peer checkout: ``$LLAMA_CPP_DIR``, else where the peer build puts it."""
    root = environ(env).get(ENV_LLAMA_CPP_DIR) or str(Path.home() / ".cache" / "tsspec-peer" / "llama.cpp")
    return Path(root).expanduser()


def process_age_s() -> float | None:
    """Seconds since this process started (the interpreter's own start-up included), from
    ``/proc``; None where there is no such clock. Resolution: one clock tick (10 ms)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def return_freed_memory() -> None:
    """Hand the heap's freed pages back to the system (glibc's ``malloc_trim``): building a large
    tokenizer leaves hundreds of MB freed but held (gemma3-270m's 262k vocabulary: 377 MB resident
    after the build, 103 MB after a trim). Nothing where the C library has no such call."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
