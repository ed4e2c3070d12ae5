"""Tiny random Idefics3 / SmolVLM models written as Hugging Face directories (config, safetensors,
a byte-level tokenizer with their special tokens and SmolVLM's chat template, a
preprocessor_config.json with small tiles), and transformers' processor and greedy reference for them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from helpers.media_engine import Greedy, hf_generate_greedy

GRID = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>",
            "<global-img>", *GRID]
IDS = {t: 256 + i for i, t in enumerate(SPECIALS)}
VOCAB = 256 + len(SPECIALS)
TILE, LONGEST_EDGE, PATCH = 32, 96, 8  # tiles of 32 px, images up to 3 x 3 tiles, 4 x 4 patches a tile
IMAGE_SEQ_LEN = (TILE // PATCH) ** 2 // 4  # scale_factor 2
# SmolVLM's own template (HuggingFaceTB/SmolVLM-256M-Instruct)
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")


def preprocessor(longest_edge: int = LONGEST_EDGE) -> dict[str, Any]:
    """preprocessor_config.json: images resized to `longest_edge` (TILE: one tile each), then tiled."""
    return {"do_image_splitting": True, "max_image_size": {"longest_edge": TILE},
            "size": {"longest_edge": longest_edge}, "resample": 1, "do_resize": True, "do_rescale": True,
            "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5], "do_pad": True}


def write_tokenizer(path: Path, longest_edge: int = LONGEST_EDGE) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<end_of_utterance>", "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE}))
    (path / "preprocessor_config.json").write_text(json.dumps(preprocessor(longest_edge)))


def make_tiny_idefics3(path: Path, smolvlm: bool, longest_edge: int = LONGEST_EDGE, seed: int = 0) -> Path:
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        SmolVLMConfig,
        SmolVLMForConditionalGeneration,
    )

    torch.manual_seed(seed)
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0,
                eos_token_id=IDS["<end_of_utterance>"], bos_token_id=None, pad_token_id=IDS["<|endoftext|>"],
                tie_word_embeddings=False)
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                  image_size=TILE, patch_size=PATCH)
    config_class, model_class = ((SmolVLMConfig, SmolVLMForConditionalGeneration) if smolvlm
                                 else (Idefics3Config, Idefics3ForConditionalGeneration))
    model = model_class(config_class(text_config=text, vision_config=vision, image_token_id=IDS["<image>"],
                                     scale_factor=2, tie_word_embeddings=False))
    # Larger-than-init weights make the logits decisive, so greedy ties are not a coin toss.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.mul_(1.0 if "vision_model" in name else 16.0 if "lm_head" in name else 2.0)
    model.save_pretrained(path)
    write_tokenizer(path, longest_edge)
    return path


def hf_processor(path: Path) -> Any:
    """transformers' processor (Pillow image processor, the directory's tokenizer) for the tiny model."""
    from transformers import PreTrainedTokenizerFast
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    from transformers.models.idefics3.processing_idefics3 import Idefics3Processor

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), eos_token="<end_of_utterance>",
                                        pad_token="<|endoftext|>")
    config = json.loads((path / "preprocessor_config.json").read_text())
    images = Idefics3ImageProcessorPil(**config)
    if json.loads((path / "config.json").read_text())["model_type"] == "smolvlm":
        from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

        images = SmolVLMImageProcessorPil(**config)
    return Idefics3Processor(images, tokenizer, image_seq_len=IMAGE_SEQ_LEN)


def hf_model(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).eval()


def hf_generate(model: Any, processor: Any, text: str, images: list[Any], new_tokens: int
                ) -> tuple[list[int], Greedy]:
    """transformers' processor and greedy generate on a rendered prompt holding one <image> per
    image: (its prompt token ids, the greedy generation)."""
    inputs = processor(text=[text], images=[images] if images else None, return_tensors="pt")
    kwargs = {k: v for k, v in inputs.items() if k in ("pixel_values", "pixel_attention_mask")}
    ids = inputs["input_ids"]
    return ids[0].tolist(), hf_generate_greedy(model, ids, new_tokens, **kwargs)
