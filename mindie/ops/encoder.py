"""The media encoders' per-token layers: LayerNorm (optionally fused with the residual add before
it) and the tanh GELU, each one pass over rows that torch covers with several ops and dtype copies."""

from __future__ import annotations

import torch

from mindie import _C


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``nn.LayerNorm`` per row of ``x`` [rows, hidden]. With ``residual``, first ``residual += x`` in
    place (rounded to its dtype, as ``residual + x`` is), then the sum is normalised: a pre-norm
    layer's residual add and its next norm in one pass."""
    if out is None:
        out = torch.empty_like(x)
    _C.layer_norm(out, x, weight, bias, eps, residual)
    return out


def gelu_tanh_(x: torch.Tensor) -> torch.Tensor:
    """``F.gelu(x, approximate='tanh')`` in place on ``x`` [rows, n]."""
    _C.gelu_tanh(x, x)
    return x
