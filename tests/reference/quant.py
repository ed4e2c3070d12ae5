"""Plain references for the quantized kernels: the gguf package's dequantizer is the weights' spec;
activations are quantized per block of 32 into two int8 planes as quant.h describes, or rounded to
bfloat16 (then each weight is rounded to bfloat16 too)."""

from __future__ import annotations

import numpy as np
import torch


def dequantize(data: torch.Tensor, ggml_type: int, cols: int) -> torch.Tensor:
    import gguf

    w = gguf.quants.dequantize(data.numpy(), gguf.GGMLQuantizationType(ggml_type))
    return torch.from_numpy(np.asarray(w, dtype=np.float32).reshape(data.shape[0], cols))


def quantize_activations(x: torch.Tensor, planes: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """x ~= d * (128 * q[:, 0] + q[:, 1]) per block of 32; planes=1: q[:, 1] zeros, q[:, 0] the same
    (llama.cpp's Q8_0 activations: 127 steps of the block's largest magnitude)."""
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    step = amax / 127.0
    hi = torch.round(blocks * inv)
    lo = torch.round((blocks - hi * step) * (inv * 128.0)).clamp(-127, 127) * (planes - 1)
    q = torch.stack([hi.reshape(m, k), lo.reshape(m, k)], dim=1).to(torch.int8)
    return q, (step / 128.0).reshape(m, k // 32)


def activations_value(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """float64 [m, k] that quantized activations stand for."""
    m, _, k = q.shape
    v = 128.0 * q[:, 0].double() + q[:, 1].double()
    return (v.reshape(m, k // 32, 32) * d.double()[..., None]).reshape(m, k)


def qmatmul(q: torch.Tensor, d: torch.Tensor, weight: torch.Tensor, ggml_type: int,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    w = dequantize(weight, ggml_type, q.shape[2]).double()
    y = activations_value(q, d) @ w.T
    if bias is not None:
        y = y + bias.double()
    return y.float()


def qmatmul_bf16(x: torch.Tensor, weight: torch.Tensor, ggml_type: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, k] bfloat16 times the weights rounded to bfloat16, in float64."""
    w = dequantize(weight, ggml_type, x.shape[1]).bfloat16().double()
    y = x.double() @ w.T
    if bias is not None:
        y = y + bias.double()
    return y.float()
