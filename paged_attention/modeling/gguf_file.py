"""The tensors of a GGUF file, read without parsing its metadata into objects.

The ``gguf`` package's ``GGUFReader`` builds an object for every metadata value, a SmolLM2 file's
49,152 tokens and 48,900 merges included, which takes seconds; loading a model's quantized
layers needs only the architecture and the tensors' names, types, shapes and bytes. The layout
read here is GGUF's (versions 2 and 3, little-endian): a header, the key-value metadata, the
tensor infos, then the tensor data, aligned to ``general.alignment`` (32 by default).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"GGUF"
# Metadata value types: the size of each fixed-size one; 8 is a string, 9 an array.
_FIXED_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: ``shape`` as GGUF lists it (the innermost, contiguous size first), ``type``
    the name of its GGML type (``"Q4_1"``, ``"F32"``...), ``data`` its bytes as uint8, one row
    (of the outermost size) per line."""

    name: str
    shape: tuple[int, ...]
    type: str
    data: np.ndarray


class GGUFFile:
    """A GGUF file's architecture and tensors (the data memory-mapped, read when used)."""

    def __init__(self, path: Path | str) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = Path(path)
        with open(self.path, "rb") as file:
            header = file.read(24)
            if len(header) < 24 or header[:4] != MAGIC:
                raise ValueError(f"{self.path}: not a GGUF file")
            version, tensor_count, kv_count = struct.unpack("<IQQ", header[4:])
            if version not in (2, 3):
                raise ValueError(f"{self.path}: GGUF version {version} (reads 2 and 3)")
            self._file = file
            metadata = dict(self._metadata_entry() for _ in range(kv_count))
            infos = [self._tensor_info() for _ in range(tensor_count)]
            alignment = int(metadata.get("general.alignment", 32))
            start = -(-file.tell() // alignment) * alignment
        self.architecture = metadata.get("general.architecture")
        raw = np.memmap(self.path, dtype=np.uint8, mode="r")
        self.tensors: dict[str, GGUFTensor] = {}
        for name, shape, type_id, offset in infos:
            kind = GGMLQuantizationType(type_id)
            block, block_bytes = GGML_QUANT_SIZES[kind]
            row_bytes = shape[0] // block * block_bytes
            rows = int(np.prod(shape[1:], dtype=np.int64))
            data = raw[start + offset : start + offset + rows * row_bytes]
            self.tensors[name] = GGUFTensor(name, shape, kind.name, data.reshape(rows, row_bytes))

    def _read(self, fmt: str):
        size = struct.calcsize(fmt)
        return struct.unpack(fmt, self._file.read(size))

    def _string(self) -> str:
        (length,) = self._read("<Q")
        return self._file.read(length).decode("utf-8", errors="replace")

    def _metadata_entry(self) -> tuple[str, object]:
        """A key and its value; arrays are skipped (None): no tensor needs them."""
        key = self._string()
        (kind,) = self._read("<I")
        return key, self._value(kind)

    def _value(self, kind: int):
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item_kind, count = self._read("<IQ")
            if item_kind in _FIXED_SIZES:
                self._file.seek(count * _FIXED_SIZES[item_kind], 1)
            else:
                for _ in range(count):
                    self._value(item_kind)
            return None
        if kind not in _FIXED_SIZES:
            raise ValueError(f"{self.path}: unknown metadata value type {kind}")
        data = self._file.read(_FIXED_SIZES[kind])
        return int.from_bytes(data, "little") if kind in (0, 2, 4, 10) else data

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        (dims,) = self._read("<I")
        shape = self._read(f"<{dims}Q")
        type_id, offset = self._read("<IQ")
        return name, tuple(int(size) for size in shape), type_id, offset
