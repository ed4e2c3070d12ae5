"""The header of a GGUF file (metadata fields and tensor directory), read with `struct` from a
memory map. gguf.GGUFReader builds a numpy view per array element (seconds for a 49k-token
vocabulary); this reads the same header in a fraction of a second. Tensor data stays in the map.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

# GGUF value types -> struct codes; 8 is a string, 9 an array (gguf's GGUFValueType).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: the fastest-varying dimension first
    qtype: int  # a ggml type (gguf.GGMLQuantizationType)
    offset: int  # from the start of the file


@dataclass
class GGUFHeader:
    fields: dict[str, Any]
    tensors: list[TensorInfo]
    data: mmap.mmap  # the whole file, for the tensors' bytes

    def tensor_bytes(self, t: TensorInfo) -> np.ndarray:
        """The tensor's raw data as ggml lays it out: float32 / float16 values, or uint8 rows of
        quantized blocks (what gguf.quants.dequantize takes)."""
        import gguf

        qtype = gguf.GGMLQuantizationType(t.qtype)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        rows = 1
        for d in t.shape[1:]:
            rows *= d
        row_bytes = t.shape[0] // block * type_size
        raw = np.frombuffer(self.data, dtype=np.uint8, count=rows * row_bytes, offset=t.offset)
        if qtype == gguf.GGMLQuantizationType.F32:
            return raw.view(np.float32).reshape(rows, t.shape[0])
        if qtype == gguf.GGMLQuantizationType.F16:
            return raw.view(np.float16).reshape(rows, t.shape[0])
        return raw.reshape(rows, row_bytes)


def read_header(path: str) -> GGUFHeader:
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    magic, version, num_tensors, count = struct.unpack_from("<4sIQQ", buf, 0)
    if magic != b"GGUF" or version < 2:  # version 1 had 32-bit lengths
        raise ValueError(f"{path}: not a GGUF file of version 2 or later")
    pos = 24

    def unpack(fmt: str) -> Any:
        nonlocal pos
        values = struct.unpack_from("<" + fmt, buf, pos)
        pos += struct.calcsize("<" + fmt)
        return values[0] if len(values) == 1 else values

    def string() -> str:
        nonlocal pos
        n = unpack("Q")
        pos += n
        return bytes(buf[pos - n : pos]).decode("utf-8", errors="replace")

    def value(kind: int) -> Any:
        if kind == 8:
            return string()
        if kind == 9:
            item, n = unpack("IQ")
            if item in _SCALARS:
                return list(unpack(f"{n}{_SCALARS[item]}")) if n != 1 else [unpack(_SCALARS[item])]
            return [value(item) for _ in range(n)]
        if kind not in _SCALARS:
            raise ValueError(f"{path}: unknown GGUF value type {kind}")
        return unpack(_SCALARS[kind])

    fields: dict[str, Any] = {}
    for _ in range(count):
        key = string()
        fields[key] = value(unpack("I"))
    infos = []
    for _ in range(num_tensors):
        name = string()
        dims = unpack("I")
        shape = unpack(f"{dims}Q") if dims > 1 else (unpack("Q"),)
        qtype, offset = unpack("IQ")
        infos.append((name, tuple(int(d) for d in shape), qtype, offset))
    alignment = int(fields.get("general.alignment", 32))
    data_start = (pos + alignment - 1) // alignment * alignment
    tensors = [TensorInfo(n, s, q, data_start + o) for n, s, q, o in infos]
    return GGUFHeader(fields, tensors, buf)
