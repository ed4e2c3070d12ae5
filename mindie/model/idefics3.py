"""Idefics3 and SmolVLM (images): a Llama language model (LlamaModel's exact torch step, or with
q8_0 / q4_0 weights QuantizedLlamaModel's C++ step) with a SigLIP encoder and pixel-shuffle
connector (model/idefics3_vision.py), and the image-splitting prompt layout (model/idefics3_processor.py).

The language model sees an image as tiles: each tile's image_seq_len <image> tokens take the
encoder's output for that tile as their embeddings (AttentionMetadata.media_rows); the tokens
around them (<fake_token_around_image>, <row_r_col_c>, <global-img>, newlines) are text. Positions
are the plain 1-D ones, so a batch's rotary table is the text model's.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from mindie.model.config import ModelConfig
from mindie.model.idefics3_processor import ImageLayout, TileSpec, preprocess
from mindie.model.idefics3_vision import EncoderConfig, VisionEncoder
from mindie.model.llama import LlamaModel
from mindie.model.llama_quant import QuantizedLlamaModel
from mindie.model.qwen2_vl import MediaRefused, MediaTokens
from mindie.tokenizer import Tokenizer

if TYPE_CHECKING:
    from mindie.engine.request import MediaInputs, MediaItem

ARCHITECTURES = ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration")
_VISION_PREFIXES = ("model.vision_model.", "model.connector.")


class TiledVision:
    """What an Idefics3 / SmolVLM model adds to its language model's step, whichever step that is."""

    config: ModelConfig
    dtype: torch.dtype
    # SmolVLM's chat template iterates a message's content as parts (a string renders nothing):
    # the server gives it text as a text part
    template_reads_parts = True

    def _init_vision(self, weights: dict[str, torch.Tensor], raw: dict[str, Any], spec: TileSpec,
                     tokenizer: Tokenizer) -> None:
        enc = EncoderConfig.from_hf(raw)
        if spec.tile % (enc.patch_size * enc.scale_factor):
            raise ValueError(f"max_image_size {spec.tile} must be a multiple of patch_size x scale_factor "
                             f"({enc.patch_size} x {enc.scale_factor})")
        self.vision = VisionEncoder(enc, weights, self.dtype)
        self.tile_spec = spec
        self.name = (raw.get("architectures") or ARCHITECTURES)[0].removesuffix("ForConditionalGeneration")
        image_id = int(raw.get("image_token_id", 128257))
        self.layout = ImageLayout.from_tokenizer(tokenizer, image_id, enc.tokens_per_tile(spec.tile), spec.max_grid)
        self.media_tokens = MediaTokens({"image": image_id}, None, None)  # no video: the server refuses its parts

    def prepare_prompt(self, token_ids: list[int], images: list[Any], videos: list[Any] = (), audios: list[Any] = ()
                       ) -> tuple[list[int], MediaInputs]:
        """A rendered prompt with one <image> per image (Pillow images, in order) -> the prompt with
        each placeholder expanded into its tiles' layout, and one media item per tile. ValueError
        for videos or audio, or a placeholder count that differs from the image count."""
        from mindie.engine.request import MediaInputs, MediaItem

        if videos or audios:
            raise ValueError(f"{self.name} reads images only; it takes no {'video' if videos else 'audio'}")
        found = [i for i, t in enumerate(token_ids) if t == self.layout.image]
        if len(found) != len(images):
            raise ValueError(f"the prompt holds {len(found)} image placeholders for {len(images)} images")
        out: list[int] = []
        items: list[MediaItem] = []
        prev = 0
        for k, (at, image) in enumerate(zip(found, images)):
            try:
                tiled = preprocess(image, self.tile_spec)
            except (ValueError, OSError) as exc:  # Pillow's refusals of a damaged image
                raise MediaRefused("image", k, str(exc)) from None
            out += token_ids[prev:at]
            expanded, starts = self.layout.expand(tiled)
            items += [MediaItem("image", len(out) + s, self.layout.image_seq_len, tile.content_hash, tile)
                      for s, tile in zip(starts, tiled.tiles)]
            out += expanded
            prev = at + 1
        return out + token_ids[prev:], MediaInputs(tuple(items))

    def encode_media(self, item: MediaItem) -> torch.Tensor:
        """[image_seq_len, hidden] in the model's dtype: one tile's embeddings."""
        return self.vision.encode(torch.from_numpy(item.data.pixels)).to(self.dtype)


class Idefics3Model(TiledVision, LlamaModel):
    """The exact path: dense weights, torch projections."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 raw: dict[str, Any], spec: TileSpec, tokenizer: Tokenizer) -> None:
        LlamaModel.__init__(self, config, weights, dtype)
        self._init_vision(weights, raw, spec, tokenizer)


class QuantizedIdefics3Model(TiledVision, QuantizedLlamaModel):
    """The language model in the quantized C++ step (which takes the tiles' rows); the encoder
    runs in torch, in the model's dtype."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 raw: dict[str, Any], spec: TileSpec, tokenizer: Tokenizer, quantization: str,
                 activation_bits: int = 16) -> None:
        from mindie.model.quantized import quantize_dense

        text = {k: w for k, w in weights.items() if not k.startswith(_VISION_PREFIXES)}
        matrices = {k: quantize_dense(w, quantization) for k, w in text.items() if w.dim() == 2}
        vectors = {k: w.float() for k, w in text.items() if w.dim() == 1}
        QuantizedLlamaModel.__init__(self, config, matrices, vectors, dtype, activation_bits)
        self._init_vision(weights, raw, spec, tokenizer)


def _language_model_names(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`model.text_model.*` (Idefics3's layout) as the Llama names LlamaModel reads (`model.*`)."""
    return {"model." + k.removeprefix("model.text_model.") if k.startswith("model.text_model.") else k: w
            for k, w in weights.items()}


def load_idefics3(path: str, dtype: torch.dtype, quantization: str = "none", activation_bits: int = 16
                  ) -> tuple[ModelConfig, Idefics3Model | QuantizedIdefics3Model, Tokenizer]:
    """`quantization`: none / auto (dense, the exact path) or q8_0 / q4_0 (the C++ step)."""
    from mindie.model.hf_dir import read_config, read_raw_config, read_weights

    raw = read_raw_config(path)
    weights = _language_model_names(read_weights(path))
    # the text config's tie flag is not always where transformers reads it: the checkpoint decides
    config = dataclasses.replace(read_config(path), tie_word_embeddings="lm_head.weight" not in weights)
    tokenizer = Tokenizer.from_hf_dir(path, config.eos_token_ids)
    spec = TileSpec.from_hf_dir(path, int(raw["vision_config"].get("image_size", 224)))
    if quantization in ("q8_0", "q4_0"):
        model = QuantizedIdefics3Model(config, weights, dtype, raw, spec, tokenizer, quantization, activation_bits)
        return config, model, tokenizer
    return config, Idefics3Model(config, weights, dtype, raw, spec, tokenizer), tokenizer
