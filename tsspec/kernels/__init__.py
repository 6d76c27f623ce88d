"""Native kernels over GGUF blocks, compiled on first use and cached.

The C sources, one library (``tsq.h`` is what they share):
- ``products.c``: the GGUF products (x @ W.T over the stored blocks), the plain C reference, the
  AVX-512 VNNI path and the AVX2 path; ``neon.c``: the ARM64 NEON path (with and without dotprod);
- ``blocks.c``: a whole llama-family block forward (norms, rope, attention) over those products,
  and the trunk's output (final norm and LM head);
- ``eagle.c``: a trained draft head's step;
- ``amx.c``: the quantized products on AMX-INT8 tiles (the same bits as the others), with a C
  emulation of the tile instruction that tests them on any CPU.

AMX (``TSSPEC_AMX=auto|0|1``): when the library loads, the C side asks the kernel for the tile
permission (once per process, before any product runs). ``auto`` (the default) leaves the tiles off:
it is to take them only at row counts where they are measured faster than the SIMD path, and there
are none yet. ``1`` has them take the quantized products of at least ``AMX_MIN_ROWS`` input rows
where the CPU has AMX, the kernel grants it and a self-check (the tiles against the reference, every
type, 1 and 2 threads) passes. ``amx_status()`` says which and why; a failure there costs the tiles
only, never the library.

Instruction-set levels (``TSSPEC_ISA=auto|avx512|avx2|neon|scalar``): one shared object per level,
each built with that level's flags and ``-DTSQ_ISA`` (``LEVELS``), so no library links an
instruction its level lacks. ``auto`` takes the best level the CPU runs, read from its feature
flags (/proc/cpuinfo, as CPUID and HWCAP report them; ``cpu_levels``); where that level's build
fails it takes the next one and says why (``products_line``). A forced level the CPU lacks is one
BadInput. Every level computes every product's exact integer sums and the same float steps, so
all give the same bits.

They are built with the machine's C compiler (``cc``/``gcc``; ``-O3 -fopenmp`` and the level's
``-march``) into ``$TSSPEC_CACHE/kernels/`` (default ``~/.cache/tsspec/kernels/``) under a name that
hashes the sources, the flags, the compiler and the CPU's feature flags, so a rebuilt tree or another
CPU gets its own artifact and a cached one is reused. The build is atomic (temporary file, then
rename). A compiler without OpenMP (clang on macOS without libomp) gets a build without it, which
runs its products on one thread, and ``products_line`` says so.

Where no compiler is found, the build fails, or ``TSSPEC_KERNELS=0`` is set, ``lib()`` returns
None, ``unavailable_reason()`` says why, and the weight seam falls back to its pure-torch formats.

OpenMP: the library links ``libgomp.so.1``; torch's CPU wheel ships a library of that soname, and
the dynamic loader binds every later request for that soname to the one already loaded, so torch
and the kernels share one OpenMP runtime (one thread pool, no two pools spinning against each other
on a 2-core machine). This module does not import torch (a plain native run needs none of it,
``tsspec.models.lean``): before loading it loads torch's own ``libgomp.so.1`` by path
(``_bind_openmp``), so that a later ``import torch`` finds its runtime already in place.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import mmap
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from ..interrupts import catchable

if TYPE_CHECKING:
    import torch

SOURCE_DIR = Path(__file__).parent
HEADER = "tsq.h"
CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-fPIC", "-shared", "-std=c11"]
OPENMP_FLAG = "-fopenmp"


class Level:
    """One instruction-set level of the library: its ``-DTSQ_ISA`` value (tsq.h), the ``-march`` flag
    sets to try in order, and the name ``products_line`` gives it."""

    def __init__(self, name: str, isa: int, march: tuple[tuple[str, ...], ...], label: str):
        self.name, self.isa, self.march, self.label = name, isa, march, label

    def __repr__(self) -> str:
        return f"Level({self.name})"


# tsq.h's TSQ_ISA_* values. avx512 keeps -march=native (all the CPU has: GFNI, its tuning), as the
# library was built before there were levels; the others name their baseline, tuned for this CPU.
# scalar is the plain C reference, built for this CPU where the compiler can (fmaf inline), else
# for the architecture's baseline.
LEVELS = {
    "avx512": Level("avx512", 2, (("-march=native",),), "AVX-512 VNNI"),
    "avx2": Level("avx2", 1, (("-march=x86-64-v3", "-mtune=native"), ("-march=haswell",)), "AVX2"),
    "neon-dotprod": Level("neon-dotprod", 4, (("-march=armv8.2-a+dotprod", "-mtune=native"),
                                              ("-march=armv8.2-a+dotprod",)), "NEON dotprod"),
    "neon": Level("neon", 3, (("-march=armv8-a", "-mtune=native"), ("-march=armv8-a",)), "NEON"),
    "scalar": Level("scalar", 0, (("-march=native",), ()), "plain C"),
}
# what TSSPEC_ISA's words may pick, best first
ISA_CHOICES = {"avx512": ("avx512",), "avx2": ("avx2",), "neon": ("neon-dotprod", "neon"), "scalar": ("scalar",)}


def cpu_levels(flags: str | None = None, machine: str | None = None) -> list[str]:
    """The levels this CPU runs, best first (always ending with scalar). ``flags``: /proc/cpuinfo's
    flags (x86) or Features (ARM) line; ``machine``: ``platform.machine()``."""
    import platform

    machine = (machine if machine is not None else platform.machine()).lower()
    words = set((cpu_flags() if flags is None else flags).split())
    out = []
    if machine in ("x86_64", "amd64", "i686", "i386"):
        if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx2", "fma", "f16c"} <= words:
            out.append("avx512")
        if {"avx2", "fma", "f16c"} <= words:
            out.append("avx2")
    elif machine in ("aarch64", "arm64", "armv8l"):
        if "asimddp" in words or (flags is None and _darwin_dotprod()):
            out.append("neon-dotprod")
        out.append("neon")  # Advanced SIMD is part of every ARMv8-A (AArch64) core
    out.append("scalar")
    return out


def _darwin_dotprod() -> bool:
    """Apple silicon (no /proc/cpuinfo): sysctl's hw.optional.arm.FEAT_DotProd."""
    try:
        r = subprocess.run(["sysctl", "-n", "hw.optional.arm.FEAT_DotProd"], capture_output=True, text=True, timeout=5)
        return r.stdout.strip() == "1"
    except (OSError, subprocess.SubprocessError):
        return False


def sources() -> dict[str, bytes]:
    """This tree's kernel sources, file name -> bytes (every ``.c`` and ``.h`` beside this module)."""
    return {p.name: p.read_bytes() for p in sorted(SOURCE_DIR.iterdir()) if p.suffix in (".c", ".h")}


def type_ids(header: str) -> dict[str, int]:
    """The C type enum (``enum { T_F32 = 0, ... }`` in tsq.h) as GGUF type name -> id: the one
    definition, read rather than copied."""
    body = re.search(r"enum\s*\{([^}]*T_F32[^}]*)\}", header)
    if body is None:
        raise RuntimeError(f"{HEADER}: no type enum")
    ids = {n: int(v) for n, v in re.findall(r"T_(\w+)\s*=\s*(\d+)", body.group(1))}
    ids.pop("COUNT", None)
    return ids


