from __future__ import annotations

import torch
import torch.nn.functional as F


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """nn.LayerNorm over the last dimension (float32 math, one rounding to x's dtype); with a
    residual, the sum residual + x (in x's dtype) is both returned (the new residual) and normalised."""
    if residual is not None:
        x = residual + x
        residual = x
    out = F.layer_norm(x.float(), x.shape[-1:], weight.float(), bias.float(), eps)
    return out.to(x.dtype), residual


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x.float(), approximate="tanh").to(x.dtype)
