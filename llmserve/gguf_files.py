"""Reading GGUF files' headers fast, and once per load.

`gguf.GGUFReader` walks a file's metadata element by element, and for each element makes a
few numpy views of the file's `np.memmap`; a memmap view runs Python code as it is made. A
vocabulary is an array of strings (262,144 in Gemma 3 270M), so one reader took seconds for
either model (bench/RESULTS.md, "Figures moved out of code comments"; both readers timed
since: "Load times"), and loading a worker made up to four of them (transformers' config and
weights, then ours for the architecture and the blocks).

`FastGGUFReader` is the same reader, with the same fields, parts, indices and tensors, made
from views of a plain ndarray over the same mapping, and arrays of strings and numbers
walked without one `_get` per element. `reading_gguf_once()` makes every `gguf.GGUFReader`
opened inside it, transformers' included, that reader, one per file.
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGUFReader, GGUFValueType

_ARRAY_HEADER_BYTES = 12  # the element type (uint32), then the element count (uint64)


class FastGGUFReader(GGUFReader):
    """`gguf.GGUFReader`, made faster; equal to it field by field and tensor by tensor
    (tests/unit/common/test_gguf_files.py). It overrides two of the reader's internal
    methods, so pyproject.toml keeps `gguf` to the minor version it was checked on."""

    def _get(
        self, offset: int, dtype: Any, count: int = 1, override_order: str | None = None
    ) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None:  # the base class maps the file first thing, then reads through here
            plain = self._plain = self.data.view(np.ndarray)
        dtype = np.dtype(dtype)
        arr = plain[offset : offset + dtype.itemsize * int(count)].view(dtype)
        order = self.byte_order if override_order is None else override_order
        return arr if order == "I" else arr.view(dtype.newbyteorder(order))

    def _get_field_parts(
        self, orig_offs: int, raw_type: int
    ) -> tuple[int, list[np.ndarray], list[int], list[GGUFValueType]]:
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        count_part = self._get(orig_offs + 4, np.uint64)
        item_type = GGUFValueType(int(raw_itype[0]))
        count = int(count_part[0])
        offs = orig_offs + _ARRAY_HEADER_BYTES
        parts: list[np.ndarray] = [raw_itype, count_part]
        # As the base class: the element type is listed only when there is an element.
        types = [GGUFValueType.ARRAY] + ([item_type] if count else [])
        if item_type == GGUFValueType.STRING:
            # Each string is two parts, its length (uint64) and its bytes; the bytes are data.
            plain = self._plain
            unpack_length = struct.Struct("=Q").unpack_from
            buffer = memoryview(plain)  # type: ignore[arg-type]  # numpy arrays are buffers
            for _ in range(count):
                (length,) = unpack_length(buffer, offs)
                parts.append(plain[offs : offs + 8].view(np.uint64))
                parts.append(plain[offs + 8 : offs + 8 + length])
                offs += 8 + length
            return offs - orig_offs, parts, list(range(3, 2 * count + 2, 2)), types
        scalar = self.gguf_scalar_to_np.get(item_type)
        if scalar is None:  # arrays of arrays: the base class's walk
            return super()._get_field_parts(orig_offs, raw_type)
        values = self._get(offs, scalar, count)
        parts.extend(values[i : i + 1] for i in range(count))  # one part per element
        return _ARRAY_HEADER_BYTES + int(values.nbytes), parts, list(range(2, count + 2)), types


_lock = threading.Lock()
_depth = 0
_opened: dict[tuple[str, int, int], FastGGUFReader] = {}
_library_reader: Any = None


def open_gguf(path: str | os.PathLike[str], mode: str = "r") -> GGUFReader:
    """A reader of `path`: inside `reading_gguf_once()`, the one already made for this
    file (as it is on disk now) if there is one; a new `FastGGUFReader` otherwise."""
    if mode != "r":  # writable mappings are never shared
        return FastGGUFReader(path, mode)  # type: ignore[arg-type]
    stat = Path(path).stat()
    key = (str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)
    with _lock:
        reader = _opened.get(key)
    if reader is None:
        reader = FastGGUFReader(path)
        with _lock:
            if _depth:
                reader = _opened.setdefault(key, reader)
    return reader


@contextlib.contextmanager
def reading_gguf_once() -> Iterator[None]:
    """Inside, `gguf.GGUFReader(path)` (transformers' loaders call it so) and `open_gguf`
    return one `FastGGUFReader` per file; on leaving the outermost one, the readers are
    dropped and `gguf.GGUFReader` is the library's again. Nests, and works across threads."""
    global _depth, _library_reader
    with _lock:
        if _depth == 0:
            _library_reader = gguf.GGUFReader
            gguf.GGUFReader = open_gguf  # type: ignore[assignment,misc]
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                gguf.GGUFReader = _library_reader  # type: ignore[misc]
                _opened.clear()