# GGUF type name -> the C enum
TYPE_IDS = type_ids((SOURCE_DIR / HEADER).read_text())
QUANT_BLOCK = 32  # activation block: input rows are quantized per 32 elements
FLOAT_TYPES = ("F32", "F16", "BF16")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_reason: str | None = None
_tried = False
_force_off = False  # tests set this to exercise the pure-torch fallback in one process
_amx: str = "not checked"  # amx_status()'s answer once the library is loaded
_amx_error: Exception | None = None  # TSSPEC_AMX=1 where the tiles cannot run, or a TSSPEC_ISA this CPU
# lacks: raised by every lib()
_level: Level | None = None  # the loaded library's level
_skipped: list[str] = []  # better levels whose build failed, and why
_openmp = True  # the loaded library was built with OpenMP


_threads: int | None = None  # set_threads' count, for a run without torch


def set_threads(n: int) -> None:
    """The thread count every native call takes (``--threads``), set for torch too where it is
    imported (a caller that imports torch later sets it there itself)."""
    global _threads
    if n < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    _threads = n
    t = sys.modules.get("torch")
    if t is not None:
        t.set_num_threads(n)


def thread_count() -> int:
    """Threads a native call takes: torch's count where torch is imported (``--threads`` and the
    tests set it there), else ``set_threads``' count, else what torch would take by default
    (OMP_NUM_THREADS, else the physical cores): a run gets the same count with torch or without."""
    t = sys.modules.get("torch")
    if t is not None:
        return t.get_num_threads()
    return _threads if _threads is not None else default_threads()


@functools.lru_cache(maxsize=1)
def default_threads() -> int:
    """torch's default intra-op thread count, worked out without importing it: OMP_NUM_THREADS where
    it is a positive integer (``env.check_omp_threads`` refuses absurd ones), else the physical cores
    (distinct (physical id, core id) pairs of /proc/cpuinfo), else the logical CPUs."""
    from ..env import omp_threads

    n = omp_threads()
    if n is not None:
        return n
    cores, phys = set(), None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, val = line.partition(":")
            key = key.strip()
            if key == "physical id":
                phys = val.strip()
            elif key == "core id":
                cores.add((phys, val.strip()))
    except OSError:
        pass
    return len(cores) or os.cpu_count() or 1


def _bind_openmp() -> None:
    """Load torch's ``libgomp.so.1`` by path, before the kernel library, where torch is installed but
    not imported: the library's own ``libgomp.so.1`` then binds to it, and so does torch's when it is
    imported later (the loader reuses a loaded soname), so one OpenMP runtime serves both. Nothing
    where torch is imported already (its runtime is in place) or ships no such file."""
    if "torch" in sys.modules:
        return
    import importlib.util

    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return
    for d in (spec.submodule_search_locations or []) if spec is not None else []:
        gomp = Path(d, "lib", "libgomp.so.1")
        if gomp.exists():
            try:
                ctypes.CDLL(str(gomp), mode=ctypes.RTLD_GLOBAL)
            except OSError:
                pass
            return


def cache_dir() -> Path:
    from ..env import cache_home

    return cache_home() / "kernels"


def _compiler() -> str | None:
    from ..env import c_compilers

    for cc in c_compilers():
        if shutil.which(cc):
            return cc
    return None


