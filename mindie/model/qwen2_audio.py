"""Qwen2-Audio (audio in): the Qwen2 language model (LlamaModel's exact torch step, or with
q8_0 / q4_0 weights QuantizedLlamaModel's C++ step) with a Whisper-style audio encoder and
projector (model/qwen2_audio_encoder.py) over log-mel features (model/qwen2_audio_processor.py).

A clip's <|AUDIO|> tokens take the encoder's output as their embeddings
(AttentionMetadata.media_rows); positions are the plain 1-D ones, so a batch's rotary table is the
text model's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from mindie.model.config import ModelConfig
from mindie.model.llama import LlamaModel
from mindie.model.llama_quant import QuantizedLlamaModel
from mindie.model.qwen2_audio_encoder import AudioEncoder, EncoderConfig
from mindie.model.qwen2_audio_processor import AudioFeatures, AudioInput, AudioSpec
from mindie.model.qwen2_vl import MediaRefused, MediaTokens
from mindie.model.qwen2_vl_processor import expand_placeholders

if TYPE_CHECKING:
    from mindie.engine.request import MediaInputs, MediaItem

ARCHITECTURES = ("Qwen2AudioForConditionalGeneration",)
_AUDIO_PREFIXES = ("audio_tower.", "multi_modal_projector.")


class AudioLanguage:
    """What a Qwen2-Audio model adds to its language model's step, whichever step that is."""

    config: ModelConfig
    dtype: torch.dtype

    def _init_audio(self, weights: dict[str, torch.Tensor], raw: dict[str, Any], spec: AudioSpec) -> None:
        enc = EncoderConfig.from_hf(raw)
        if enc.num_mel_bins != spec.feature_size:
            raise ValueError(f"the encoder reads {enc.num_mel_bins} mel bins; preprocessor_config.json's feature_size "
                             f"is {spec.feature_size}")
        if spec.n_samples // spec.hop_length != 2 * enc.max_source_positions:  # the convolutions halve it
            raise ValueError(f"{spec.chunk_length} s of {spec.hop_length}-sample frames do not fill the encoder's "
                             f"{enc.max_source_positions} positions")
        self.audio = AudioEncoder(enc, weights, self.dtype)
        self.audio_spec = spec
        self.features = AudioFeatures(spec)
        self.name = "Qwen2-Audio"
        self.media_tokens = MediaTokens({"audio": int(raw.get("audio_token_index", raw.get("audio_token_id", 151646)))},
                                        None, None)

    def prepare_prompt(self, token_ids: list[int], images: Sequence[Any] = (), videos: Sequence[Any] = (),
                       audios: Sequence[Any] = ()) -> tuple[list[int], MediaInputs]:
        """A rendered prompt with one <|AUDIO|> per clip (mono float32 samples at
        audio_spec.sampling_rate, in order) -> the prompt with each placeholder repeated to its
        clip's token count, and its media. MediaRefused for a clip too long or too short;
        ValueError for images or videos, or placeholder counts that differ from the clip count."""
        from mindie.engine.request import MediaInputs, MediaItem

        if images or videos:
            raise ValueError(f"{self.name} reads audio only; it takes no images or videos")
        inputs: list[AudioInput] = []
        for k, clip in enumerate(audios):
            try:
                inputs.append(self.features(clip))
            except ValueError as exc:
                raise MediaRefused("audio", k, str(exc)) from None
        ids, placed = expand_placeholders(token_ids, self.media_tokens.pads, {"audio": inputs})
        items = tuple(MediaItem(kind, at, inputs[k].num_tokens, inputs[k].content_hash, inputs[k])
                      for kind, k, at in placed)
        return ids, MediaInputs(items)

    def encode_media(self, item: MediaItem) -> torch.Tensor:
        """[item.num_tokens, hidden] in the model's dtype: the clip's embeddings."""
        return self.audio.encode(item.data).to(self.dtype)


class Qwen2AudioModel(AudioLanguage, LlamaModel):
    """The exact path: dense weights, torch projections."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 raw: dict[str, Any], spec: AudioSpec) -> None:
        LlamaModel.__init__(self, config, weights, dtype)
        self._init_audio(weights, raw, spec)


class QuantizedQwen2AudioModel(AudioLanguage, QuantizedLlamaModel):
    """The language model in the quantized C++ step (which takes the clips' rows); the encoder
    runs in torch, in the model's dtype."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 raw: dict[str, Any], spec: AudioSpec, quantization: str,
                 activation_bits: int = 16) -> None:
        from mindie.model.quantized import quantize_dense

        text = {k: w for k, w in weights.items() if not k.startswith(_AUDIO_PREFIXES)}
        matrices = {k: quantize_dense(w, quantization) for k, w in text.items() if w.dim() == 2}
        vectors = {k: w.float() for k, w in text.items() if w.dim() == 1}
        QuantizedLlamaModel.__init__(self, config, matrices, vectors, dtype, activation_bits)
        self._init_audio(weights, raw, spec)


def load_qwen2_audio(path: str, dtype: torch.dtype, quantization: str = "none", activation_bits: int = 16
                     ) -> tuple[ModelConfig, Qwen2AudioModel | QuantizedQwen2AudioModel]:
    """`quantization`: none / auto (dense, the exact path) or q8_0 / q4_0 (the C++ step)."""
    from mindie.model.hf_dir import language_model_names, read_config, read_raw_config, read_weights

    raw = read_raw_config(path)
    config = read_config(path)
    spec = AudioSpec.from_hf_dir(path)
    weights = language_model_names(read_weights(path), _AUDIO_PREFIXES)
    if quantization in ("q8_0", "q4_0"):
        return config, QuantizedQwen2AudioModel(config, weights, dtype, raw, spec, quantization, activation_bits)
    return config, Qwen2AudioModel(config, weights, dtype, raw, spec)
