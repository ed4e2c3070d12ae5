"""Tiny random Qwen2-VL / Qwen2.5-VL models written as Hugging Face directories (config,
safetensors, a byte-level tokenizer with Qwen's special tokens and a Qwen2-VL-style chat template),
Pillow-drawn images, and transformers' greedy reference for them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from helpers.media_engine import Greedy, hf_generate_greedy

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "<|video_pad|>"]
IDS = {t: 256 + i for i, t in enumerate(SPECIALS)}
VOCAB = 264
MIN_PIXELS, MAX_PIXELS = 28 * 28 * 4, 28 * 28 * 64
# A video's frames are sized within these (Qwen2VLVideoProcessor's size), and sampled at VIDEO_FPS.
VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS, VIDEO_FPS = 28 * 28 * 2, 28 * 28 * 12, 2.0
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tokenizer(path: Path, template_json: bool = False, specials: list[str] = SPECIALS,
                    template: str = CHAT_TEMPLATE) -> None:
    """`template_json`: the chat template in chat_template.json, where Qwen2-VL's processors keep it.
    `specials` and `template`: another family's (tests/helpers/tiny_audio.py); then only the tokenizer
    files are written, no image preprocessor configs."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in specials])
    tok.save(str(path / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    if template_json:
        (path / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    else:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    if specials is not SPECIALS:
        return
    (path / "preprocessor_config.json").write_text(json.dumps(
        {"min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS, "patch_size": 14, "temporal_patch_size": 2,
         "merge_size": 2}))
    (path / "video_preprocessor_config.json").write_text(json.dumps(
        {"size": {"shortest_edge": VIDEO_MIN_PIXELS, "longest_edge": VIDEO_MAX_PIXELS}, "fps": VIDEO_FPS,
         "min_frames": 4, "max_frames": 768, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2}))


def make_tiny_vl(path: Path, qwen25: bool, seed: int = 0) -> Path:
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
    )

    torch.manual_seed(seed)
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
                rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, rope_theta=10000.0,
                eos_token_id=IDS["<|im_end|>"], bos_token_id=None, pad_token_id=IDS["<|endoftext|>"])
    tokens = dict(image_token_id=IDS["<|image_pad|>"], video_token_id=IDS["<|video_pad|>"],
                  vision_start_token_id=IDS["<|vision_start|>"], vision_end_token_id=IDS["<|vision_end|>"],
                  tie_word_embeddings=False)
    if qwen25:
        vision = dict(depth=3, hidden_size=32, intermediate_size=48, out_hidden_size=64, num_heads=2,
                      window_size=56, fullatt_block_indexes=[1])
        model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision, **tokens))
    else:
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2)
        model = Qwen2VLForConditionalGeneration(Qwen2VLConfig(text_config=text, vision_config=vision, **tokens))
    # Larger-than-init weights make the logits decisive, so greedy ties are not a coin toss.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:  # a sharper lm_head spreads the logits without changing the hidden states
                p.mul_(1.0 if "visual" in name else 16.0 if "lm_head" in name else 2.0)
    model.save_pretrained(path)
    write_tokenizer(path, template_json=qwen25)
    return path


def draw(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Any:
    """A deterministic picture: gradients plus a few shapes."""
    from PIL import Image, ImageDraw

    g = torch.Generator().manual_seed(seed)
    image = Image.new("RGB", (width, height), tuple(torch.randint(0, 255, (3,), generator=g).tolist()))
    d = ImageDraw.Draw(image)
    for _ in range(6):
        x0, y0 = int(torch.randint(0, width, (1,), generator=g)), int(torch.randint(0, height, (1,), generator=g))
        x1, y1 = x0 + width // 3, y0 + height // 3
        color = tuple(torch.randint(0, 255, (3,), generator=g).tolist())
        (d.ellipse if torch.rand(1, generator=g) < 0.5 else d.rectangle)((x0, y0, x1, y1), fill=color)
    return image.convert(mode)


def clip(frames: int, fps: int = 4, size: tuple[int, int] = (96, 64), container: str = "mp4", seed: int = 0
         ) -> bytes:
    """An encoded video of `frames` drawn pictures (each its own, so frame order shows), PyAV-written:
    mp4 and avi as MPEG-4 part 2, wmv as WMV2 in ASF."""
    import io

    import av
    import numpy as np

    buf = io.BytesIO()
    with av.open(buf, mode="w", format={"wmv": "asf"}.get(container, container)) as out:
        stream = out.add_stream("wmv2" if container == "wmv" else "mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        stream.bit_rate = 4_000_000  # near-lossless, so decoded frames sit close to the drawn ones
        for i in range(frames):
            picture = np.asarray(draw(size[0], size[1], seed=seed * 1000 + i))
            for packet in stream.encode(av.VideoFrame.from_ndarray(picture, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def hf_processor() -> Any:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)


def hf_model(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).eval()


def hf_generate(model: Any, prompt_ids: list[int], images: list[Any], new_tokens: int, videos: list[Any] = ()
                ) -> Greedy:
    """transformers' greedy generate on the same prompt (pads already expanded), images and videos
    (our preprocessed VisualInputs: transformers' video processor needs torchvision, which does not
    load here)."""
    ids = torch.tensor([prompt_ids])
    kwargs: dict[str, Any] = {}
    if images or videos:
        kwargs["mm_token_type_ids"] = (ids == IDS["<|image_pad|>"]).int() + 2 * (ids == IDS["<|video_pad|>"]).int()
    if images:
        pre = hf_processor()(images=images, return_tensors="pt")
        kwargs.update(pixel_values=pre["pixel_values"], image_grid_thw=pre["image_grid_thw"])
    if videos:
        kwargs.update(pixel_values_videos=torch.cat([torch.from_numpy(v.pixels) for v in videos]),
                      video_grid_thw=torch.tensor([v.grid for v in videos]))
        if "Qwen2_5" in type(model).__name__:
            kwargs["second_per_grid_ts"] = torch.tensor([v.seconds_per_grid for v in videos])
    return hf_generate_greedy(model, ids, new_tokens, **kwargs)