def cpu_flags() -> str:
    """/proc/cpuinfo's flags line (x86) or Features line (ARM); empty where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


def _build(cc: str, srcs: dict[str, bytes] | None = None, flags: Sequence[str] | None = None) -> Path:
    """The cached shared library of ``srcs`` (file name -> bytes; default: this tree's ``sources()``)
    built with ``flags`` (default: the best level's first flag set), compiled on first use; keyed by
    the sources, the flags, the compiler and the CPU. (scripts/ab_kernels.py builds other revisions'
    sources through it.)"""
    srcs = sources() if srcs is None else srcs
    flags = list(flags) if flags is not None else level_flags(LEVELS[cpu_levels()[0]])[0]
    try:
        ver = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        ver = ""
    h = hashlib.sha256()
    for name in sorted(srcs):
        h.update(name.encode() + b"\0" + hashlib.sha256(srcs[name]).digest())
    h.update(" ".join(flags).encode() + ver.encode() + cpu_flags().encode())
    out = cache_dir() / f"tsq-{h.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tsq-", suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory(prefix=".tsq-src-", dir=out.parent) as d:
            for name, data in srcs.items():
                Path(d, name).write_bytes(data)
            c_files = [str(Path(d, n)) for n in sorted(srcs) if n.endswith(".c")]
            r = subprocess.run([cc, *flags, "-o", tmp, *c_files, "-lm"], capture_output=True, text=True,
                               timeout=300)
        if r.returncode != 0:
            msg = [ln for ln in (r.stderr or r.stdout).strip().splitlines() if "error" in ln] or \
                (r.stderr or r.stdout).strip().splitlines()
            raise RuntimeError(f"{cc} failed: {msg[0] if msg else 'exit ' + str(r.returncode)}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def level_flags(level: Level) -> list[list[str]]:
    """The compiler flag sets to try for ``level``, in order: each ``-march`` set with OpenMP, then
    the same without it (a compiler that lacks OpenMP still builds the native path)."""
    with_omp = [[*CFLAGS, *march, f"-DTSQ_ISA={level.isa}"] for march in level.march]
    return with_omp + [[f for f in fl if f != OPENMP_FLAG] for fl in with_omp]


def _load_level(cc: str, level: Level) -> tuple[ctypes.CDLL, bool]:
    """The library of ``level``, built if need be: (handle, built with OpenMP). Tries each flag set
    of ``level_flags``; raises the first failure's reason when none builds and loads."""
    first: Exception | None = None
    for flags in level_flags(level):
        try:
            with catchable():  # a Ctrl-C mid-build still removes the temporary file
                path = _build(cc, flags=flags)
            _bind_openmp()
            h = ctypes.CDLL(str(path))
            _declare(h)
            _check_layouts(h)
            if h.tsq_isa() != level.isa:
                raise RuntimeError(f"the {level.name} build reports level {h.tsq_isa()}")
            return h, OPENMP_FLAG in flags
        except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as e:
            first = first or e
    raise first if first is not None else RuntimeError("no flags to build with")


_L, _I, _P, _F = ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
# every function the library exports that Python calls: name -> (result, arguments)
SIGNATURES: dict[str, tuple] = {
    "tsq_simd": (_I, []),
    "tsq_isa": (_I, []),
    "tsq_xrow_bytes": (_L, [_L]),
    "tsq_row_bytes": (_L, [_I, _L]),
    "tsq_quantize": (None, [_P, _L, _L, _P]),
    "tsq_dequant_rows": (_I, [_I, _P, _I, _L, _L, _P, _L, _P]),
    "tsq_matmul": (_I, [_I, _P, _I, _L, _L, _L, _P, _P, _L, _P, _L, _I, _I]),
    "tsq_repack": (_I, [_I, _P, _L, _L, _L, _P, _I]),
    "tsq_unpack": (_I, [_I, _P, _L, _L, _L, _P, _I]),
    "tsq_forward": (_I, [_P, _P, _I, _I, _P, _L, _L, _P, _P, _L, _P, _P, _I]),
    "tsq_forward_batch_taps": (_I, [_P, _P, _I, _I, _P, _L, _L, _P, _P, _P, _P, _P, _P, _P, _I, _P, _I, _P]),
    "tsq_forward_tree": (_I, [_P, _P, _I, _I, _P, _L, _L, _P, _P, _P, _P, _P, _P, _P, _I, _P, _I, _P, _P, _P, _P, _P,
                              _L]),
    "tsq_output": (_I, [_P, _P, _F, _P, _L, _P, _I]),
    "tsq_eagle_step": (_I, [_P, _P, _P, _L, _P, _P, _I]),
    "tsq_amx_init": (_I, []),
    "tsq_amx_use": (_I, [_I, _L]),
    "tsq_matmul_amx": (_I, [_I, _P, _I, _L, _L, _L, _P, _L, _P, _L, _I, _I]),
    "tsq_sb_tiles_built": (_I, []),
    "tsq_sb_use": (_I, [_I]),
    "tsq_sb_in_use": (_I, []),
    "tsq_sb_types": (_I, [_I]),
    "tsq_forward_prompt": (_I, [_P, _P, _I, _I, _P, _L, _L, _P, _P, _L, _P, _P, _I, _I]),
    "tsq_forward_batch_prompt": (_I, [_P, _P, _I, _I, _P, _L, _L, _P, _P, _P, _P, _P, _P, _P, _I, _P, _I, _P, _P]),
    "tsq_forward_tree_prompt": (_I, [_P, _P, _I, _I, _P, _L, _L, _P, _P, _P, _P, _P, _P, _P, _I, _P, _I, _P, _P, _P, _P,
                                     _P, _L, _P]),
    "tsq_quantize_sb": (None, [_P, _L, _L, _P, _P, _P, _I]),
    "tsq_act_row": (None, [_I, _P, _P, _P, _L]),
    "tsq_matmul_sb": (_I, [_I, _P, _I, _L, _L, _L, _P, _L, _P, _L, _I, _I]),
    "tsq_matmul_sb_q": (_I, [_I, _P, _I, _L, _L, _L, _P, _P, _P, _L, _P, _L, _I, _I]),
}

# Input rows from which the tiles take a product under TSSPEC_AMX=1. Measured on a Sapphire Rapids
# Xeon (docs/RESULTS.md, AMX tiles): a whole qwen2.5-coder-1.5b forward on the tiles took 2.3x
# VNNI's time at 9 rows and 1.2-1.4x at 64-512 (only the 8960-wide down projection ran faster, at
# 128 rows and more: 0.86-0.93x), so no row count is faster and auto leaves them off; 128 keeps
# TSSPEC_AMX=1 to prefill chunks, where they cost least.
AMX_MIN_ROWS = 128
# tsq_amx_init's codes -> what ``amx_status`` says
AMX_REASONS = {1: "not on this CPU", 2: "not enabled by the operating system", 3: "permission refused",
               4: "not in this build (the compiler has no AMX support)"}


def _declare(lib) -> None:
    """Every function of ``SIGNATURES`` that ``lib`` has, typed; then an AttributeError naming the
    ones it lacks (an older build, as scripts/ab_kernels.py loads, has fewer: the ones it has are all
    declared, wherever the missing ones sit in the table; an undeclared function would take a
    float argument as a double)."""
    missing = []
    for name, (res, args) in SIGNATURES.items():
        f = getattr(lib, name, None)
        if f is None:
            missing.append(name)
            continue
        f.restype, f.argtypes = res, args
    if missing:
        raise AttributeError(f"the kernel library lacks {', '.join(missing)}")


def _enabled() -> bool:
    """``TSSPEC_KERNELS`` (default on); a value that is not a boolean is a BadInput, not a silent on.
    ``TSSPEC_AMX`` is read here too, so a bad value is refused before anything is cached."""
    from ..env import amx_mode, check_omp_threads, kernels_enabled

    on = kernels_enabled()
    if on:
        check_omp_threads()  # the kernels' OpenMP regions crash on an absurd OMP_NUM_THREADS
        amx_mode()
    return on


# What ``amx_status`` says under TSSPEC_AMX=auto where the tiles could run: auto takes them only
# where they are measured faster than the SIMD path for a row count, and that is nowhere yet (on a
# Sapphire Rapids Xeon, 2 threads, a qwen2.5-coder-1.5b forward took 1.2-2.3x VNNI's time at 9-512
# rows: the exact arithmetic's float step after every 16-element lane sends each 16x16 tile product
# through memory, and the tile stores stall; docs/RESULTS.md).
AMX_AUTO_OFF = ("off under auto (measured slower than VNNI at every row count on this CPU kind; "
                "TSSPEC_AMX=1 forces them)")


def _setup_amx(h: ctypes.CDLL) -> None:
    """Ask for the tile permission and switch the tiles on as ``TSSPEC_AMX`` says; sets ``_amx``.
    TSSPEC_AMX=1 where they cannot run leaves ``_amx_error`` for lib() to raise. Nothing here may
    cost the rest of the library: a failure in the self-check leaves the tiles off and says why."""
    global _amx, _amx_error
    from ..errors import BadInput
    from ..env import amx_mode

    mode = amx_mode()
    state = h.tsq_amx_init()  # the permission, asked once, on this (the loading) thread
    h.tsq_amx_use(0, AMX_MIN_ROWS)  # off until this setup says otherwise (a reloaded library keeps its state)
    if mode == "0":
        _amx = "off (TSSPEC_AMX=0)"
        return
    if state != 0:
        _amx = AMX_REASONS.get(state, f"unavailable (code {state})")
        if mode == "1":
            _amx_error = BadInput(f"TSSPEC_AMX=1: AMX cannot run here: {_amx}")
        return
    if mode == "auto":
        _amx = AMX_AUTO_OFF
        return
    bad = _checked(amx_self_check, h)
    if bad:
        _amx = f"self-check failed ({bad}): not used"
        _amx_error = BadInput(f"TSSPEC_AMX=1: the AMX tiles failed their self-check on this machine ({bad})")
        return
    h.tsq_amx_use(1, AMX_MIN_ROWS)
    _amx = "in use"


def _checked(check, h: ctypes.CDLL) -> str | None:
    """A self-check's answer, an exception in it included (the tiles' own failure, never the
    library's: it leaves them off and says why)."""
    try:
        return check(h)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


_prompt_tiles = "off"  # prompt_tiles_status()'s answer once the library is loaded


def _setup_prompt_tiles(h: ctypes.CDLL) -> None:
    """Switch prompt rows' products onto the routes' tiles as ``TSSPEC_PROMPT_TILES`` says (after
    ``_setup_amx``): where they cannot run, or fail their self-check, that is ``_amx_error`` for
    lib() to raise, one line."""
    global _prompt_tiles, _amx_error
    from ..env import amx_mode, prompt_tiles_mode
    from ..errors import BadInput

    h.tsq_sb_use(0)  # a reloaded library keeps its state
    _prompt_tiles = "off"
    if not prompt_tiles_mode():
        return
    why = None
    if amx_mode() == "0":
        why = "TSSPEC_AMX=0 forbids the tiles"
    elif h.tsq_amx_init() != 0:
        why = f"AMX cannot run here: {AMX_REASONS.get(h.tsq_amx_init(), h.tsq_amx_init())}"
    elif not h.tsq_sb_tiles_built():
        why = "this build has no super-block tile form (it needs AVX-512 VBMI)"
    elif bad := _checked(prompt_tiles_self_check, h):
        why = f"the tiles failed their self-check ({bad})"
    if why is not None:
        _amx_error = _amx_error or BadInput(f"TSSPEC_PROMPT_TILES=1: {why}")
        return
    h.tsq_sb_use(1)
    _prompt_tiles = "on the AMX tiles (TSSPEC_PROMPT_TILES=1)"


def prompt_tiles_self_check(h: ctypes.CDLL, *, hardware: bool = True) -> str | None:
    """The prompt routes' tile products (``hardware``: real tiles; else the emulation) against their
    reference on random rows of every type they take, 33 input rows and 40 weight rows, 1 and 2
    threads: None when every bit agrees, else what differed."""
    rng = np.random.default_rng(9)
    k = 512
    x = rng.standard_normal((33, k)).astype(np.float32)
    for name in PROMPT_ROUTE_TYPES:
        tid = TYPE_IDS[name]
        rb = h.tsq_row_bytes(tid, k)
        w = _sane_scales(name, rng.integers(0, 256, size=(40, rb), dtype=np.uint8))
        ref = np.zeros((33, 40), dtype=np.float32)
        if h.tsq_matmul_sb(tid, _ptr(w), 0, rb, 40, k, _ptr(x), 33, _ptr(ref), 40, 1, 0):
            return f"{name}: the reference refused"
        bad = _same_as(ref, lambda y, nt: h.tsq_matmul_sb(tid, _ptr(w), 0, rb, 40, k, _ptr(x), 33, _ptr(y), 40, nt,
                                                          1 if hardware else 2), f"{name}, ")
        if bad:
            return bad
    return None


def _same_as(ref: np.ndarray, run, label: str = "") -> str | None:
    """``run(y, threads)`` (-> a status, 0 fine) on 1 and 2 threads into a fresh ``y`` shaped as
    ``ref``: None where every bit equals ``ref``, else which run differed or was refused"""
    for nt in (1, 2):
        y = np.full(ref.shape, np.nan, dtype=np.float32)
        if run(y, nt):
            return f"{label}{nt} threads: refused"
        if not np.array_equal(y.view(np.int32), ref.view(np.int32)):
            return f"{label}{nt} threads"
    return None


def use_prompt_tiles(mode: str) -> None:
    """Route prompt rows' products of the types the routes take (``PROMPT_ROUTE_TYPES``): "off", "tiles" (the hardware), "emulated" or "reference"
    (the same arithmetic on any CPU: tests run a whole model through the route this way).
    ``TSSPEC_PROMPT_TILES`` sets this when the library loads; tests set it and put it back."""
    codes = {"off": 0, "tiles": 1, "emulated": 2, "reference": 3}
    if lib().tsq_sb_use(codes[mode]):
        raise ValueError(f"prompt rows cannot take the super-block route ({mode}) here")


# the weight types prompt rows' products can take off the shared arithmetic: the super-block route's, then the
# 32-element route's
PROMPT_ROUTE_TYPES = ("Q4_K", "Q6_K", "Q4_0", "Q4_1", "Q5_0", "Q8_0")


def prompt_tiles_types(names: list[str] | None = None) -> list[str]:
    """The weight types whose prompt-row products take the routes while they are on (all of
    ``PROMPT_ROUTE_TYPES`` by default); ``names`` sets them (a subset) and the ones before come back.
    For scripts that compare one type's share; set it between forwards only."""
    h = lib()
    ids = {n: TYPE_IDS[n] for n in PROMPT_ROUTE_TYPES}
    if names is not None and (bad := [n for n in names if n not in ids]):
        raise ValueError(f"the prompt routes take {', '.join(ids)}, not {', '.join(bad)}")
    was = h.tsq_sb_types(0)
    h.tsq_sb_types(was if names is None else sum(1 << ids[n] for n in set(names)))
    return [n for n, i in ids.items() if was >> i & 1]


def prompt_tiles_on() -> bool:
    """Whether prompt rows' products now round otherwise than generated rows' (the prompt routes are
    on, in any mode): a kept cache may then reuse prompt rows only."""
    h = lib()
    return bool(h is not None and h.tsq_sb_in_use())


def prompt_tiles_status() -> str:
    """What prompt rows' products take, for ``tsspec info``."""
    return _prompt_tiles if lib() is not None else "off"


def amx_self_check(h: ctypes.CDLL, *, hardware: bool = True) -> str | None:
    """The tile backend against the reference product on random weights of every quantized type,
    33 input rows (three tiles, a short one) and 40 weight rows (a short panel), on 1 and 2 threads:
    None when every bit agrees, else the first type (and threads) that differs. ``hardware``: the
    real tiles (needs AMX and the permission); False runs the emulation, which the tests do on
    every CPU so this code is run where there is no AMX."""
    rng = np.random.default_rng(7)
    k = 256
    x = rng.standard_normal((33, k)).astype(np.float32)
    xq = np.empty(33 * h.tsq_xrow_bytes(k), dtype=np.uint8)
    h.tsq_quantize(_ptr(x), 33, k, _ptr(xq))
    for name, tid in TYPE_IDS.items():
        if name in FLOAT_TYPES:
            continue
        rb = h.tsq_row_bytes(tid, k)
        w = _sane_scales(name, rng.integers(0, 256, size=(40, rb), dtype=np.uint8))
        ref = np.zeros((33, 40), dtype=np.float32)
        if h.tsq_matmul(tid, _ptr(w), 0, rb, 40, k, _ptr(x), _ptr(xq), 33, _ptr(ref), 40, 1, 0):
            return name
        bad = _same_as(ref, lambda y, nt: h.tsq_matmul_amx(tid, _ptr(w), 0, rb, 40, k, _ptr(xq), 33, _ptr(y), 40,
                                                           nt, 0 if hardware else 1), f"{name}, ")
        if bad:
            return bad
    return None


def _sane_scales(name: str, w: np.ndarray) -> np.ndarray:
    """Random GGUF rows with their f16 scales set to small finite values (random bytes make NaN and
    infinite scales, whose sums compare unequal to themselves)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    elems, size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    blocks = w.reshape(w.shape[0], -1, size)
    half = np.array([0.01], dtype=np.float16).view(np.uint8)  # a 1-d array: numpy 2 refuses to view a 0-d scalar
    at = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}[name]
    for o in at:
        blocks[:, :, o], blocks[:, :, o + 1] = half[0], half[1]
    return blocks.reshape(w.shape)


def products_line() -> str:
    """One line on which path the products take, for ``tsspec info``: "native, AVX2; AMX: ...",
    with any better level that failed to build and why, or why there is no native path."""
    h = lib()
    if h is None:
        return f"pure torch (native kernels unavailable: {unavailable_reason()})"
    notes = [f"{s} (not built)" for s in _skipped]
    if not _openmp:
        notes.append("built without OpenMP: one thread")
    extra = f" [{'; '.join(notes)}]" if notes else ""
    line = f"native, {_level.label}{extra}; AMX: {amx_status()}"
    return line + (f"; prompt rows: {_prompt_tiles}" if prompt_tiles_on() else "")


def use_tiles(mode: int, min_rows: int = AMX_MIN_ROWS) -> None:
    """Route the quantized products of at least ``min_rows`` rows: 0 off the tiles, 1 the hardware
    tiles, 2 their C emulation (tests run a whole model through the backend on any CPU this way).
    ``TSSPEC_AMX`` sets this when the library loads; tests set it and put it back."""
    rc = lib().tsq_amx_use(mode, min_rows)
    if rc:
        raise ValueError(f"the AMX tiles cannot be switched on: {AMX_REASONS.get(rc, rc)}")


def amx_usable() -> bool:
    """Whether the hardware tiles can run in this process (the CPU has AMX, the OS enables it and the
    kernel granted the permission), whatever ``TSSPEC_AMX`` chose."""
    h = lib()
    return bool(h is not None and h.tsq_amx_init() == 0)


def amx_status() -> str:
    """Which product path the quantized multi-row products take on AMX, and why: "in use", "not on
    this CPU", "permission refused", "off (TSSPEC_AMX=0)", ... (the kernels' own reason where they
    are not built)."""
    h = lib()
    if h is None:
        return f"not used (native kernels unavailable: {unavailable_reason()})"
    return _amx


def _choose_levels() -> list[Level]:
    """The levels to try, best first: TSSPEC_ISA's, or every level this CPU runs under auto. A forced
    level the CPU lacks is a BadInput (raised by every ``lib()``)."""
    from ..env import ENV_ISA, isa_choice
    from ..errors import BadInput

    choice = isa_choice()
    here = cpu_levels()
    if choice == "auto":
        return [LEVELS[n] for n in here]
    have = [n for n in ISA_CHOICES[choice] if n in here]
    if not have:
        raise BadInput(f"{ENV_ISA}={choice}: this CPU cannot run it (it runs {', '.join(here)})")
    return [LEVELS[have[0]]]


def lib() -> ctypes.CDLL | None:
    """The loaded kernel library, building it on first use; None when unavailable."""
    global _lib, _reason, _tried, _level, _skipped, _openmp, _amx_error
    if _force_off:
        return None
    if _amx_error is not None:
        raise _amx_error
    if _tried:
        return _lib
    enabled = _enabled()  # raises on a bad value, before anything is cached
    with _lock:
        if _tried:
            return _lib
        try:
            if not enabled:
                raise RuntimeError("disabled by TSSPEC_KERNELS=0")
            levels = _choose_levels()
            cc = _compiler()
            if cc is None:
                raise RuntimeError("no C compiler found (install gcc, or set CC)")
            h = None
            for lv in levels:
                try:
                    h, _openmp = _load_level(cc, lv)
                    _level = lv
                    break
                except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as e:
                    _skipped.append(f"{lv.label}: {e}")
            if h is None:
                raise RuntimeError("; ".join(_skipped))
            _setup_amx(h)
            _setup_prompt_tiles(h)
            _lib = h
        except Exception as e:  # noqa: BLE001 - any failure means: use the pure-torch formats
            from ..errors import BadInput

            if isinstance(e, BadInput):  # a forced level this CPU lacks: refused on every call
                _amx_error = e
            _reason = str(e) or type(e).__name__
            _lib = None
        _tried = True
    if _amx_error is not None:
        raise _amx_error
    return _lib


def load_level(name: str) -> ctypes.CDLL:
    """The library of level ``name`` (``LEVELS``) as a handle of its own, built if need be, beside
    whatever ``lib()`` loaded (tests and scripts compare levels in one process). Its AMX tiles stay
    off. Raises RuntimeError where it cannot be built or loaded."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (install gcc, or set CC)")
    h, _ = _load_level(cc, LEVELS[name])
    return h


