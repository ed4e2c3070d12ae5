"""Qwen2-VL and Qwen2.5-VL: the Qwen2 language model (LlamaModel's exact torch step, or with
q8_0 / q4_0 weights QuantizedLlamaModel's C++ step) with a vision tower, multimodal rotary
positions and the image-token facts the server needs to build a prompt.

What differs from a Qwen2 text model is only at the step's edges: image tokens take the tower's
output as their embeddings (AttentionMetadata.media_rows), and rows rotate by their own (t, h, w)
positions (AttentionMetadata.rope_cos_sin, built here from `mrope_section`). A batch with no
image in it runs exactly the text model's step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from mindie.model.config import ModelConfig
from mindie.model.llama import LlamaModel
from mindie.model.llama_quant import QuantizedLlamaModel
from mindie.model.qwen2_vl_processor import ImageInput, ImageSpec, expand_placeholders, mrope_positions, preprocess
from mindie.model.qwen2_vl_vision import VisionConfig, VisionTower

if TYPE_CHECKING:
    from mindie.engine.request import MediaInputs, MediaItem


@dataclass(frozen=True)
class ImageTokens:
    """The special tokens an image takes in a prompt: start, pad (repeated per image token), end."""

    pad_id: int
    start_id: int | None
    end_id: int | None


class ImageRefused(ValueError):
    """The preprocessing refused image number `index` (of the prompt's images, from 0)."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(message)
        self.index = index


class VisionLanguage:
    """What a Qwen2-VL / Qwen2.5-VL model adds to its language model's step, whichever step that is
    (the exact torch one or the quantized C++ one): the vision tower, image prompts, M-RoPE rows."""

    config: ModelConfig
    dtype: torch.dtype

    def _init_vision(self, config: ModelConfig, weights: dict[str, torch.Tensor], raw: dict[str, Any],
                     image_spec: ImageSpec) -> None:
        qwen25 = "Qwen2_5_VLForConditionalGeneration" in (raw.get("architectures") or [])
        self.vision = VisionTower(VisionConfig.from_hf(raw["vision_config"], qwen25, config.hidden_size), weights)
        self.mrope_section = config.mrope_section
        if sum(self.mrope_section) != config.head_dim // 2:
            raise ValueError(f"mrope_section {list(self.mrope_section)} must add up to head_dim / 2 = "
                             f"{config.head_dim // 2}")
        self.image_spec = image_spec
        self.image_tokens = ImageTokens(int(raw.get("image_token_id", 151655)),
                                        raw.get("vision_start_token_id"), raw.get("vision_end_token_id"))
        d = config.head_dim
        self.inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))

    def prepare_prompt(self, token_ids: list[int], images: list[Any]) -> tuple[list[int], MediaInputs]:
        """A rendered prompt with one image pad token per image (Pillow images, in order) -> the
        prompt with each pad repeated to the image's token count, and its media. ValueError for
        an image the processor refuses or a pad count that differs from the image count."""
        from mindie.engine.request import MediaInputs, MediaItem

        inputs = []
        for k, image in enumerate(images):
            try:
                inputs.append(preprocess(image, self.image_spec))
            except ValueError as exc:
                raise ImageRefused(k, str(exc)) from None
        ids, offsets = expand_placeholders(token_ids, self.image_tokens.pad_id, inputs)
        items = tuple(MediaItem("image", at, x.num_tokens, x.content_hash, x) for at, x in zip(offsets, inputs))
        positions, delta = mrope_positions(len(ids), [(at, x.grid) for at, x in zip(offsets, inputs)],
                                           self.image_spec.merge_size)
        return ids, MediaInputs(items, positions, delta)

    def encode_media(self, item: MediaItem) -> torch.Tensor:
        """[item.num_tokens, hidden] in the model's dtype: the image's embeddings at its tokens."""
        data: ImageInput = item.data
        return self.vision.encode(torch.from_numpy(data.pixels), data.grid).to(self.dtype)

    def mrope_cos_sin(self, positions: torch.Tensor) -> torch.Tensor:
        """(t, h, w) positions int64 [3, rows] -> float32 [rows, head_dim]: the cos of each frequency,
        then its sin, frequency j taking the axis its mrope_section span names (as transformers'
        Qwen2VLRotaryEmbedding). Equal axes give the 1-D table's rows bit for bit."""
        freqs = positions[..., None].float() * self.inv_freq  # [3, rows, head_dim / 2]
        parts = freqs.split(list(self.mrope_section), dim=-1)
        chosen = torch.cat([part[i % 3] for i, part in enumerate(parts)], dim=-1)
        return torch.cat([chosen.cos(), chosen.sin()], dim=-1).contiguous()


class Qwen2VLModel(VisionLanguage, LlamaModel):
    """The exact path: dense weights, torch projections."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 raw: dict[str, Any], image_spec: ImageSpec) -> None:
        LlamaModel.__init__(self, config, weights, dtype)
        self._init_vision(config, weights, raw, image_spec)


class QuantizedQwen2VLModel(VisionLanguage, QuantizedLlamaModel):
    """The language model in the quantized C++ step (which takes the media rows and M-RoPE rows);
    the vision tower stays float32 torch."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 raw: dict[str, Any], image_spec: ImageSpec, quantization: str) -> None:
        from mindie.model.quantized import quantize_dense

        text = {k: w for k, w in weights.items() if not k.startswith("visual.")}
        matrices = {k: quantize_dense(w, quantization) for k, w in text.items() if w.dim() == 2}
        vectors = {k: w.float() for k, w in text.items() if w.dim() == 1}
        QuantizedLlamaModel.__init__(self, config, matrices, vectors, dtype)
        self._init_vision(config, weights, raw, image_spec)


def _language_model_names(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoints written as transformers 5 holds the model (`model.language_model.*`,
    `model.visual.*`) renamed to the layout Qwen's own checkpoints use (`model.*`, `visual.*`)."""
    out = {}
    for name, w in weights.items():
        if name.startswith("model.language_model."):
            name = "model." + name.removeprefix("model.language_model.")
        elif name.startswith("model.visual."):
            name = name.removeprefix("model.")
        out[name] = w
    return out


def load_qwen2_vl(path: str, dtype: torch.dtype, quantization: str = "none"
                  ) -> tuple[ModelConfig, Qwen2VLModel | QuantizedQwen2VLModel]:
    """`quantization`: none / auto (dense, the exact path) or q8_0 / q4_0 (the C++ step)."""
    from mindie.model.hf_dir import read_config, read_raw_config, read_weights

    raw = read_raw_config(path)
    config = read_config(path)
    spec = ImageSpec.from_hf_dir(path, raw["vision_config"])
    weights = _language_model_names(read_weights(path))
    if quantization in ("q8_0", "q4_0"):
        return config, QuantizedQwen2VLModel(config, weights, dtype, raw, spec, quantization)
    return config, Qwen2VLModel(config, weights, dtype, raw, spec)
