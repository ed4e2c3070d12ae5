"""Phi-3's fused projections (qkv_proj, gate_up_proj; llama.cpp's attn_qkv and a 2 x intermediate
ffn_up), split at load into the q/k/v and gate/up matrices every other family has.

Split rather than run fused: the exact path concatenates q/k/v and gate/up back into one matrix each,
and the C++ step already projects q, k and v (gate and up) as targets of one call writing one
buffer, so splitting costs nothing per step and neither path needs a layout of Phi's own. A
quantized GGUF matrix is blocks along each row, so taking whole rows of it is exact.
"""

from __future__ import annotations

import torch

from mindie.model.config import ModelConfig

_QKV, _GATE_UP = "self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"


def fused_parts(config: ModelConfig, name: str) -> list[tuple[str, int, int]] | None:
    """The (name, first row, end row) parts of a fused matrix under Hugging Face names; None for any
    other tensor."""
    if name.endswith(_QKV):
        p, q, kv = name[: -len(_QKV)], config.q_size, config.kv_size
        return [(p + "self_attn.q_proj.weight", 0, q), (p + "self_attn.k_proj.weight", q, q + kv),
                (p + "self_attn.v_proj.weight", q + kv, q + 2 * kv)]
    if name.endswith(_GATE_UP):
        p, inter = name[: -len(_GATE_UP)], config.intermediate_size
        return [(p + "mlp.gate_proj.weight", 0, inter), (p + "mlp.up_proj.weight", inter, 2 * inter)]
    return None


def split_fused(config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """Replaces every fused matrix in `weights` by its parts (copies: the fused tensor is freed)."""
    for name in [n for n in weights if fused_parts(config, n)]:
        w = weights.pop(name)
        parts = fused_parts(config, name)
        assert parts is not None
        if w.shape[0] != parts[-1][2]:
            raise ValueError(f"{name}: {w.shape[0]} rows, expected {parts[-1][2]}")
        weights.update({part: w[start:end].clone() for part, start, end in parts})
