"""A GGUF file opened for loading: its metadata as Python values and its tensors as read-only
views of the memory-mapped file, in one pass over the header.

gguf-py's ``GGUFReader`` builds a numpy view per array element: a file with a 151,936-token
vocabulary and as many merges (Qwen2.5) costs it ~500k views, 13 s on a 2-core machine, and a
start opened the file three times. Here string arrays are decoded with ``struct`` straight from
the map (~0.2 s), numeric arrays are single ``np.frombuffer`` views, and the rest of gguf-py is
kept: the type tables (``GGMLQuantizationType``, ``GGML_QUANT_SIZES``), the byte shape of a
quantized tensor, and ``dequantize``. ``tests/test_gguf_file.py`` checks every field and tensor
against ``GGUFReader`` on real and written files.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from specserve.core.errors import ModelLoadError

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUF value type -> (struct format, numpy dtype) for fixed-size values
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"), 4: ("<I", "<u4"),
    5: ("<i", "<i4"), 6: ("<f", "<f4"), 7: ("<?", "?"), 10: ("<Q", "<u8"), 11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}
_STRING, _ARRAY = 8, 9
_FLOAT_TYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8,
                "I16": np.int16, "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    """As gguf-py's ``ReaderTensor``: ``shape`` in GGUF order (ne: the row length first),
    ``data`` a read-only view, float types as their numpy dtype in reversed (row-major) shape,
    block types as uint8 [rows..., bytes per row]."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


class GGUFFile:
    """``fields``: key -> value (str, int, float, bool, or a list of them); ``tensors`` in file
    order. The map stays open while any tensor view is alive."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as e:  # an empty file
                raise ModelLoadError(f"{self.path} is not a GGUF file ({e})") from e
        self._pos = 0
        self.fields: dict[str, Any] = {}
        self.tensors: list[GGUFTensor] = []
        self._parse()

    def _parse(self) -> None:
        import gguf

        if self._map[:4] != _MAGIC:
            raise ModelLoadError(f"{self.path} is not a GGUF file (no GGUF magic)")
        version = self._scalar(4, at=4)
        if version not in (2, 3):
            raise ModelLoadError(f"{self.path}: GGUF version {version} is not supported "
                                 f"(2 and 3 are; a big-endian file reads as a huge version)")
        self._pos = 8
        n_tensors, n_fields = self._scalar(10), self._scalar(10)
        for _ in range(n_fields):
            key = self._string()
            self.fields[key] = self._value(self._scalar(4))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = tuple(self._scalar(10) for _ in range(self._scalar(4)))
            infos.append((name, dims, self._scalar(4), self._scalar(10)))
        align = int(self.fields.get("general.alignment", _DEFAULT_ALIGNMENT))
        start = -(-self._pos // align) * align
        seen: set[str] = set()
        for name, dims, type_id, offset in infos:
            if name in seen:
                raise ModelLoadError(f"{self.path}: tensor {name} appears twice")
            seen.add(name)
            kind = gguf.GGMLQuantizationType(type_id)
            block, type_size = gguf.GGML_QUANT_SIZES[kind]
            n = int(np.prod(dims))
            rows_first = tuple(reversed(dims))
            dtype = _FLOAT_TYPES.get(kind.name)
            if dtype is None:
                count, dtype = n * type_size // block, np.uint8
                rows_first = gguf.quant_shape_to_byte_shape(rows_first, kind)
            else:
                count = n
            data = np.frombuffer(self._map, dtype=dtype, count=count, offset=start + offset)
            self.tensors.append(GGUFTensor(name, kind, dims, data.reshape(rows_first)))

    def _scalar(self, type_id: int, at: int | None = None) -> Any:
        fmt = _SCALARS[type_id][0]
        pos = self._pos if at is None else at
        (value,) = struct.unpack_from(fmt, self._map, pos)
        if at is None:
            self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        (n,) = struct.unpack_from("<Q", self._map, self._pos)
        start = self._pos + 8
        self._pos = start + n
        return self._map[start:self._pos].decode("utf-8", errors="replace")

    def _value(self, type_id: int) -> Any:
        if type_id == _STRING:
            return self._string()
        if type_id == _ARRAY:
            item, count = self._scalar(4), self._scalar(10)
            if item == _STRING:
                return [self._string() for _ in range(count)]
            if item == _ARRAY:
                return [self._value(_ARRAY) for _ in range(count)]
            dtype = np.dtype(_SCALARS[item][1])
            values = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._pos)
            self._pos += count * dtype.itemsize
            return values.tolist()
        if type_id not in _SCALARS:
            raise ModelLoadError(f"{self.path}: unknown GGUF value type {type_id}")
        return self._scalar(type_id)

    def tensor(self, name: str) -> GGUFTensor | None:
        return next((t for t in self.tensors if t.name == name), None)