def level() -> str | None:
    """The instruction-set level of the loaded library (``LEVELS``' names), None without one."""
    return _level.name if lib() is not None and _level is not None else None


def available() -> bool:
    return lib() is not None


def unavailable_reason() -> str | None:
    if lib() is None and _force_off:
        return "switched off for this process"
    return _reason


def simd() -> bool:
    """Whether the loaded library runs the AVX-512 VNNI products (the level the AMX tiles pair with)."""
    h = lib()
    return bool(h and h.tsq_simd())


def takes(type_name: str, k: int) -> bool:
    """Whether the native kernels (any level: each has every type) multiply rows of ``k`` elements
    of this GGUF type as stored."""
    if type_name not in TYPE_IDS or lib() is None:
        return False
    return lib().tsq_row_bytes(TYPE_IDS[type_name], k) > 0 and (type_name in FLOAT_TYPES or k % QUANT_BLOCK == 0)


def _ptr(a) -> int:
    """The address of a numpy array's or a torch tensor's first element."""
    if isinstance(a, np.ndarray):
        return a.ctypes.data
    return a.data_ptr()


def quantize(x: "torch.Tensor") -> "torch.Tensor":
    """x float32 [m, k] (contiguous, k a multiple of 32) -> the form every quantized type multiplies
    (int8 per 32 elements in groups of 128, ``xgroup`` in tsq.h), as an opaque byte tensor. Float
    types multiply x itself."""
    import torch

    h = lib()
    m, k = x.shape
    out = torch.empty(m * h.tsq_xrow_bytes(k), dtype=torch.uint8)
    h.tsq_quantize(_ptr(x), m, k, _ptr(out))
    return out


