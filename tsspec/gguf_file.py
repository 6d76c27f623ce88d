"""Reading GGUF files: memory-mapped metadata and tensors, with clear errors on bad files.

Dequantization is gguf-py's (``gguf.quants.dequantize``); nothing here re-implements a quant type.
"""

from __future__ import annotations

import os
import re
import stat
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .errors import ModelFileError

GGUF_MAGIC = b"GGUF"


def _fast_reader_class():
    """gguf-py's reader, with metadata arrays read as one view instead of one numpy view per element.

    A 262k-entry vocabulary otherwise costs gguf-py ~10 s of per-element views on this CPU. Numeric
    arrays become a single array part (``contents()`` reads them unchanged); string arrays are
    decoded here into ``reader.string_arrays`` keyed by the value's offset, and their field holds
    one raw byte view so sizes and offsets stay exactly what gguf-py computes.
    """
    import gguf
    from gguf.constants import GGUFValueType

    class FastReader(gguf.GGUFReader):
        def __init__(self, path, mode="r"):
            self.file_name = Path(path).name
            super().__init__(path, mode)

        def _build_tensors(self, start_offs, fields):
            """gguf-py's tensor views; where it cannot make them (a tensor's bytes run past the end of
            a cut file: numpy's "cannot reshape"), the layout check names the tensor and the cut."""
            try:
                return super()._build_tensors(start_offs, fields)
            except Exception as e:
                from .validate import check_layout, field_records

                try:
                    recs = field_records(fields)
                except Exception:
                    raise e from None
                check_layout(self.file_name, recs, int(start_offs), len(self.data), int(self.alignment))
                raise

        def _get_field_parts(self, orig_offs, raw_type):
            if GGUFValueType(raw_type) != GGUFValueType.ARRAY or self.byte_order == "S":
                return super()._get_field_parts(orig_offs, raw_type)
            if not hasattr(self, "string_arrays"):
                self.string_arrays = {}
            offs = orig_offs
            raw_itype = self._get(offs, np.uint32)
            offs += 4
            alen = self._get(offs, np.uint64)
            offs += 8
            itype = GGUFValueType(int(raw_itype[0]))
            n = int(alen[0])
            nptype = self.gguf_scalar_to_np.get(itype)
            if nptype is not None:
                arr = self._get(offs, nptype, n)
                return 12 + int(arr.nbytes), [raw_itype, alen, arr], [2], [GGUFValueType.ARRAY, itype]
            if itype != GGUFValueType.STRING:
                return super()._get_field_parts(orig_offs, raw_type)
            start = offs
            out, offs = gguf_strings(self.data, offs, n)
            self.string_arrays[orig_offs] = out
            raw = self._get(start, np.uint8, offs - start)
            return offs - orig_offs, [raw_itype, alen, raw], [], [GGUFValueType.ARRAY, GGUFValueType.STRING]

    return FastReader


_LENGTH = struct.Struct("<Q")


def gguf_strings_reference(data, offs: int, n: int) -> tuple[list[str], int]:
    """The ``n`` strings of a GGUF string array whose first length sits at byte ``offs`` of ``data``
    (each a little-endian uint64 byte count, then the bytes, decoded as UTF-8 with invalid bytes
    replaced), one at a time; -> (strings, the offset after the last). The plain reference of
    ``gguf_strings``."""
    buf = memoryview(data)
    out = []
    unpack = _LENGTH.unpack_from
    for _ in range(n):
        (ln,) = unpack(buf, offs)
        offs += 8
        out.append(bytes(buf[offs : offs + ln]).decode("utf-8", errors="replace"))
        offs += ln
    return out, offs


def gguf_strings(data, offs: int, n: int) -> tuple[list[str], int]:
    """``gguf_strings_reference``'s result, decoded in one piece: the lengths are walked in Python
    (each string's place depends on the one before), then every length field is cut out of the
    bytes but for one NUL between strings, and the whole is decoded once and split there. A
    vocabulary's 151k tokens and 151k merges took 0.5 s one string at a time, about a tenth of that
    so. Where a string holds a NUL itself, or the last one runs past the data, the reference decodes
    them (the same strings, or its own error)."""
    buf = memoryview(data)
    if n > (len(buf) - offs) // 8:  # a damaged count: more lengths than bytes; the reference says so
        return gguf_strings_reference(data, offs, n)
    unpack = _LENGTH.unpack_from
    heads = [0] * n
    p = offs
    for i in range(n):
        heads[i] = p
        p += 8 + unpack(buf, p)[0]
    if n == 0 or p > len(buf):
        return gguf_strings_reference(data, offs, n)
    region = np.frombuffer(buf, np.uint8, p - offs, offs).copy()
    h = np.asarray(heads, np.int64) - offs
    keep = np.ones(len(region), bool)
    keep[(h[:, None] + np.arange(7)).ravel()] = False  # the first 7 bytes of each length go ...
    region[h + 7] = 0  # ... and its last becomes the NUL before the string
    blob = region[keep].tobytes()
    if blob.count(0) != n:
        return gguf_strings_reference(data, offs, n)
    return blob.decode("utf-8", errors="replace").split("\x00")[1:], p


