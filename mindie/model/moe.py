"""Mixture-of-experts MLPs (Qwen3-MoE, Mixtral) on the exact path, as transformers computes them, and
the names their weights go by in this package (Qwen3-MoE's checkpoint names; Mixtral's are renamed
to them at load)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mindie import ops

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def router_name(layer: int) -> str:
    return f"model.layers.{layer}.mlp.gate.weight"


def is_router(name: str) -> bool:
    """Routers stay float32 where every other matrix is quantized, as llama.cpp keeps ffn_gate_inp:
    a rounded router logit would change which experts a row runs."""
    return name.endswith(".mlp.gate.weight")


def expert_name(layer: int, expert: int, projection: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{expert}.{projection}.weight"


def route(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [rows, k], expert ids int64 [rows, k]) from router logits [rows, experts]:
    softmax in float32, the k most probable experts, renormalised to sum to 1 with `normalize`."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


@dataclass
class MoeWeights:
    router: torch.Tensor  # [experts, hidden]
    gate_up: torch.Tensor  # [experts, 2 * inter, hidden]
    down: torch.Tensor  # [experts, hidden, inter]


def moe_mlp(x: torch.Tensor, w: MoeWeights, k: int, normalize: bool) -> torch.Tensor:
    """x [rows, hidden]. Each expert runs on the rows routed to it; their outputs, scaled by the
    routing weights, are added expert by expert in ascending id (transformers' order)."""
    gate_up, down = w.gate_up, w.down
    weights, ids = route(F.linear(x, w.router), k, normalize)
    out = torch.zeros_like(x)
    for expert in ids.unique().tolist():  # sorted
        rows, slot = torch.where(ids == expert)
        h = ops.silu_and_mul(F.linear(x[rows], gate_up[expert]))
        y = F.linear(h, down[expert]) * weights[rows, slot, None].to(x.dtype)
        out.index_add_(0, rows, y)
    return out
