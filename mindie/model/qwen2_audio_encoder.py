"""Qwen2-Audio's audio tower and projector in torch (transformers' Qwen2AudioEncoder and
Qwen2AudioMultiModalProjector): two 1-D convolutions with GELU, learned positions, pre-norm
Whisper encoder layers, an average pool by 2, a layer norm, and a linear map to the language
model's width. It runs in the model's dtype, as transformers runs a checkpoint's encoder
(bfloat16 matrix products on the AMX tiles; layer norms and attention keep float32 inside their
kernels, as there).

transformers runs the whole 30 s window and masks the padding positions out of the attention's
keys; a kept position's output depends only on the kept positions, so only those are run here
(the padding positions' outputs are dropped there anyway). Same values, a fraction of the work
for a short clip.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from mindie.model.qwen2_audio_processor import AudioInput


@dataclass(frozen=True)
class EncoderConfig:
    d_model: int
    layers: int
    heads: int
    num_mel_bins: int
    max_source_positions: int
    scale_embedding: bool
    eps: float = 1e-5  # nn.LayerNorm's default, which the encoder uses

    @staticmethod
    def from_hf(raw: dict[str, Any]) -> EncoderConfig:
        a = raw["audio_config"]
        if a.get("activation_function", "gelu") != "gelu":
            raise ValueError(f"audio activation {a['activation_function']!r} is not supported (gelu)")
        return EncoderConfig(int(a.get("d_model", 1280)), int(a.get("encoder_layers", 32)),
                             int(a.get("encoder_attention_heads", 20)), int(a.get("num_mel_bins", 128)),
                             int(a.get("max_source_positions", 1500)), bool(a.get("scale_embedding", False)))


class AudioEncoder:
    """Weights under `audio_tower.*` and `multi_modal_projector.linear.*`."""

    def __init__(self, config: EncoderConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32
                 ) -> None:
        self.config = config
        self.dtype = dtype
        self.w = {k.removeprefix("audio_tower."): v.to(dtype) for k, v in weights.items()
                  if k.startswith("audio_tower.")}
        self.proj_w = weights["multi_modal_projector.linear.weight"].to(dtype)
        self.proj_b = weights["multi_modal_projector.linear.bias"].to(dtype)

    @torch.inference_mode()
    def encode(self, audio: AudioInput) -> torch.Tensor:
        """[audio.num_tokens, text hidden] in the encoder's dtype: the clip's embeddings at its <|AUDIO|> tokens."""
        c, w, n = self.config, self.w, audio.num_positions
        if n > c.max_source_positions:
            raise ValueError(f"the audio has {n} encoder positions; the model has {c.max_source_positions}")
        x = torch.from_numpy(audio.features)[None].to(self.dtype)
        x = F.gelu(F.conv1d(x, w["conv1.weight"], w["conv1.bias"], padding=1))
        x = F.gelu(F.conv1d(x, w["conv2.weight"], w["conv2.bias"], stride=2, padding=1))
        # Row-major from here on: the transposed view's strides would otherwise follow h through every
        # layer, and each layer norm and residual add would copy (12% of a bfloat16 30 s window).
        scale = c.d_model**0.5 if c.scale_embedding else 1.0
        h = (x[0, :, :n].T * scale + w["embed_positions.weight"][:n]).contiguous()
        heads, hd = c.heads, c.d_model // c.heads
        for i in range(c.layers):
            p = f"layers.{i}."
            y = F.layer_norm(h, (c.d_model,), w[p + "self_attn_layer_norm.weight"], w[p + "self_attn_layer_norm.bias"],
                             c.eps)
            q = F.linear(y, w[p + "self_attn.q_proj.weight"], w[p + "self_attn.q_proj.bias"])
            k = F.linear(y, w[p + "self_attn.k_proj.weight"])  # Whisper's k_proj has no bias
            v = F.linear(y, w[p + "self_attn.v_proj.weight"], w[p + "self_attn.v_proj.bias"])
            # [1, heads, n, head_dim]: torch's fused attention takes 4-D inputs only (3-D ones take
            # the unfused path, which rounds differently from transformers' call)
            q, k, v = (t.view(1, n, heads, hd).transpose(1, 2) for t in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v)[0].transpose(0, 1).reshape(n, c.d_model)
            h = h + F.linear(a, w[p + "self_attn.out_proj.weight"], w[p + "self_attn.out_proj.bias"])
            y = F.layer_norm(h, (c.d_model,), w[p + "final_layer_norm.weight"], w[p + "final_layer_norm.bias"], c.eps)
            y = F.linear(F.gelu(F.linear(y, w[p + "fc1.weight"], w[p + "fc1.bias"])), w[p + "fc2.weight"],
                         w[p + "fc2.bias"])
            h = h + y
        h = F.avg_pool1d(h.T[None], 2, 2)[0].T[: audio.num_tokens]
        h = F.layer_norm(h, (c.d_model,), w["layer_norm.weight"], w["layer_norm.bias"], c.eps)
        return F.linear(h, self.proj_w, self.proj_b)
