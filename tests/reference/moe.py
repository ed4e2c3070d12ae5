from __future__ import annotations

import torch


def moe_route(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Qwen3MoeTopKRouter after its linear: float32 softmax, top-k, renormalised."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts.to(torch.int32)


def moe_combine(y: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """transformers' Qwen3MoeExperts sum: into zeros, expert by expert in ascending id, each term the
    expert's output times the row's weight for it."""
    tokens, k = weights.shape
    out = torch.zeros(tokens, y.shape[1], dtype=torch.float32)
    slots = y.view(tokens, k, y.shape[1])
    for expert in experts.unique().tolist():
        rows, j = torch.where(experts == expert)
        out.index_add_(0, rows, slots[rows, j] * weights[rows, j, None])
    return out
