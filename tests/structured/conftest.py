from __future__ import annotations

import mmap
import struct
from typing import Any

import pytest

from mindie.tokenizer import Tokenizer

# GGUF scalar value types -> struct codes; 8 is a string, 9 an array (gguf's GGUFValueType).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def read_gguf_metadata(path: str, prefix: str) -> dict[str, Any]:
    """The key-value fields of a GGUF file whose keys start with `prefix`. Reads only the header,
    which comes before the tensors; gguf.GGUFReader takes seconds here, building a view per array
    element of the 49k-token vocabulary."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        magic, version, _tensors, count = struct.unpack_from("<4sIQQ", buf, 0)
        if magic != b"GGUF" or version < 2:  # version 1 had 32-bit lengths
            raise ValueError(f"{path}: not a GGUF file of version 2 or later")
        pos = 24

        def string() -> str:
            nonlocal pos
            (n,) = struct.unpack_from("<Q", buf, pos)
            pos += 8 + n
            return bytes(buf[pos - n : pos]).decode("utf-8")

        def value(kind: int) -> Any:
            nonlocal pos
            if kind == 8:
                return string()
            if kind == 9:
                item, n = struct.unpack_from("<IQ", buf, pos)
                pos += 12
                if item in _SCALARS:
                    size = struct.calcsize(_SCALARS[item])
                    pos += n * size
                    return list(struct.unpack_from(f"<{n}{_SCALARS[item]}", buf, pos - n * size))
                return [value(item) for _ in range(n)]
            (v,) = struct.unpack_from("<" + _SCALARS[kind], buf, pos)
            pos += struct.calcsize(_SCALARS[kind])
            return v

        fields = {}
        for _ in range(count):
            key = string()
            (kind,) = struct.unpack_from("<I", buf, pos)
            pos += 4
            v = value(kind)
            if key.startswith(prefix):
                fields[key] = v
        return fields


@pytest.fixture(scope="session")
def smollm_tokenizer() -> Tokenizer:
    """The embedded SmolLM2 tokenizer, from the GGUF header only (no weights are read)."""
    from mindie.model.loader import default_model_path

    try:
        path = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return Tokenizer.from_gguf_metadata(read_gguf_metadata(path, "tokenizer."))