def _field_python_value(reader, field) -> Any:
    from gguf.constants import GGUFValueType

    if field.types[:1] == [GGUFValueType.ARRAY] and field.types[-1] == GGUFValueType.STRING:
        table = getattr(reader, "string_arrays", {})
        value_offset = field.offset + sum(int(p.nbytes) for p in field.parts[:3])
        if value_offset in table:
            return table[value_offset]
    return field.contents()


def open_reader(path: str | os.PathLike):
    """Open a GGUF file memory-mapped, turning every way a file can be bad into one clear error."""

    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise ModelFileError(f"model file not found: {p}") from None
    except (OSError, ValueError) as e:  # a name too long, a NUL byte, a parent that is a file
        raise ModelFileError(f"cannot read model file {p}: {getattr(e, 'strerror', None) or e}") from None
    if stat.S_ISDIR(st.st_mode):
        raise ModelFileError(f"model path is a directory, not a GGUF file: {p}")
    if not stat.S_ISREG(st.st_mode):  # a FIFO blocked the open for ever; a device is no model either
        raise ModelFileError(f"not a regular file (a pipe, device or socket), not a GGUF model: {p}")
    try:
        size = st.st_size
        with open(p, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelFileError(f"cannot read model file {p}: {e.strerror or e}") from None
    if size == 0:
        raise ModelFileError(f"empty file, not a GGUF model: {p}")
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"not a GGUF file (bad magic {magic!r}): {p}")
    try:
        with warnings.catch_warnings():
            # numpy overflow warnings from damaged sizes: the layout check below names the tensor
            warnings.simplefilter("ignore", RuntimeWarning)
            reader = _fast_reader_class()(str(p), "r")
    except PermissionError as e:
        raise ModelFileError(f"cannot read model file {p}: {e.strerror}") from None
    except ModelFileError:  # the layout check's own words (a tensor past the end of a cut file)
        raise
    except Exception as e:  # gguf-py raises ValueError/IndexError/struct errors (MemoryError too) on damage
        raise ModelFileError(f"corrupt or truncated GGUF file {p}: {_header_damage(e, size)}") from None
    # A truncated file can still parse its header: every tensor's bytes must be in the file, in
    # order, each of the size its type and shape give.
    from .validate import check_layout, records

    reader.records = records(reader)
    check_layout(p.name, reader.records, int(reader.data_offset), size, int(reader.alignment),
                 reader.data)
    return reader


def _header_damage(e: BaseException, size: int) -> str:
    """What a reader's exception says about the file, in the file's terms rather than the reader's
    (struct and numpy messages about buffers, views and shapes)."""
    text = str(e)
    if isinstance(e, UnicodeDecodeError):
        return "a metadata key or string is not valid UTF-8: the header is damaged"
    if "is not a valid GGUFValueType" in text:
        return "a metadata value has an unknown type code: the header is damaged"
    if "is not a valid GGMLQuantizationType" in text:  # gguf-py says "np.uint32(1000) is not a valid ..."
        m = re.search(r"(\d+)\)?\s+is not a valid", text)
        return f"a tensor has an unknown type code{' ' + m.group(1) if m else ''}: the header is damaged"
    if isinstance(e, (struct.error, IndexError, OverflowError)) or (isinstance(e, ValueError) and any(
            m in text for m in ("buffer is smaller", "cannot reshape", "larger dtype", "out of bounds",
                                "not enough values to unpack"))):  # the counts cut at 8 or 16 bytes
        # a read past the end: a cut, or a length or count that points past it
        return (f"its header runs past the end of the file ({size} bytes): the file is cut short, "
                f"or a length or count in the header is damaged")
    return _one_line(e)


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    text = text if len(text) <= 200 else text[:197] + "..."
    return text or type(e).__name__


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """All metadata key/values of a GGUF file as plain Python values."""
    return GGUFFile(path).metadata


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: (rows, cols) for a matrix, i.e. reversed GGUF dims
    type_name: str
    n_bytes: int


