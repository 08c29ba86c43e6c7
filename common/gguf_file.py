"""Reading a GGUF file: its metadata and its tensor index in one pass, tensors memory-mapped.

    header ── key/value metadata ── tensor index ── (alignment) ── tensor data
    GGUFFile.metadata: {key: int | float | bool | str | list}    GGUFFile.tensors: [GGUFTensor]

gguf-py's `GGUFReader` is the format's reference reader, and this project writes and checks
files with it; but it builds a NumPy view for every element of every array, and a model's
metadata holds its whole vocabulary and merge list: opening the default model's file took
4.4 s there, against well under a second here. This reader walks the same header with
`struct`, takes arrays of numbers in one `numpy.frombuffer` each, and maps tensor data
without copying, shaped as `GGUFReader` shapes it (quantized rows as their bytes). The
format's constants (value types, block sizes) come from the gguf package. Damaged files
raise `ModelLoadError` naming the file.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from common.model_files import ModelLoadError

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUFValueType -> (struct code, NumPy type) for the fixed-size kinds
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("B", "u1"), 1: ("b", "i1"), 2: ("H", "u2"), 3: ("h", "i2"), 4: ("I", "u4"),
    5: ("i", "i4"), 6: ("f", "f4"), 7: ("?", "?"), 10: ("Q", "u8"), 11: ("q", "i8"),
    12: ("d", "f8"),
}
_STRING, _ARRAY = 8, 9
# GGML types stored as plain numbers; every other type is read as its blocks' bytes
_PLAIN_TENSORS = {"F32": "f4", "F16": "f2", "F64": "f8", "I8": "i1", "I16": "i2", "I32": "i4",
                  "I64": "i8"}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the index. `dims` in GGUF's order (fastest first); `data` read-only,
    shaped row-major, quantized kinds as (rows..., bytes per row) of uint8 blocks."""

    name: str
    kind: str  # the GGML type's name: "F32", "Q4_1", ...
    dims: tuple[int, ...]
    data: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape, row-major (GGUF's dims reversed)."""
        return tuple(reversed(self.dims))

    @cached_property
    def ggml_type(self) -> Any:
        """The kind as gguf's `GGMLQuantizationType` (what `gguf.quants` takes)."""
        from gguf.constants import GGMLQuantizationType

        return GGMLQuantizationType[self.kind]


class GGUFFile:
    """A GGUF file's `metadata` and `tensors`; the file stays mapped while either is used."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._parse()
        except ModelLoadError:
            raise
        except (OSError, ValueError, KeyError, struct.error, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"{self.path}: not a readable GGUF file ({exc})") from exc

    def _parse(self) -> None:
        buf = self._map
        if buf[:4] != _MAGIC:
            raise ModelLoadError(
                f"{self.path}: not a readable GGUF file (it does not start with GGUF)"
            )
        version = struct.unpack_from("<I", buf, 4)[0]
        # A big-endian file's version reads byte-swapped (its low half zero) little-endian.
        self._order = "<" if version & 0xFFFF else ">"
        version = struct.unpack_from(self._order + "I", buf, 4)[0]
        if version < 2:
            raise ModelLoadError(f"{self.path}: GGUF version {version} is not supported (2+)")
        tensor_count, kv_count = struct.unpack_from(self._order + "QQ", buf, 8)
        self._offset = 24
        self.metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            self.metadata[key] = self._value(self._unpack("I"))
        index = []
        for _ in range(tensor_count):
            name = self._string()
            dims = tuple(self._unpack("Q") for _ in range(self._unpack("I")))
            index.append((name, dims, self._unpack("I"), self._unpack("Q")))
        alignment = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise ModelLoadError(f"{self.path}: general.alignment {alignment} is not a power of 2")
        self.data_offset = -(-self._offset // alignment) * alignment
        self.tensors = [self._tensor(*entry) for entry in index]

    def _unpack(self, code: str) -> Any:
        value = struct.unpack_from(self._order + code, self._map, self._offset)[0]
        self._offset += struct.calcsize(code)
        return value

    def _string(self) -> str:
        size = self._unpack("Q")
        start = self._offset
        self._offset += size
        if self._offset > len(self._map):
            raise ValueError("a string runs past the end of the file")
        return self._map[start:self._offset].decode("utf-8")

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind][0])
        if kind != _ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        item, count = self._unpack("I"), self._unpack("Q")
        if item in _SCALARS:
            dtype = np.dtype(self._order + _SCALARS[item][1])
            values = np.frombuffer(self._map, dtype, count, self._offset)
            self._offset += count * dtype.itemsize
            return values.tolist()
        return [self._value(item) for _ in range(count)]

    def _tensor(self, name: str, dims: tuple[int, ...], type_id: int, offset: int) -> GGUFTensor:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        try:
            kind = GGMLQuantizationType(type_id)
        except ValueError:
            raise ModelLoadError(
                f"{self.path}: tensor {name} has unknown GGML type {type_id}"
            ) from None
        shape = tuple(reversed(dims))
        count = int(np.prod(dims, dtype=np.int64))
        start = self.data_offset + offset
        if kind.name in _PLAIN_TENSORS:
            dtype = np.dtype(self._order + _PLAIN_TENSORS[kind.name])
        else:
            block, block_bytes = GGML_QUANT_SIZES[kind]
            if shape[-1] % block:
                raise ModelLoadError(f"{self.path}: tensor {name} rows are not whole "
                                     f"{kind.name} blocks")
            dtype = np.dtype(np.uint8)
            shape = (*shape[:-1], shape[-1] // block * block_bytes)
            count = int(np.prod(shape, dtype=np.int64))
        if start + count * dtype.itemsize > len(self._map):
            raise ModelLoadError(f"{self.path}: tensor {name} runs past the end of the file "
                                 "(a truncated download?)")
        data = np.frombuffer(self._map, dtype, count, start).reshape(shape)
        return GGUFTensor(name, kind.name, dims, data)
