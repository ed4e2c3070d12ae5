"""Weights that stay in their ggml format: GGUF blocks as read from the file, or dense float.

A `QuantizedWeight` is what the C++ forward step (`_C.LlamaForward`) multiplies by: block-quantized
matrices go through the integer matmul, dense float32 / bfloat16 ones through `linear`. Hugging Face
checkpoints are quantized at load (`--quantization q8_0|q4_0`) with the gguf package's quantizer, so
both sources end up in the same formats. Quantized matrices are then packed in panels of 16 rows
(`_C.pack_panels`), the layout the decode kernels read without shuffles: the same bytes rearranged,
plus zero rows up to a multiple of 16.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mindie import ops

GGML_F32, GGML_F16, GGML_BF16 = 0, 1, 30
# ggml type id -> name, for the formats the C++ matmul reads.
QUANTIZED_FORMATS = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
LOAD_QUANTIZATIONS = {"q8_0": 8, "q4_0": 2}  # --quantization for Hugging Face checkpoints


@dataclass(frozen=True)
class QuantizedWeight:
    """A [rows, cols] matrix: uint8 GGUF blocks [rows, row_bytes] in a QUANTIZED_FORMATS type (with
    `packed`, packed in panels: [rows rounded up to 16, row_bytes]), or float32 / bfloat16 values
    [rows, cols] (ggml_type F32 / BF16)."""

    ggml_type: int
    data: torch.Tensor
    rows: int
    cols: int
    packed: bool = False

    @property
    def format_name(self) -> str:
        return QUANTIZED_FORMATS.get(self.ggml_type) or ("BF16" if self.ggml_type == GGML_BF16 else "F32")

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def spec(self) -> tuple[int, torch.Tensor, int, int, bool]:
        """What _C.LlamaForward takes for a matrix."""
        return self.ggml_type, self.data, self.cols, self.rows, self.packed

    def permute_rows(self, order: np.ndarray) -> QuantizedWeight:
        if self.packed:
            raise ValueError("permute_rows needs the row layout: permute before packing")
        return QuantizedWeight(self.ggml_type, self.data[torch.from_numpy(order)].contiguous(), self.rows, self.cols)

    def packed_in_panels(self) -> QuantizedWeight:
        """This matrix packed in panels if it is a quantized one, else itself."""
        if self.packed or self.ggml_type not in QUANTIZED_FORMATS:
            return self
        packed = ops.pack_panels(self.data, self.ggml_type)
        return QuantizedWeight(self.ggml_type, packed, self.rows, self.cols, packed=True)


def from_gguf_tensor(ggml_type: int, raw: np.ndarray, cols: int) -> QuantizedWeight:
    """A copy of one GGUF tensor's bytes (raw as GGUFHeader.tensor_bytes returns them), kept in
    its format. F16 matrices become float32 (no f16 matmul kernel; exact)."""
    rows = raw.shape[0]
    if ggml_type in QUANTIZED_FORMATS:
        return QuantizedWeight(ggml_type, torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True)), rows, cols)
    if ggml_type in (GGML_F32, GGML_F16):
        return QuantizedWeight(GGML_F32, torch.from_numpy(np.array(raw, dtype=np.float32, copy=True)), rows, cols)
    if ggml_type == GGML_BF16:
        bits = torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True).view(np.int16))
        return QuantizedWeight(GGML_BF16, bits.view(torch.bfloat16).reshape(rows, cols), rows, cols)
    raise ValueError(f"ggml type {ggml_type} is not supported; supported: F32, F16, BF16, "
                     f"{', '.join(QUANTIZED_FORMATS.values())}")


def quantize_dense(w: torch.Tensor, quantization: str) -> QuantizedWeight:
    """Quantizes a dense [rows, cols] matrix at load (q8_0 or q4_0); columns not a multiple of 32
    stay float32."""
    import gguf

    rows, cols = w.shape
    if cols % 32 != 0:
        return QuantizedWeight(GGML_F32, w.float().contiguous(), rows, cols)
    qtype = LOAD_QUANTIZATIONS[quantization]
    blocks = gguf.quants.quantize(w.float().numpy(), gguf.GGMLQuantizationType(qtype))
    return QuantizedWeight(qtype, torch.from_numpy(np.ascontiguousarray(blocks)), rows, cols).packed_in_panels()