def map_span(arr: np.ndarray):
    """(the mmap, first byte, end byte) of ``arr`` within a file's read-only map from offset 0 (as
    the reader's), or None for any other array (memory of our own, a writable or offset map)."""
    import mmap

    base = arr  # the map's own array: the memmap whose base is the mmap (a slice of it is a memmap too)
    while base is not None and not (isinstance(base, np.memmap) and isinstance(base.base, mmap.mmap)):
        base = getattr(base, "base", None)
    if base is None or base.flags.writeable or getattr(base, "mode", None) != "r" or base.offset:
        return None
    m = base.base
    start = arr.ctypes.data - base.ctypes.data
    end = start + arr.nbytes
    return (m, start, end) if 0 <= start < end <= len(m) else None


def release_view(arr: np.ndarray) -> bool:
    """Let go of the pages under ``arr`` if it is a view of a file's read-only map (``map_span``):
    ``MADV_DONTNEED`` on them, so once their bytes have been copied they stop counting in this
    process's memory; reading them again faults them back in from the file. False (and nothing
    done) for any other array: an anonymous page released would read as zeros."""
    import mmap

    span = map_span(arr)
    if span is None or not hasattr(span[0], "madvise"):
        return False
    m, start, end = span
    page = mmap.PAGESIZE
    lo, hi = start // page * page, min(len(m), -(-end // page) * page)
    try:
        m.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
    except (OSError, ValueError):
        return False
    return True


class GGUFFile:
    """A GGUF file: ``metadata`` (dict), ``arch`` and lazily dequantized tensors."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.reader = open_reader(self.path)
        try:
            self.metadata: dict[str, Any] = {
                k: _field_python_value(self.reader, f) for k, f in self.reader.fields.items() if not k.startswith("GGUF.")
            }
        except Exception as e:
            raise ModelFileError(f"corrupt GGUF metadata in {self.path}: "
                                 f"{_header_damage(e, self.path.stat().st_size)}") from None
        self._tensors = {t.name: t for t in self.reader.tensors}
        self.records = self.reader.records  # validate.TensorRecord per tensor, in file order

    @property
    def arch(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelFileError(f"{self.path}: missing general.architecture")
        return arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise ModelFileError(f"{self.path.name}: missing metadata key {key!r}")
        return self.metadata[key]

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def _t(self, name: str):
        if name not in self._tensors:
            raise ModelFileError(f"{self.path.name}: missing tensor {name!r}")
        return self._tensors[name]

    def tensor_info(self, name: str) -> TensorInfo:
        t = self._t(name)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        return TensorInfo(name, shape, t.tensor_type.name, int(t.n_bytes))

    def tensor(self, name: str) -> np.ndarray:
        """Dequantized float32 array in numpy order (a GGUF [cols, rows] matrix is [rows, cols])."""
        from gguf.quants import dequantize

        t = self._t(name)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        try:
            arr = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise ModelFileError(
                f"{self.path.name}: tensor {name} has type {t.tensor_type.name}, which cannot be dequantized"
            ) from None
        return np.asarray(arr, dtype=np.float32).reshape(shape)

    def tensor_raw(self, name: str) -> tuple[str, np.ndarray]:
        """(GGUF type name, the tensor's stored bytes as a flat read-only uint8 array) - the blocks
        exactly as in the file, for backends that keep a quantized format."""
        t = self._t(name)
        return t.tensor_type.name, np.asarray(t.data).view(np.uint8).reshape(-1)

    def release_pages(self, names: Sequence[str] | None = None) -> bool:
        """Let go of the file's mapped pages (of the tensors ``names``; None: the whole map) once a
        model has copied what it keeps (``release_view``): the file's pages and the model's copy are
        then not both counted. False where the platform cannot be asked."""
        if names is None:
            return release_view(self.reader.data)
        return all([release_view(self.tensor_raw(n)[1]) for n in names])

    def quant_types(self) -> dict[str, int]:
        """Tensor type name -> count of tensors of that type."""
        out: dict[str, int] = {}
        for t in self.reader.tensors:
            out[t.tensor_type.name] = out.get(t.tensor_type.name, 0) + 1
        return out
