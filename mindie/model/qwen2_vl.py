"""Qwen2-VL and Qwen2.5-VL (images and video): the Qwen2 language model (LlamaModel's exact torch step, or with
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

import numpy as np
import torch

from mindie.model.config import ModelConfig
from mindie.model.llama import LlamaModel
from mindie.model.llama_quant import QuantizedLlamaModel
from mindie.model.qwen2_vl_processor import (
    ImageSpec,
    VideoSpec,
    VisualInput,
    expand_placeholders,
    mrope_positions,
    preprocess,
    preprocess_video,
)
from mindie.model.qwen2_vl_vision import VisionConfig, VisionTower

if TYPE_CHECKING:
    from mindie.engine.request import MediaInputs, MediaItem


@dataclass(frozen=True)
class MediaTokens:
    """The special tokens media take in a prompt: each kind's pad (repeated per token of an image
    or video), and the start and end around either."""

    pads: dict[str, int]  # image / video -> its pad token
    start_id: int | None
    end_id: int | None


class MediaRefused(ValueError):
    """The preprocessing refused the prompt's `kind` number `index` (from 0)."""

    def __init__(self, kind: str, index: int, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.index = index


class VisionLanguage:
    """What a Qwen2-VL / Qwen2.5-VL model adds to its language model's step, whichever step that is
    (the exact torch one or the quantized C++ one): the vision tower, image prompts, M-RoPE rows."""

    config: ModelConfig
    dtype: torch.dtype

    def _init_vision(self, config: ModelConfig, weights: dict[str, torch.Tensor], raw: dict[str, Any],
                     image_spec: ImageSpec, video_spec: VideoSpec) -> None:
        qwen25 = "Qwen2_5_VLForConditionalGeneration" in (raw.get("architectures") or [])
        self.vision = VisionTower(VisionConfig.from_hf(raw["vision_config"], qwen25, config.hidden_size), weights,
                                  self.dtype)
        self.mrope_section = config.mrope_section
        if sum(self.mrope_section) != config.head_dim // 2:
            raise ValueError(f"mrope_section {list(self.mrope_section)} must add up to head_dim / 2 = "
                             f"{config.head_dim // 2}")
        self.image_spec = image_spec
        self.video_spec = video_spec
        # Qwen2.5-VL steps a video's frame positions by its seconds; Qwen2-VL by one per frame
        self.tokens_per_second = raw["vision_config"].get("tokens_per_second", 4) if qwen25 else None
        self.media_tokens = MediaTokens({"image": int(raw.get("image_token_id", 151655)),
                                         "video": int(raw.get("video_token_id", 151656))},
                                        raw.get("vision_start_token_id"), raw.get("vision_end_token_id"))
        d = config.head_dim
        self.inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))

    def prepare_prompt(self, token_ids: list[int], images: list[Any], videos: list[Any] = (), audios: list[Any] = ()
                       ) -> tuple[list[int], MediaInputs]:
        """A rendered prompt with one pad token per image (Pillow images, in order) and per video
        (mindie.media.video.VideoClip, in order) -> the prompt with each pad repeated to its
        medium's token count, and its media. MediaRefused for a medium the preprocessing refuses
        (ValueError: an aspect ratio; MediaError: a damaged clip); ValueError for audio, or pad
        counts that differ from the media counts."""
        from mindie.engine.request import MediaInputs, MediaItem

        if audios:
            raise ValueError("Qwen2-VL reads images and videos; it takes no audio")

        inputs: dict[str, list[VisualInput]] = {"image": [], "video": []}
        for kind, given, process in (("image", images, lambda x: preprocess(x, self.image_spec)),
                                     ("video", videos, lambda x: preprocess_video(x, self.video_spec))):
            for k, medium in enumerate(given):
                try:
                    inputs[kind].append(process(medium))
                except ValueError as exc:  # MediaError is one
                    raise MediaRefused(kind, k, str(exc)) from None
        ids, placed = expand_placeholders(token_ids, self.media_tokens.pads, inputs)
        ordered = [(kind, at, inputs[kind][k]) for kind, k, at in placed]
        items = tuple(MediaItem(kind, at, x.num_tokens, x.content_hash, x) for kind, at, x in ordered)
        positions, delta = mrope_positions(len(ids), [(at, x.grid, self._frame_step(x)) for _, at, x in ordered],
                                           self.image_spec.merge_size)
        return ids, MediaInputs(items, positions, delta)

    def _frame_step(self, x: VisualInput) -> float:
        """How far apart a medium's temporal patches sit in the t positions (transformers computes
        it in float32: tokens_per_second * seconds per patch for a Qwen2.5-VL video, else 1)."""
        if x.seconds_per_grid is None or self.tokens_per_second is None:
            return 1.0
        return float(np.float32(self.tokens_per_second) * np.float32(x.seconds_per_grid))

    def encode_media(self, item: MediaItem) -> torch.Tensor:
        """[item.num_tokens, hidden] in the model's dtype: the image's or video's embeddings at its tokens."""
        data: VisualInput = item.data
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
                 raw: dict[str, Any], image_spec: ImageSpec, video_spec: VideoSpec) -> None:
        LlamaModel.__init__(self, config, weights, dtype)
        self._init_vision(config, weights, raw, image_spec, video_spec)


class QuantizedQwen2VLModel(VisionLanguage, QuantizedLlamaModel):
    """The language model in the quantized C++ step (which takes the media rows and M-RoPE rows);
    the vision tower runs in torch, in the model's dtype."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 raw: dict[str, Any], image_spec: ImageSpec, video_spec: VideoSpec, quantization: str,
                 activation_bits: int = 16) -> None:
        from mindie.model.quantized import quantize_dense

        text = {k: w for k, w in weights.items() if not k.startswith("visual.")}
        matrices = {k: quantize_dense(w, quantization) for k, w in text.items() if w.dim() == 2}
        vectors = {k: w.float() for k, w in text.items() if w.dim() == 1}
        QuantizedLlamaModel.__init__(self, config, matrices, vectors, dtype, activation_bits)
        self._init_vision(config, weights, raw, image_spec, video_spec)


def load_qwen2_vl(path: str, dtype: torch.dtype, quantization: str = "none", activation_bits: int = 16
                  ) -> tuple[ModelConfig, Qwen2VLModel | QuantizedQwen2VLModel]:
    """`quantization`: none / auto (dense, the exact path) or q8_0 / q4_0 (the C++ step)."""
    from mindie.model.hf_dir import language_model_names, read_config, read_raw_config, read_weights

    raw = read_raw_config(path)
    config = read_config(path)
    spec = ImageSpec.from_hf_dir(path, raw["vision_config"])
    video = VideoSpec.from_hf_dir(path, spec)
    weights = language_model_names(read_weights(path), ("visual.",))
    if quantization in ("q8_0", "q4_0"):
        return config, QuantizedQwen2VLModel(config, weights, dtype, raw, spec, video, quantization, activation_bits)
    return config, Qwen2VLModel(config, weights, dtype, raw, spec, video)
