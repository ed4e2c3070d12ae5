"""A decoder layer's dense kernels: RMSNorm, rotary embedding, the gated activation, the linear
projection."""

from __future__ import annotations

import torch

from mindie import _C


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``weight * rmsnorm(x)`` per row of ``x`` [rows, hidden]. With ``residual``, first
    ``residual += x`` in place, then the sum is normalised (the fused pre-norm of a decoder layer)."""
    if out is None:
        out = torch.empty_like(x)
    _C.rms_norm(out, x, weight, eps, residual)
    return out


def head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """``weight * rmsnorm(head)`` in place for every head of ``x`` [tokens, heads, head_dim] (Qwen3's
    per-head q/k norm); ``x`` may be a strided view of a fused projection's output."""
    _C.head_rms_norm(x, weight, eps)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    neox: bool = True,
) -> None:
    """Rotate ``query``/``key`` [tokens, heads, head_dim] in place by ``positions`` (int64)."""
    _C.rotary_embedding(positions, query, key, cos_sin_cache, neox)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(x[:, :n]) * x[:, n:]`` for ``x`` [tokens, 2n] (a gated MLP's activation)."""
    if out is None:
        out = x.new_empty((x.shape[0], x.shape[1] // 2))
    _C.silu_and_mul(out, x)
    return out


def gelu_tanh_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``gelu_tanh(x[:, :n]) * x[:, n:]`` for ``x`` [tokens, 2n] (GeGLU: Gemma's gated MLP, with
    transformers' ``gelu_pytorch_tanh``)."""
    if out is None:
        out = x.new_empty((x.shape[0], x.shape[1] // 2))
    _C.gelu_tanh_and_mul(out, x)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [m, k] @ weight[n, k]^T (+ bias)`` for a few rows of ``x``: the weight streams once at
    memory speed (bf16 x bf16 uses AVX512-BF16 dot products where the CPU has them)."""
    if out is None:
        out = x.new_empty((x.shape[0], weight.shape[0]))
    _C.linear(out, x, weight, bias)
    return out
