"""Idefics3 / SmolVLM's vision side in torch: the SigLIP encoder (patch embedding with learned
position embeddings, pre-LN transformer layers, post layer norm) and the connector (pixel shuffle by
scale_factor, a linear projection to the language model's width), as transformers'
Idefics3VisionTransformer and Idefics3Connector compute them for one whole tile. It runs in the
model's dtype, as transformers runs a checkpoint's encoder (bfloat16 matrix products on the AMX
tiles; layer norms and attention keep float32 inside their kernels, as there).

torch runs the matrix products (q, k and v as one) and the attention; the C++ kernels the rest:
each residual add fused with the layer norm after it, GELU in place on fc1's output. Every value is
rounded to the dtype where transformers rounds it, but the norms and GELU round from float32 values
computed another way, so a bfloat16 output may differ from transformers' in its last bit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from mindie import ops
from mindie.model.hf_dir import take_weight

# hidden_act -> ops.gelu_'s approximate
ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


@dataclass(frozen=True)
class EncoderConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    patch_size: int
    image_size: int  # the side the position embeddings were trained for
    layer_norm_eps: float
    hidden_act: str
    scale_factor: int

    @staticmethod
    def from_hf(raw: dict[str, Any]) -> EncoderConfig:
        v = raw["vision_config"]
        act = v.get("hidden_act", "gelu_pytorch_tanh")
        if act not in ACTIVATIONS:
            raise ValueError(f"vision_config.hidden_act {act!r} is not supported; supported: {sorted(ACTIVATIONS)}")
        return EncoderConfig(int(v.get("hidden_size", 1152)), int(v.get("num_hidden_layers", 27)),
                             int(v.get("num_attention_heads", 16)), int(v.get("patch_size", 32)),
                             int(v.get("image_size", 224)), float(v.get("layer_norm_eps", 1e-6)), act,
                             int(raw.get("scale_factor", 2)))

    def tokens_per_tile(self, tile: int) -> int:
        """The connector's output rows for a tile of `tile` pixels a side (image_seq_len)."""
        return (tile // self.patch_size) ** 2 // self.scale_factor**2


class VisionEncoder:
    """Weights under `model.vision_model.` and `model.connector.`; `encode` reads one tile."""

    def __init__(self, config: EncoderConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32
                 ) -> None:
        self.config = config
        self.dtype = dtype

        def take(name: str) -> torch.Tensor:
            return take_weight(weights, name, dtype)

        p = "model.vision_model."
        self.patch_w = take(p + "embeddings.patch_embedding.weight")
        self.patch_b = take(p + "embeddings.patch_embedding.bias")
        self.positions = take(p + "embeddings.position_embedding.weight")
        self.layers = []
        for i in range(config.num_layers):
            q = f"{p}encoder.layers.{i}."
            layer = {n: take(q + n) for n in (
                "layer_norm1.weight", "layer_norm1.bias", "layer_norm2.weight", "layer_norm2.bias",
                *(f"self_attn.out_proj.{k}" for k in ("weight", "bias")),
                *(f"mlp.{m}.{k}" for m in ("fc1", "fc2") for k in ("weight", "bias")))}
            # q, k and v as one matrix product: one pass over the normed rows instead of three
            for k in ("weight", "bias"):
                layer[f"self_attn.qkv.{k}"] = torch.cat([take(f"{q}self_attn.{m}_proj.{k}") for m in "qkv"])
            self.layers.append(layer)
        self.post_norm = take(p + "post_layernorm.weight"), take(p + "post_layernorm.bias")
        self.projection = take("model.connector.modality_projection.proj.weight")

    def position_ids(self, rows: int, cols: int) -> torch.Tensor:
        """A tile's patches' position-embedding rows: its fractional coordinates bucketed into the
        trained grid (transformers' Idefics3VisionEmbeddings, every patch valid)."""
        side = self.config.image_size // self.config.patch_size
        boundaries = torch.arange(1 / side, 1.0, 1 / side)
        h = torch.clamp(torch.arange(rows, dtype=torch.float32) * (1.0 / torch.tensor(rows)), max=1.0 - 1e-6)
        w = torch.clamp(torch.arange(cols, dtype=torch.float32) * (1.0 / torch.tensor(cols)), max=1.0 - 1e-6)
        hb, wb = torch.bucketize(h, boundaries, right=True), torch.bucketize(w, boundaries, right=True)
        return (hb[:, None] * side + wb[None, :]).reshape(-1)

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """float32 [3, H, W] -> [image_seq_len, text hidden] in the encoder's dtype."""
        c = self.config
        x = F.conv2d(pixels[None].to(self.dtype), self.patch_w, self.patch_b, stride=c.patch_size)  # [1, D, h, w]
        rows, cols = x.shape[2:]
        # the residual stream, row-major for the kernels (the sum takes the patches' transposed layout)
        x = (x.flatten(2).transpose(1, 2)[0] + self.positions[self.position_ids(rows, cols)]).contiguous()
        n, d, heads, eps = rows * cols, c.hidden_size, c.num_heads, c.layer_norm_eps
        act = ACTIVATIONS[c.hidden_act]
        h, y = torch.empty_like(x), torch.empty_like(x)  # a layer norm's output; a block's output
        qkv = x.new_empty((n, 3 * d))
        mlp = x.new_empty((n, self.layers[0]["mlp.fc1.weight"].shape[0]))
        ops.layer_norm(x, self.layers[0]["layer_norm1.weight"], self.layers[0]["layer_norm1.bias"], eps, out=h)
        next_norms = [(w["layer_norm1.weight"], w["layer_norm1.bias"]) for w in self.layers[1:]] + [self.post_norm]
        for w, next_norm in zip(self.layers, next_norms):
            torch.addmm(w["self_attn.qkv.bias"], h, w["self_attn.qkv.weight"].t(), out=qkv)
            # [1, heads, patches, head_dim] views: torch's fused attention takes 4-D inputs only (3-D
            # ones take the unfused path, which rounds differently from transformers' call)
            q, k, v = qkv.view(1, n, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v)[0].transpose(0, 1).reshape(n, d)
            self._narrow_addmm(w["self_attn.out_proj.bias"], a, w["self_attn.out_proj.weight"], y)
            ops.layer_norm(y, w["layer_norm2.weight"], w["layer_norm2.bias"], eps, residual=x, out=h)
            torch.addmm(w["mlp.fc1.bias"], h, w["mlp.fc1.weight"].t(), out=mlp)
            ops.gelu_(mlp, act)
            self._narrow_addmm(w["mlp.fc2.bias"], mlp, w["mlp.fc2.weight"], y)
            ops.layer_norm(y, *next_norm, eps, residual=x, out=h)
        return F.linear(self._pixel_shuffle(h, rows, cols), self.projection)

    def _narrow_addmm(self, bias: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
        """out = x @ weight.T + bias for a product with hidden-wide output rows. In bfloat16 it runs as
        two products of half the rows: torch 2.13's oneDNN keeps one of two cores idle on a [1024, 768]
        one (out_proj and fc2 take 1.6-1.9x as long whole, on a 2-core Sapphire Rapids); float32
        products use both cores either way, and run whole."""
        blocks = 2 if self.dtype == torch.bfloat16 else 1
        for rows, out_rows in zip(x.chunk(blocks), out.chunk(blocks)):
            torch.addmm(bias, rows, weight.t(), out=out_rows)

    def _pixel_shuffle(self, x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """[rows * cols, D] -> [rows * cols / s^2, D * s^2]: each s x s block of patches as one row,
        in the order transformers' Idefics3Connector.pixel_shuffle writes it."""
        s, d = self.config.scale_factor, x.shape[-1]
        x = x.view(rows, cols // s, d * s).permute(1, 0, 2)
        x = x.reshape(cols // s, rows // s, d * s * s).permute(1, 0, 2)
        return x.reshape(rows * cols // (s * s), d * s * s)
