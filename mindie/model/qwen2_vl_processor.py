"""Qwen2-VL / Qwen2.5-VL image preprocessing and multimodal rotary positions, as transformers computes
them (`Qwen2VLImageProcessorPil`, `Qwen2VLModel.get_rope_index`); tests compare both with it.

Preprocessing: RGB (transparency composited on white) -> `smart_resize` to multiples of
patch_size * merge_size within [min_pixels, max_pixels] (bicubic, Pillow) -> x / 255 -> (x - mean) /
std -> patches of temporal_patch_size copies of the frame, in 2x2 merge-block order.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class ImageSpec:
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    mean: tuple[float, ...] = CLIP_MEAN
    std: tuple[float, ...] = CLIP_STD

    @staticmethod
    def from_hf_dir(path: str, vision: dict[str, Any]) -> ImageSpec:
        """preprocessor_config.json's limits where the directory has one, the vision config's patch
        geometry, transformers' defaults otherwise."""
        pre: dict[str, Any] = {}
        file = os.path.join(path, "preprocessor_config.json")
        if os.path.exists(file):
            with open(file, encoding="utf-8") as f:
                pre = json.load(f)
        size = pre.get("size") or {}
        return ImageSpec(
            min_pixels=int(pre.get("min_pixels") or size.get("shortest_edge") or 56 * 56),
            max_pixels=int(pre.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280),
            patch_size=int(vision.get("patch_size", 14)),
            temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
            merge_size=int(vision.get("spatial_merge_size", 2)),
            mean=tuple(pre.get("image_mean") or CLIP_MEAN), std=tuple(pre.get("image_std") or CLIP_STD),
        )


@dataclass(frozen=True)
class ImageInput:
    """One preprocessed image: what the vision tower reads, and what identifies it."""

    pixels: np.ndarray  # float32 [t*h*w, C * temporal_patch_size * patch^2]
    grid: tuple[int, int, int]  # (t, h, w) in patches
    num_tokens: int  # placeholder tokens = t*h*w / merge^2
    content_hash: bytes  # sha256 of the resized image and grid: the prefix cache's key for these tokens


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width), multiples of factor, pixels within [min_pixels, max_pixels], aspect kept."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"its aspect ratio must be at most 200, got {max(height, width) / min(height, width):.0f}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def to_rgb(image: Any) -> Any:
    """A Pillow image as RGB; transparency is composited on white, as transformers does."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def preprocess(image: Any, spec: ImageSpec) -> ImageInput:
    """A Pillow image -> ImageInput. ValueError for an aspect ratio beyond 200."""
    from PIL import Image

    rgb = to_rgb(image)
    factor = spec.patch_size * spec.merge_size
    h, w = smart_resize(rgb.height, rgb.width, factor, spec.min_pixels, spec.max_pixels)
    pixels_hwc = np.ascontiguousarray(rgb.resize((w, h), resample=Image.Resampling.BICUBIC))
    resized = pixels_hwc.transpose(2, 0, 1)
    x = (resized.astype(np.float64) * (1 / 255)).astype(np.float32)  # float64 first, as transformers
    mean, std = np.array(spec.mean, dtype=np.float32), np.array(spec.std, dtype=np.float32)
    x = ((x.T - mean) / std).T
    p, m, tp = spec.patch_size, spec.merge_size, spec.temporal_patch_size
    gh, gw = h // p, w // p
    patches = x.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], tp, p, p))
    pixels = np.ascontiguousarray(patches.reshape(gh * gw, 3 * tp * p * p), dtype=np.float32)
    grid = (1, gh, gw)
    # The patches are a function of the resized 8-bit image under this spec: hashing those bytes
    # (a quarter of the float patches', no copy) identifies the content as well.
    digest = hashlib.sha256(np.asarray(grid, dtype=np.int64).tobytes() + pixels_hwc.data).digest()
    return ImageInput(pixels, grid, gh * gw // (m * m), digest)


def expand_placeholders(token_ids: list[int], pad_id: int, images: list[ImageInput]) -> tuple[list[int], list[int]]:
    """Each `pad_id` token (one per image, in order) repeated as many times as the image has tokens.
    Returns (token ids, each image's first token index). ValueError unless the counts agree."""
    slots = [i for i, t in enumerate(token_ids) if t == pad_id]
    if len(slots) != len(images):
        raise ValueError(f"the prompt holds {len(slots)} image placeholders for {len(images)} images")
    out: list[int] = []
    offsets: list[int] = []
    prev = 0
    for slot, image in zip(slots, images):
        out += token_ids[prev:slot]
        offsets.append(len(out))
        out += [pad_id] * image.num_tokens
        prev = slot + 1
    return out + token_ids[prev:], offsets


def mrope_positions(num_tokens: int, spans: list[tuple[int, tuple[int, int, int]]], merge: int
                    ) -> tuple[np.ndarray, int]:
    """(t, h, w) rotary positions [3, num_tokens] of a prompt whose media tokens are `spans`
    (first index, grid), and the delta that generated tokens add to their index. Text continues
    from the largest position so far + 1; an image's tokens sit at its start + (frame, row, column)."""
    pos = np.zeros((3, num_tokens), dtype=np.int64)
    at, cur = 0, 0
    for offset, (t, h, w) in sorted(spans):
        pos[:, at:offset] = np.arange(offset - at) + cur
        cur += offset - at
        gh, gw = h // merge, w // merge
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        n = t * gh * gw
        pos[:, offset : offset + n] = np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) + cur
        cur += max(gh, gw)
        at = offset + n
    pos[:, at:] = np.arange(num_tokens - at) + cur
    delta = int(pos.max()) + 1 - num_tokens if num_tokens else 0
    return pos, delta
