"""A lean GGUF reader: the metadata as plain Python values and a table of tensors, whose data are numpy views
of a read-only memory map that the caller opens for as long as it reads them.

gguf-py's GGUFReader builds a numpy view for every part of every metadata element: for the default model's
49,152-token vocabulary and its merges that was ~300 MB of Python objects, kept alive by the loader's cache
in both server processes (and much of it still resident after being freed). Parsing into str/int values
takes ~10 MB, and keeping no map open lets the file's pages leave memory once the weights are repacked.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
_ITEM_TYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor's table entry; `shape` is in GGUF order (innermost dimension first), as gguf-py gives it."""

    name: str
    shape: tuple[int, ...]
    tensor_type: GGMLQuantizationType
    offset: int  # absolute, in bytes from the start of the file
    nbytes: int


class GGUFFile:
    """The parsed header of a GGUF file (v2 or v3). Any malformed or truncated part raises ValueError naming
    the file (and the tensor, for a tensor whose data runs past the end of the file)."""

    def __init__(self, path: str):
        self.path = path
        try:
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                self.metadata, self.tensors = self._parse(buf)
                size = len(buf)
        except ValueError as exc:
            if str(exc).startswith(f"GGUF file {path} "):
                raise
            raise self._corrupt(f"ValueError: {exc}") from None
        except (struct.error, UnicodeDecodeError, IndexError, KeyError, OverflowError, MemoryError) as exc:
            raise self._corrupt(f"{type(exc).__name__}: {exc}") from None
        for t in self.tensors:
            if t.offset + t.nbytes > size:
                raise self._corrupt(f"tensor {t.name} holds {max(0, size - t.offset)} bytes of {t.nbytes}")

    def _corrupt(self, why: str) -> ValueError:
        return ValueError(f"GGUF file {self.path} is corrupt or truncated: {why}")

    def field(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def open_map(self) -> np.memmap:
        """The whole file, mapped read-only; it is unmapped when the last view of it (tensor_data) is gone."""
        return np.memmap(self.path, dtype=np.uint8, mode="r")

    def tensor_data(self, file_map: np.memmap, t: GGUFTensorInfo) -> np.ndarray:
        """A view of the tensor's data shaped as gguf-py's GGUFReader shapes it (blocks: rows of bytes)."""
        raw = file_map[t.offset : t.offset + t.nbytes]
        dims = tuple(reversed(t.shape))
        item = _ITEM_TYPES.get(t.tensor_type)
        if item is not None:
            return raw.view(item).reshape(dims)
        block, type_size = GGML_QUANT_SIZES[t.tensor_type]
        return raw.reshape(*dims[:-1], dims[-1] // block * type_size)

    # ---- parsing --------------------------------------------------------------------------------
    def _parse(self, buf: mmap.mmap) -> tuple[dict[str, Any], list[GGUFTensorInfo]]:
        if buf[:4] != b"GGUF":
            raise self._corrupt("no GGUF magic bytes")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise self._corrupt(f"GGUF version {version} (this reader handles 2 and 3)")
        pos, metadata = 24, {}
        for _ in range(n_kv):
            key, pos = _string(buf, pos)
            (vtype,) = struct.unpack_from("<I", buf, pos)
            metadata[key], pos = _value(buf, pos + 4, vtype)
        entries = []
        for _ in range(n_tensors):
            name, pos = _string(buf, pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            ttype, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            entries.append((name, tuple(int(d) for d in dims), GGMLQuantizationType(ttype), offset))
        alignment = int(metadata.get("general.alignment", 32))
        start = (pos + alignment - 1) // alignment * alignment
        tensors, seen = [], set()
        for name, dims, ttype, offset in entries:
            if name in seen:
                raise self._corrupt(f"tensor {name} appears twice")
            seen.add(name)
            block, type_size = GGML_QUANT_SIZES[ttype]
            n = int(np.prod(dims, dtype=np.int64))
            if dims[0] % block:
                raise self._corrupt(f"tensor {name}: row of {dims[0]} is not a multiple of {ttype.name}'s block")
            tensors.append(GGUFTensorInfo(name, dims, ttype, start + offset, n // block * type_size))
        return metadata, tensors


def _string(buf: mmap.mmap, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    end = pos + 8 + n
    if end > len(buf):
        raise IndexError(f"a string of {n} bytes at offset {pos} runs past the end of the file")
    return buf[pos + 8 : end].decode("utf-8"), end


def _value(buf: mmap.mmap, pos: int, vtype: int) -> tuple[Any, int]:
    if vtype in _SCALAR:
        fmt = _SCALAR[vtype]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    if vtype == _STRING:
        return _string(buf, pos)
    if vtype != _ARRAY:
        raise KeyError(f"metadata value type {vtype}")
    etype, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if etype in _NUMPY:
        width = np.dtype(_NUMPY[etype]).itemsize
        if pos + count * width > len(buf):
            raise IndexError(f"an array of {count} values at offset {pos} runs past the end of the file")
        return np.frombuffer(buf, _NUMPY[etype], count, pos).tolist(), pos + count * width
    items = []
    for _ in range(count):
        item, pos = _value(buf, pos, etype)
        items.append(item)
    return items, pos
