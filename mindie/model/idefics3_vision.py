"""Idefics3 / SmolVLM's vision side in torch: the SigLIP encoder (patch embedding with learned
position embeddings, pre-LN transformer layers, post layer norm) and the connector (pixel shuffle by
scale_factor, a linear projection to the language model's width), as transformers'
Idefics3VisionTransformer and Idefics3Connector compute them for one whole tile. It runs in the
model's dtype, as transformers runs a checkpoint's encoder (bfloat16 matrix products on the AMX
tiles; layer norms and attention keep float32 inside their kernels, as there); the layers run in
model/encoder_layers.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from mindie.model.encoder_layers import EncoderLayer, run_layers
from mindie.model.hf_dir import take_weight

# hidden_act -> F.gelu's approximate
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
        names = {"norm1": "layer_norm1", "norm2": "layer_norm2", "fc1": "mlp.fc1", "fc2": "mlp.fc2",
                 **{m: f"self_attn.{m}_proj" for m in ("q", "k", "v", "out")}}
        self.layers = [EncoderLayer.load(take, {k: f"{p}encoder.layers.{i}.{v}" for k, v in names.items()})
                       for i in range(config.num_layers)]
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
        x = run_layers(x, self.layers, c.num_heads, c.layer_norm_eps, ACTIVATIONS[c.hidden_act], self.post_norm)
        return F.linear(self._pixel_shuffle(x, rows, cols), self.projection)

    def _pixel_shuffle(self, x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """[rows * cols, D] -> [rows * cols / s^2, D * s^2]: each s x s block of patches as one row,
        in the order transformers' Idefics3Connector.pixel_shuffle writes it."""
        s, d = self.config.scale_factor, x.shape[-1]
        x = x.view(rows, cols // s, d * s).permute(1, 0, 2)
        x = x.reshape(cols // s, rows // s, d * s * s).permute(1, 0, 2)
        return x.reshape(rows * cols // (s * s), d * s * s)
