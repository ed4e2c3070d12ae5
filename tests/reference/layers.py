from __future__ import annotations

import torch


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Hugging Face LlamaRMSNorm; with a residual, the sum x + residual is both returned (the new
    residual) and normalised."""
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * h.to(x.dtype).float()).to(x.dtype), residual


def cos_sin_cache(max_position: int, rot_dim: int, theta: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim)
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def rotary_embedding(
    positions: torch.Tensor, x: torch.Tensor, cache: torch.Tensor, neox: bool
) -> torch.Tensor:
    """x [tokens, heads, head_dim]; rotates the first rot_dim dims. NeoX pairs (i, i + rot/2)
    (Hugging Face rotate_half); otherwise interleaved pairs (2i, 2i + 1)."""
    rot = cache.shape[1]
    cos, sin = cache[positions].chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    xr, rest = x[..., :rot].float(), x[..., rot:]
    if neox:
        x1, x2 = xr.chunk(2, dim=-1)
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rotated = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    return torch.cat([rotated.to(x.dtype), rest], dim=-1)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.gelu(gate, approximate="tanh") * up).to(x.dtype)
