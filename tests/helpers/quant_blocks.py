"""Random GGUF weight blocks for the quantized-matmul tests, in the row layout or packed in panels."""

from __future__ import annotations

import gguf
import numpy as np
import torch

from mindie import ops

FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def random_blocks(fmt: str, rows: int, cols: int, seed: int) -> tuple[torch.Tensor, int]:
    """GGUF blocks of a random [rows, cols] matrix: quantized by the gguf package where it can, else
    random bytes with the half-precision scales set to small finite values."""
    qtype = gguf.GGMLQuantizationType[fmt]
    rng = np.random.default_rng(seed)
    try:
        data = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    except NotImplementedError:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
        scale_bytes = {"Q4_K": (0, 4), "Q5_K": (0, 4), "Q6_K": (208, 210)}[fmt]
        halves = (rng.uniform(0.001, 0.02, (rows, cols // block, (scale_bytes[1] - scale_bytes[0]) // 2))
                  .astype(np.float16).view(np.uint8))
        data[:, :, scale_bytes[0]:scale_bytes[1]] = halves
        data = data.reshape(rows, -1)
    return torch.from_numpy(np.ascontiguousarray(data)), int(qtype)


def in_layout(data: torch.Tensor, qtype: int, packed: bool) -> tuple[torch.Tensor, dict[str, int]]:
    """The weight as a kernel takes it: the blocks as they are, or packed in panels, with the keyword
    arguments (packed_rows) the ops functions then need."""
    if not packed:
        return data, {}
    return ops.pack_panels(data, qtype), {"packed_rows": data.shape[0]}
