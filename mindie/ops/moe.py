"""Mixture-of-experts routing kernels: top-k routing and the weighted sum of the experts' outputs."""

from __future__ import annotations

import torch

from mindie import _C


def moe_route(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [rows, k], expert ids int32 [rows, k]) for router logits float32 [rows,
    experts]: per row, softmax, the k most probable experts (largest first), renormalised to sum to 1
    with ``normalize``."""
    weights = torch.empty(logits.shape[0], k, dtype=torch.float32)
    experts = torch.empty(logits.shape[0], k, dtype=torch.int32)
    _C.moe_route(weights, experts, logits, normalize)
    return weights, experts


def moe_combine(y: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """out [rows, hidden]: per row t, sum_j weights[t, j] * y[t * k + j] (y float32 [rows * k, hidden],
    row t * k + j the output of expert experts[t, j] for row t), added in ascending expert id."""
    out = torch.empty(weights.shape[0], y.shape[1], dtype=torch.float32)
    _C.moe_combine(out, y, weights, experts)
    return out