class _HugeArena:
    """Memory for repacked weights in 2 MiB-page-advised chunks (``MADV_HUGEPAGE``), handed out
    front to back: a decode step streams every weight once, and in 4 KiB pages each page costs a TLB
    walk and stops the hardware prefetcher. Chunks are never returned (weights live as long as
    the model, and the arrays keep their chunk alive)."""

    CHUNK = 64 << 20
    ALIGN = 4096

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buf: mmap.mmap | None = None
        self._used = 0

    @staticmethod
    def _map(size: int) -> mmap.mmap:
        buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                buf.madvise(mmap.MADV_HUGEPAGE)
            except OSError:  # a kernel without transparent huge pages: ordinary pages
                pass
        return buf

    def empty(self, shape: tuple[int, ...]) -> np.ndarray:
        size = int(np.prod(shape))
        if size >= self.CHUNK // 4:  # a large matrix: a mapping of its own
            return np.frombuffer(self._map(size), np.uint8, size).reshape(shape)
        with self._lock:
            if self._buf is None or self._used + size > self.CHUNK:
                self._buf, self._used = self._map(self.CHUNK), 0
            a = np.frombuffer(self._buf, np.uint8, size, self._used).reshape(shape)
            self._used += -(-size // self.ALIGN) * self.ALIGN
            return a


_arena = _HugeArena()


def repack(type_name: str, w: np.ndarray, k: int, *, threads: int | None = None,
           done: Callable[[np.ndarray], object] | None = None) -> np.ndarray:
    """A copy of the GGUF rows ``w`` (uint8 [n, row_bytes]) stored for the products (``tsq_repack``):
    each whole group of 128 elements with its code bits transposed, and for Q4_0, Q4_1 and Q8_0 its
    four blocks' scales gathered ahead of the codes; values unchanged. ``matmul`` takes it with
    ``packed=True``; ``unpack`` gives the stored layout back. ``threads``: see ``repack_threads``.
    ``done(rows)``: called with each stretch of ``w`` (about ``REPACK_CHUNK_BYTES``) once it is
    copied, rows being independent (a loader lets go of the file's pages behind it)."""
    return _repack(type_name, w, k, inverse=False, threads=threads, done=done)


def unpack(type_name: str, w: np.ndarray, k: int, *, threads: int | None = None) -> np.ndarray:
    """The inverse of ``repack``: rows in the file's own layout."""
    return _repack(type_name, w, k, inverse=True, threads=threads)


def repack_threads() -> int:
    """Threads a repack takes by default: ``thread_count()`` (``--threads``) on the main thread, one on
    any other. The loader repacks a model's layers in a pool of ``--threads`` threads, each of which
    would otherwise open an OpenMP team as wide as the machine (on 8 cores, 74 threads at once; the
    cores are already shared out by the pool)."""
    return thread_count() if threading.current_thread() is threading.main_thread() else 1


REPACK_CHUNK_BYTES = 16 << 20  # a repack that reports its progress does it this many source bytes at a time


def _repack(type_name: str, w: np.ndarray, k: int, *, inverse: bool, threads: int | None = None,
            done: Callable[[np.ndarray], object] | None = None) -> np.ndarray:
    if type_name in FLOAT_TYPES:
        raise ValueError(f"{type_name}: float weights are not repacked")
    nt = repack_threads() if threads is None else threads
    if nt < 1:
        raise ValueError(f"threads must be >= 1, got {nt}")
    out = _arena.empty(w.shape) if not inverse and w.dtype == np.uint8 else np.empty_like(w)
    fn = lib().tsq_unpack if inverse else lib().tsq_repack
    src = np.ascontiguousarray(w)
    n = w.shape[0]
    step = n if done is None else max(1, REPACK_CHUNK_BYTES // max(1, w.shape[1]))
    for a in range(0, n, max(step, 1)):
        b = min(n, a + step)
        if fn(TYPE_IDS[type_name], _ptr(src[a:b]), w.shape[1], b - a, k, _ptr(out[a:b]), nt):
            raise ValueError(f"{type_name}: cannot repack rows of {k} elements")
        if done is not None:
            done(src[a:b])
    return out


def matmul(type_name: str, w: np.ndarray, k: int, x: "torch.Tensor", xq: "torch.Tensor | None", y: "torch.Tensor",
           col0: int = 0, *, packed: bool = False, threads: int | None = None, use_simd: bool = True) -> None:
    """y[:, col0 : col0 + n] = x @ W.T for W the GGUF rows ``w`` (uint8 [n, row_bytes]; ``packed``:
    as ``repack`` stores them).

    x float32 [m, k] contiguous; ``xq`` its ``quantize(x)`` form (quantized
    types); y float32 [m, >= col0 + n] contiguous."""
    h = lib()
    n, rb = w.shape
    m = x.shape[0]
    ldy = y.shape[1]
    nt = threads if threads is not None else thread_count()
    rc = h.tsq_matmul(TYPE_IDS[type_name], _ptr(w), 1 if packed else 0, rb, n, k, _ptr(x), 0 if xq is None else _ptr(xq), m,
                      _ptr(y) + 4 * col0, ldy, nt, 1 if use_simd else 0)
    _check_rc(rc, f"{type_name}: cannot multiply rows of {k} elements")


def matmul_tiles(type_name: str, w: np.ndarray, k: int, xq: "torch.Tensor", y: "torch.Tensor", *, packed: bool = False,
                 threads: int | None = None, emulate: bool = True) -> None:
    """y[m, n] = the quantized input ``xq`` (``quantize(x)``, m rows) against the GGUF rows ``w``
    through the AMX tile backend: ``emulate`` (default) with the tile instruction done in C, on any
    CPU; else on the hardware (a ValueError where it cannot run). The same bits as ``matmul``."""
    h = lib()
    n, rb = w.shape
    m, ldy = y.shape
    nt = threads if threads is not None else thread_count()
    rc = h.tsq_matmul_amx(TYPE_IDS[type_name], _ptr(w), 1 if packed else 0, rb, n, k, _ptr(xq), m, _ptr(y), ldy, nt,
                          1 if emulate else 0)
    _check_rc(rc, f"{type_name}: the tile backend cannot multiply rows of {k} elements here")


# matmul_sb's modes: the C reference, the AMX tiles, the tiles with their instruction done in C
SB_MODES = {"reference": 0, "tiles": 1, "emulated": 2}


def sb_tiles_built() -> bool:
    """Whether the loaded library has the super-block tile form (the AVX-512 level with VBMI): its
    ``emulated`` mode then runs on this CPU, its ``tiles`` mode where AMX runs too."""
    return bool(lib().tsq_sb_tiles_built())


def matmul_sb(type_name: str, w: np.ndarray, k: int, x: "torch.Tensor", y: "torch.Tensor", *, packed: bool = False,
              threads: int | None = None, mode: str = "reference") -> None:
    """y[m, n] = x [m, k] against the rows ``w`` in a prompt route's arithmetic (prompt_tiles.c): Q4_K
    and Q6_K in the super-block one (inputs quantized per 256 elements, one float step per
    super-block), Q4_0, Q4_1, Q5_0 and Q8_0 in the 32-element one (inputs as every product quantizes them,
    one float step per block), through ``mode`` (``SB_MODES``); every mode gives the same bits. A
    ValueError for another type, or a mode this build or CPU cannot run."""
    h = lib()
    n, rb = w.shape
    m, ldy = y.shape
    nt = threads if threads is not None else thread_count()
    rc = h.tsq_matmul_sb(TYPE_IDS[type_name], _ptr(w), 1 if packed else 0, rb, n, k, _ptr(x), m, _ptr(y), ldy, nt,
                         SB_MODES[mode])
    _check_rc(rc, f"{type_name}: the super-block product ({mode}) cannot multiply rows of {k} elements here")


def quantize_sb(x: "torch.Tensor") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x float32 [m, k] (k a multiple of 256) -> (codes int8 [m, k], dx float32 [m, k / 256], the
    32-element code sums int16 [m, k / 32]): the input form of the super-block arithmetic."""
    h = lib()
    m, k = x.shape
    q = np.empty((m, k), dtype=np.int8)
    dx = np.empty((m, k // 256), dtype=np.float32)
    xs = np.empty((m, k // 32), dtype=np.int16)
    h.tsq_quantize_sb(_ptr(x), m, k, q.ctypes.data, dx.ctypes.data, xs.ctypes.data, thread_count())
    return q, dx, xs


def dequant_rows(type_name: str, w: np.ndarray, k: int, ids, *, packed: bool = False) -> "torch.Tensor":
    """Rows ``ids`` of the GGUF weight ``w`` (uint8 [rows, row_bytes]; ``packed``: as ``repack``
    stores them) as float32 [len(ids), k]."""
    import torch

    return torch.from_numpy(dequant_rows_np(type_name, w, k, ids, packed=packed))


def dequant_rows_np(type_name: str, w: np.ndarray, k: int, ids, *, packed: bool = False) -> np.ndarray:
    """``dequant_rows`` as a numpy array (the same bits; no torch)."""
    h = lib()
    idx = np.ascontiguousarray(np.asarray(ids, dtype=np.int64))
    out = np.empty((len(idx), k), dtype=np.float32)
    _check_rc(h.tsq_dequant_rows(TYPE_IDS[type_name], _ptr(w), 1 if packed else 0, w.shape[1], k, idx.ctypes.data,
                                 len(idx), _ptr(out)), "dequant_rows failed")
    return out


def _check_rc(rc: int, what: str, error: type[Exception] = ValueError) -> None:
    """A native call's status: 0 fine, -2 out of memory (the C side allocates its scratch and
    says so rather than writing through a null pointer), anything else ``error(what)``."""
    if rc == -2:
        raise MemoryError("native kernels: out of memory for their scratch buffers")
    if rc != 0:
        raise error(what)


# ----------------------------------------------------------------------------- fused blocks

MAX_PARTS = 4


class CLinear(ctypes.Structure):
    _fields_ = [("nparts", ctypes.c_int), ("type", ctypes.c_int * MAX_PARTS), ("packed", ctypes.c_int * MAX_PARTS),
                ("w", ctypes.c_void_p * MAX_PARTS), ("row_bytes", ctypes.c_long * MAX_PARTS),
                ("n", ctypes.c_long * MAX_PARTS), ("k", ctypes.c_long), ("n_total", ctypes.c_long),
                ("bias", ctypes.c_void_p)]


class CLayer(ctypes.Structure):
    _fields_ = [("qkv", CLinear), ("o", CLinear), ("gate_up", CLinear), ("down", CLinear),
                ("attn_norm", ctypes.c_void_p), ("ffn_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("post_attn_norm", ctypes.c_void_p),
                ("post_ffn_norm", ctypes.c_void_p), ("window", ctypes.c_long), ("rope", ctypes.c_int)]


class CEagle(ctypes.Structure):
    _fields_ = [("fc", CLinear), ("gate_up", CLinear), ("down", CLinear), ("head", CLinear),
                ("enorm", ctypes.c_void_p), ("hnorm", ctypes.c_void_p), ("ffn_norm", ctypes.c_void_p),
                ("out_norm", ctypes.c_void_p), ("ffn", ctypes.c_long), ("eps", ctypes.c_float), ("act", ctypes.c_int)]


class CConfig(ctypes.Structure):
    _fields_ = [("d_model", ctypes.c_long), ("n_heads", ctypes.c_long), ("n_kv", ctypes.c_long),
                ("head_dim", ctypes.c_long), ("ffn_dim", ctypes.c_long), ("rope_half", ctypes.c_long),
                ("rope_neox", ctypes.c_int), ("act", ctypes.c_int), ("eps", ctypes.c_float),
                ("q_scale", ctypes.c_float)]


def _check_layouts(h: ctypes.CDLL) -> None:
    """Each C structure the library defines has the size of its Python mirror (an older build that
    lacks a structure, as scripts/ab_kernels.py loads, is checked on the ones it has)."""
    for fn, cls in (("tsq_sizeof_linear", CLinear), ("tsq_sizeof_layer", CLayer), ("tsq_sizeof_config", CConfig),
                    ("tsq_sizeof_eagle", CEagle)):
        try:
            f = getattr(h, fn)
        except AttributeError:
            continue
        f.restype = ctypes.c_int
        if f() != ctypes.sizeof(cls):
            raise RuntimeError(f"{fn}: C and Python layouts differ ({f()} vs {ctypes.sizeof(cls)})")


def c_linear(*lins) -> CLinear | None:
    """The C view of a ``Linear`` on the gguf backend, or of several stacked along N (their parts in
    order, one product's output columns after another's; no copy), or None when one is not on that
    backend, their widths differ or they hold more than ``MAX_PARTS`` parts."""
    parts = []
    for lin in lins:
        if getattr(lin, "fmt", None) != "gguf" or lin.in_features != lins[0].in_features:
            return None
        parts += lin.parts
    if len(parts) > MAX_PARTS or (len(lins) > 1 and any(lin.bias is not None for lin in lins)):
        return None
    c = CLinear()
    c.nparts = len(parts)
    for i, p in enumerate(parts):
        c.type[i] = TYPE_IDS[p.type_name]
        c.packed[i] = 1 if p.packed else 0
        c.w[i] = p.raw.ctypes.data
        c.row_bytes[i] = p.raw.shape[1]
        c.n[i] = p.shape[0]
    c.k = lins[0].in_features
    c.n_total = sum(lin.out_features for lin in lins)
    c.bias = _ptr(lins[0].bias) if lins[0].bias is not None else None
    return c


class FusedOutput:
    """A llama-family trunk's final norm and LM head as one native call (``tsq_output``)."""

    def __init__(self, head: CLinear, norm, eps: float, keep: list):
        self.head = head
        self.norm = norm  # float32, contiguous (a tensor or an array)
        self.eps = eps
        self._keep = keep

    def __call__(self, h):
        """Logits [m, vocab] of the residual rows ``h`` [m, d] (float32): a numpy array for a numpy
        ``h`` (``models.lean``), else a torch tensor."""
        if isinstance(h, np.ndarray):
            h = np.ascontiguousarray(h)
            y = np.empty((h.shape[0], self.head.n_total), dtype=np.float32)
        else:
            import torch

            h = h.contiguous()
            y = torch.empty(h.shape[0], self.head.n_total, dtype=torch.float32)
        rc = lib().tsq_output(ctypes.byref(self.head), _ptr(self.norm), self.eps, _ptr(h), h.shape[0], _ptr(y),
                              thread_count())
        _check_rc(rc, f"native output failed ({rc})", RuntimeError)
        return y


class FusedEagle:
    """A trained per-token draft head's step (``tsspec.drafters.eagle.head_step``, silu MLP) and its
    draft vocabulary's logits as one native call (``tsq_eagle_step``). ``build`` makes one."""

    def __init__(self, c: CEagle, d: int, vocab: int, keep: list):
        self.c, self.d, self.vocab = c, d, vocab
        self._keep = keep  # the weights and norms whose addresses ``c`` holds

    @classmethod
    def build(cls, fc, gate, up, down, head, norms: dict[str, torch.Tensor], eps: float) -> "FusedEagle | None":
        """The native step over these ``Linear``s (gate and up run as one product, without a copy)
        and the norms enorm, hnorm, ffn_norm, out_norm ([d]); None where a matrix is off the gguf
        backend or the SIMD kernels are missing (the torch step then runs)."""
        if not available():
            return None
        lins = (c_linear(fc), c_linear(gate, up), c_linear(down), c_linear(head))
        if any(x is None for x in lins):
            return None
        c = CEagle()
        c.fc, c.gate_up, c.down, c.head = lins
        norms = {n: norms[n].float().contiguous() for n in ("enorm", "hnorm", "ffn_norm", "out_norm")}
        for n, t in norms.items():
            setattr(c, n, t.data_ptr())
        c.ffn = gate.out_features
        c.eps = eps
        c.act = 0  # head_step's silu
        return cls(c, fc.out_features, head.out_features, [fc, gate, up, down, head, norms])

    def __call__(self, e: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [m, vocab], h' [m, d]) for embedding rows ``e`` and hidden rows ``h`` [m, d]."""
        import torch

        e = e.float().contiguous()
        h = h.float().contiguous()
        m = e.shape[0]
        if e.shape != (m, self.d) or h.shape != (m, self.d):
            raise ValueError(f"draft head step: rows of width {self.d} expected, got {tuple(e.shape)}, {tuple(h.shape)}")
        out = torch.empty(m, self.d, dtype=torch.float32)
        logits = torch.empty(m, self.vocab, dtype=torch.float32)
        rc = lib().tsq_eagle_step(ctypes.byref(self.c), e.data_ptr(), h.data_ptr(), m, out.data_ptr(),
                                  logits.data_ptr(), thread_count())
        _check_rc(rc, f"native draft head step failed ({rc})", RuntimeError)
        return logits, out


class FusedBlocks:
    """Every block of a llama-family trunk as one C call per forward (``tsq_forward``), and its
    ``output`` (``FusedOutput``) where the head runs natively too."""

    def __init__(self, config: CConfig, layers: list[CLayer], keep: list, output: FusedOutput | None = None):
        self.config = config
        self.layers = (CLayer * len(layers))(*layers)
        self._keep = keep  # the tensors whose addresses the structures hold
        self.output = output  # the final norm and LM head, where the head is native too

    def run(self, h, l0: int, l1: int, start: int, k_cache, v_cache, cos: list, sin: list,
            taps: Sequence[int] = (), prompt: bool = False) -> "torch.Tensor | None":
        """Blocks [l0, l1) on the residual ``h`` [m, d] (float32, contiguous, updated in place):
        torch tensors, or numpy arrays throughout (``models.lean``; without ``taps``).
        ``taps`` (layers in [l0, l1]; l1: after the last): the residual entering each, copied out
        in the same call -> [m, len(taps) * d], tap j of a row in columns j*d..(j+1)*d. ``prompt``:
        the rows are prompt rows (their products take the prompt routes where they are on)."""
        if taps:
            return self.run_batch(h, l0, l1, [0, h.shape[0]], [start], [k_cache], [v_cache], cos, sin, taps,
                                  prompt=[prompt])
        h_lib = lib()
        cos_p = (ctypes.c_void_p * len(cos))(*[_ptr(t) for t in cos])
        sin_p = (ctypes.c_void_p * len(sin))(*[_ptr(t) for t in sin])
        args = (ctypes.byref(self.config), self.layers, l0, l1, _ptr(h), h.shape[0], start, _ptr(k_cache),
                _ptr(v_cache), k_cache.shape[2], cos_p, sin_p, thread_count())
        rc = h_lib.tsq_forward_prompt(*args, 1) if prompt else h_lib.tsq_forward(*args)
        _check_rc(rc, f"native block forward failed ({rc})", RuntimeError)

    def run_batch(self, h: torch.Tensor, l0: int, l1: int, row0: list[int], starts: list[int],
                  k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], cos: list[torch.Tensor],
                  sin: list[torch.Tensor], taps: Sequence[int] = (), trees: Sequence | None = None,
                  prompt: Sequence[bool] | None = None) -> torch.Tensor | None:
        """Blocks [l0, l1) on the rows of several sequences, ``h`` [m, d] updated in place: rows
        ``row0[s]:row0[s + 1]`` are sequence s's, at positions ``starts[s]..`` of its own cache
        (``k_caches[s]``/``v_caches[s]`` [layers, n_kv, capacity, head_dim], float32, contiguous).
        The products run once over all rows; each row attends over its own sequence only, and gets
        the bits a lone ``run`` gives it. ``taps``: as ``run``'s.

        ``trees`` (None: every sequence's rows are a chain): token trees, one
        ``models.runners.TreeLayout`` per sequence (a chain's too). A tree row is written to slot
        ``starts[s]`` + its index and sits at its layout's position; its attention reads the cache's
        first ``base`` slots, then its path's slots, so it gets the bits a chain of its path gets.

        ``prompt`` (None: none): per sequence, whether its rows are prompt rows (``run``'s), with or
        without ``trees`` (a prompt chunk may share a forward with another sequence's tree)."""
        import torch

        ns = len(starts)
        if any(not l0 <= t <= l1 for t in taps):
            raise ValueError(f"run_batch: taps {list(taps)} outside layers [{l0}, {l1}]")
        if not (len(row0) == ns + 1 and len(k_caches) == len(v_caches) == ns and row0[0] == 0
                and row0[-1] == h.shape[0]):
            raise ValueError("run_batch: row offsets, starts and caches disagree")
        for k, v in zip(k_caches, v_caches):
            if not (k.is_contiguous() and v.is_contiguous() and k.dtype == v.dtype == torch.float32
                    and k.shape == v.shape):
                raise ValueError("run_batch: caches must be contiguous float32 K/V of one shape")
        h_lib = lib()
        longs = ctypes.c_long * ns
        ptrs = ctypes.c_void_p * ns
        cos_p = (ctypes.c_void_p * len(cos))(*[t.data_ptr() for t in cos])
        sin_p = (ctypes.c_void_p * len(sin))(*[t.data_ptr() for t in sin])
        out = torch.empty(h.shape[0], len(taps) * h.shape[1], dtype=torch.float32) if taps else None
        args = (ctypes.byref(self.config), self.layers, l0, l1, h.data_ptr(), h.shape[0], ns,
                (ctypes.c_long * (ns + 1))(*row0), longs(*starts), ptrs(*[k.data_ptr() for k in k_caches]),
                ptrs(*[v.data_ptr() for v in v_caches]), longs(*[k.shape[2] for k in k_caches]), cos_p, sin_p,
                thread_count(), (ctypes.c_int * len(taps))(*taps), len(taps),
                None if out is None else out.data_ptr())
        marks = None
        if prompt is not None and any(prompt):
            if len(prompt) != ns:
                raise ValueError("run_batch: one prompt flag per sequence")
            marks = (ctypes.c_uint8 * ns)(*[1 if p else 0 for p in prompt])
        if trees is None and marks is not None:
            rc = h_lib.tsq_forward_batch_prompt(*args, marks)
        elif trees is None:
            rc = h_lib.tsq_forward_batch_taps(*args)
        else:
            if len(trees) != ns or any(len(t.positions) != row0[s + 1] - row0[s] for s, t in enumerate(trees)):
                raise ValueError("run_batch: one tree layout per sequence, a position per row")
            pos = [p for t in trees for p in t.positions]
            paths = [p for t in trees for p in t.paths]
            off, n = [], 0
            for p in paths:
                off.append(n)
                n += len(p)
            flat = [x for p in paths for x in p]
            m = h.shape[0]
            tree_args = (longs(*[t.base for t in trees]), (ctypes.c_long * m)(*pos), (ctypes.c_long * m)(*off),
                         (ctypes.c_long * max(n, 1))(*flat), n)
            if marks is not None:
                rc = h_lib.tsq_forward_tree_prompt(*args, *tree_args, marks)
            else:
                rc = h_lib.tsq_forward_tree(*args, *tree_args)
        _check_rc(rc, f"native batched block forward failed ({rc})", RuntimeError)
        return out
