"""SigLIP's pre-norm transformer layers (Idefics3 / SmolVLM's vision encoder):
x += attention(LN1(x)); x += fc2(gelu(fc1(LN2(x)))).

torch runs the matrix products (q, k and v as one, each with its bias, into buffers allocated once
per call) and the attention; the C++ kernels the rest: each residual add fused with the layer norm
that follows it, the tanh GELU in place on fc1's output. Every value is rounded to the dtype where
transformers rounds it, but the norms and GELU compute their float32 values another way, so a
bfloat16 output may differ from transformers' in its last bits.

Whisper's layers (Qwen2-Audio) have the same shape, but ran no faster this way at Qwen2-Audio-7B's
(0.95-1.0x: wide products and attention dominate there, and torch's erf GELU beats a kernel of ours),
so they stay torch's own (model/qwen2_audio_encoder.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mindie import ops

Affine = tuple[torch.Tensor, torch.Tensor]  # (weight, bias) of a layer norm or a linear map


@dataclass(frozen=True)
class EncoderLayer:
    norm1: Affine
    qkv: Affine  # q, k and v projections stacked: [3 * hidden, hidden], [3 * hidden]
    out: Affine
    norm2: Affine
    fc1: Affine
    fc2: Affine

    @staticmethod
    def load(take: Callable[[str], torch.Tensor], names: dict[str, str]) -> EncoderLayer:
        """From a checkpoint: `names` maps norm1, q, k, v, out, norm2, fc1, fc2 to the layer's module
        names (their .weight and .bias are read)."""

        def affine(part: str) -> Affine:
            return take(names[part] + ".weight"), take(names[part] + ".bias")

        q, k, v = (affine(m) for m in "qkv")
        return EncoderLayer(affine("norm1"), (torch.cat([q[0], k[0], v[0]]), torch.cat([q[1], k[1], v[1]])),
                            affine("out"), affine("norm2"), affine("fc1"), affine("fc2"))


# bfloat16 products (rows, output width, torch threads) that torch 2.13's oneDNN runs on one core of
# two, measured on a 2-core Sapphire Rapids: SmolVLM's out_proj and fc2 on a 512 px tile take 1.6-1.9x
# as long as two products of half the rows. Width 768 at 512, 1536 or 2048 rows, and widths 1024 to
# 1280 (Idefics3's SigLIP among them) at 200 to 2048 rows, run best whole there.
_HALVED = {(1024, 768, 2)}


def _addmm(linear: Affine, x: torch.Tensor, out: torch.Tensor) -> None:
    """out = x @ weight.T + bias."""
    blocks = 2 if x.dtype == torch.bfloat16 and (*out.shape, torch.get_num_threads()) in _HALVED else 1
    for rows, out_rows in zip(x.chunk(blocks), out.chunk(blocks)):
        torch.addmm(linear[1], rows, linear[0].t(), out=out_rows)


def run_layers(x: torch.Tensor, layers: list[EncoderLayer], heads: int, eps: float, gelu: str,
               final_norm: Affine) -> torch.Tensor:
    """x [rows, hidden] (contiguous; the residual stream, updated in place) through `layers`, with
    F.gelu's `approximate` ("tanh" or "none"); returns final_norm(x)."""
    n, d = x.shape
    h, y = torch.empty_like(x), torch.empty_like(x)  # a layer norm's output; a block's output
    qkv = x.new_empty((n, 3 * d))
    mlp = x.new_empty((n, layers[0].fc1[0].shape[0]))
    ops.layer_norm(x, *layers[0].norm1, eps, out=h)
    for i, w in enumerate(layers):
        _addmm(w.qkv, h, qkv)
        # [1, heads, rows, head_dim] views: torch's fused attention takes 4-D inputs only (3-D ones
        # take the unfused path, which rounds differently from transformers' call)
        q, k, v = qkv.view(1, n, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v)[0].transpose(0, 1).reshape(n, d)
        _addmm(w.out, a, y)
        ops.layer_norm(y, *w.norm2, eps, residual=x, out=h)
        _addmm(w.fc1, h, mlp)
        # the tanh form in C++ (a third of torch's time), the erf form torch's (twice as fast as ours was)
        _addmm(w.fc2, ops.gelu_tanh_(mlp) if gelu == "tanh" else F.gelu(mlp), y)
        ops.layer_norm(y, *(layers[i + 1].norm1 if i + 1 < len(layers) else final_norm), eps, residual=x, out=h)
    return h
