"""Quantized (GGUF-block) weights: dequantizing, packing in panels, quantizing activations, and the
matrix products over them."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mindie import _C
from mindie.ops.memory import weight_arena


def dequantize(data: torch.Tensor, ggml_type: int, cols: int, packed_rows: int | None = None) -> torch.Tensor:
    """float32 [rows, cols] of GGUF blocks data [rows, row_bytes] (uint8) in ggml_type; with packed_rows,
    data is a matrix of that many rows packed in panels (pack_panels)."""
    out = torch.empty(data.shape[0] if packed_rows is None else packed_rows, cols, dtype=torch.float32)
    _C.dequantize(out, data, ggml_type, packed_rows is not None)
    return out


def pack_panels(data: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """Blocks [rows, row_bytes] of a quantized format packed in panels of 16 rows: [rows rounded up to 16,
    row_bytes], on huge pages where the OS gives them."""
    rows = (data.shape[0] + 15) // 16 * 16
    out = weight_arena.take(rows * data.shape[1]).view(rows, data.shape[1])
    _C.pack_panels(out, data, ggml_type)
    return out


def quantize_activations(x: torch.Tensor, planes: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row and block of 32: x ~= d * (128 * q[:, 0] + q[:, 1]); returns q [m, 2, k] int8, d [m, k/32].
    planes=1: q[:, 1] is zeros (one int8 plane, as llama.cpp quantizes activations)."""
    m, k = x.shape
    q = torch.empty(m, 2, k, dtype=torch.int8)
    d = torch.empty(m, k // 32, dtype=torch.float32)
    _C.quantize_activations(q, d, x, planes)
    return q, d


def qmatmul(xq: torch.Tensor, xd: torch.Tensor, weight: torch.Tensor, ggml_type: int,
            bias: torch.Tensor | None = None, packed_rows: int | None = None, planes: int = 2) -> torch.Tensor:
    """float32 [m, n] = the quantized activations times the GGUF-block weight [n, row_bytes]^T; with
    packed_rows, weight is a matrix of n = packed_rows rows packed in panels (pack_panels). planes=1
    for activations quantized with planes=1: the kernels skip their zero plane."""
    out = torch.empty(xq.shape[0], weight.shape[0] if packed_rows is None else packed_rows, dtype=torch.float32)
    _C.qmatmul(out, xq, xd, weight, ggml_type, bias, packed_rows is not None, planes)
    return out


def qmatmul_group(xq: torch.Tensor, xd: torch.Tensor,
                  weights: Sequence[tuple[int, torch.Tensor, int, int, bool]], planes: int = 2) -> list[torch.Tensor]:
    """float32 [m, n_j] for each of 1 to 4 weights (QuantizedWeight.spec()) that share the quantized
    activations, in one call, as the forward step projects q/k/v and gate/up."""
    outs = [torch.empty(xq.shape[0], rows, dtype=torch.float32) for _, _, _, rows, _ in weights]
    _C.qmatmul_group(outs, xq, xd, list(weights), planes)
    return outs


QMatmulCall = tuple[torch.Tensor, torch.Tensor, Sequence[tuple[int, torch.Tensor, int, int, bool]]]


def qmatmul_batch(calls: Sequence[QMatmulCall], planes: int = 2) -> list[list[torch.Tensor]]:
    """qmatmul_group for each (xq, xd, weights) of up to 16 independent calls, in one: the routed
    experts of a decode step, their panels walked as one range over the threads."""
    outs = [[torch.empty(xq.shape[0], rows, dtype=torch.float32) for _, _, _, rows, _ in weights]
            for xq, _, weights in calls]
    _C.qmatmul_batch([(o, xq, xd, list(weights)) for o, (xq, xd, weights) in zip(outs, calls, strict=True)], planes)
    return outs


def round_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """bfloat16 [m, k] of float32 x [m, k], rounded to nearest even."""
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    _C.round_to_bf16(out, x)
    return out


def qmatmul_bf16(x: torch.Tensor, weight: torch.Tensor, ggml_type: int,
                 bias: torch.Tensor | None = None, packed_rows: int | None = None) -> torch.Tensor:
    """float32 [m, n] = bfloat16 x [m, k] times the GGUF-block weight [n, row_bytes]^T, each weight rounded to
    bfloat16; packed_rows as in qmatmul."""
    out = torch.empty(x.shape[0], weight.shape[0] if packed_rows is None else packed_rows, dtype=torch.float32)
    _C.qmatmul_bf16(out, x, weight, ggml_type, bias, packed_rows is not None)
    return out
