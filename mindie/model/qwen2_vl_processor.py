"""Qwen2-VL / Qwen2.5-VL image and video preprocessing and multimodal rotary positions, as
transformers computes them (`Qwen2VLImageProcessorPil`, `Qwen2VLVideoProcessor`,
`Qwen2VLModel.get_rope_index`); tests compare them with it.

Preprocessing: RGB (transparency composited on white) -> `smart_resize` to multiples of
patch_size * merge_size within [min_pixels, max_pixels] (bicubic, Pillow) -> x / 255 -> (x - mean) /
std -> patches of temporal_patch_size frames, in 2x2 merge-block order. An image is one frame
repeated; a video is the frames its sampler picks (2 per second by default), the last repeated to
fill the final temporal patch. transformers resizes video frames with torchvision, which cannot
load beside the CPU torch here: frames are resized with Pillow as images are.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from mindie.model.hf_dir import read_optional_json

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
        pre = read_optional_json(path, "preprocessor_config.json")
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
class VideoSpec:
    """How frames are sampled from a video and sized (Qwen2VLVideoProcessor's defaults, or the
    directory's video_preprocessor_config.json)."""

    frame: ImageSpec  # patch geometry, normalisation, and the video's own min / max pixels a frame
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768

    @staticmethod
    def from_hf_dir(path: str, image: ImageSpec) -> VideoSpec:
        pre = read_optional_json(path, "video_preprocessor_config.json")
        size = pre.get("size") or {}
        frame = dataclasses.replace(
            image, min_pixels=int(pre.get("min_pixels") or size.get("shortest_edge") or 128 * 28 * 28),
            max_pixels=int(pre.get("max_pixels") or size.get("longest_edge") or 768 * 28 * 28))
        return VideoSpec(frame, fps=float(pre.get("fps") or 2.0), min_frames=int(pre.get("min_frames") or 4),
                         max_frames=int(pre.get("max_frames") or 768))


@dataclass(frozen=True)
class VisualInput:
    """One preprocessed image or video: what the vision tower reads, and what identifies it."""

    pixels: np.ndarray  # float32 [t*h*w, C * temporal_patch_size * patch^2]
    grid: tuple[int, int, int]  # (t, h, w) in patches
    num_tokens: int  # placeholder tokens = t*h*w / merge^2
    content_hash: bytes  # sha256 of the resized frames and grid: the prefix cache's key for these tokens
    seconds_per_grid: float | None = None  # a video's seconds per temporal patch; None for an image


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


def preprocess(image: Any, spec: ImageSpec) -> VisualInput:
    """A Pillow image -> VisualInput. ValueError for an aspect ratio beyond 200."""
    from PIL import Image

    rgb = to_rgb(image)
    h, w = smart_resize(rgb.height, rgb.width, spec.patch_size * spec.merge_size, spec.min_pixels, spec.max_pixels)
    return _patches(np.asarray(rgb.resize((w, h), resample=Image.Resampling.BICUBIC))[None], spec)


def sample_frames(total: int, fps: float, spec: VideoSpec) -> list[int]:
    """Which of a video's `total` frames (at `fps`) are read: spec.fps a second, at least
    min_frames, at most max_frames, a multiple of temporal_patch_size, evenly spaced (transformers'
    sample_frames, float32 steps included). A clip shorter than one temporal patch gives all its frames."""
    import torch

    tp = spec.frame.temporal_patch_size
    most = math.floor(min(spec.max_frames, total) / tp) * tp
    n = math.floor(min(max(total / fps * spec.fps, spec.min_frames), most, total) / tp) * tp
    if n == 0:
        return list(range(total))
    return torch.arange(0, total, total / n).int().tolist()


def preprocess_video(clip: Any, spec: VideoSpec) -> VisualInput:
    """A probed video (mindie.media.video.VideoClip) -> VisualInput: its sampled frames decoded,
    resized and patched. ValueError for an aspect ratio beyond 200; MediaError for a damaged clip."""
    from PIL import Image

    f = spec.frame
    indices = sample_frames(clip.total_frames, clip.fps, spec)
    h, w = smart_resize(clip.height, clip.width, f.patch_size * f.merge_size, f.min_pixels, f.max_pixels)
    frames = np.stack([np.asarray(Image.fromarray(x).resize((w, h), resample=Image.Resampling.BICUBIC))
                       for x in clip.frames(indices)])
    sampled_fps = len(indices) / clip.total_frames * clip.fps
    return dataclasses.replace(_patches(frames, f), seconds_per_grid=f.temporal_patch_size / sampled_fps)


def _patches(frames: np.ndarray, spec: ImageSpec) -> VisualInput:
    """Resized RGB frames uint8 [n, h, w, 3] -> the tower's patch rows, the last frame repeated to
    fill the final temporal patch."""
    p, m, tp = spec.patch_size, spec.merge_size, spec.temporal_patch_size
    n, h, w = frames.shape[:3]
    x = (frames.astype(np.float64) * (1 / 255)).astype(np.float32)  # float64 first, as transformers
    x = ((x - np.array(spec.mean, dtype=np.float32)) / np.array(spec.std, dtype=np.float32)).transpose(0, 3, 1, 2)
    if pad := -n % tp:
        x = np.concatenate([x, np.repeat(x[-1:], pad, axis=0)])
    gt, gh, gw = x.shape[0] // tp, h // p, w // p
    patches = x.reshape(gt, tp, 3, gh // m, m, p, gw // m, m, p).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    pixels = np.ascontiguousarray(patches.reshape(gt * gh * gw, 3 * tp * p * p), dtype=np.float32)
    grid = (gt, gh, gw)
    # The patches are a function of the resized 8-bit frames under this spec: hashing those bytes
    # (a quarter of the float patches') identifies the content as well.
    digest = hashlib.sha256(np.asarray(grid, dtype=np.int64).tobytes() + np.ascontiguousarray(frames).data).digest()
    return VisualInput(pixels, grid, gt * gh * gw // (m * m), digest)


def expand_placeholders(token_ids: list[int], pads: dict[str, int], inputs: dict[str, list[Any]]
                        ) -> tuple[list[int], list[tuple[str, int, int]]]:
    """`inputs`: per kind (image, video) its inputs (each with num_tokens) in prompt order; `pads`:
    each kind's placeholder token. Each placeholder (one per input) is repeated as many times as its
    input has tokens. Returns (token ids, (kind, index among its kind, first token) per input in
    prompt order). ValueError unless each kind's counts agree."""
    slots: list[tuple[int, str, int]] = []
    for kind, pad in pads.items():
        found = [i for i, t in enumerate(token_ids) if t == pad]
        given = len(inputs.get(kind, ()))
        if len(found) != given:
            raise ValueError(f"the prompt holds {len(found)} {kind} placeholders for {given} {kind}s")
        slots += [(at, kind, k) for k, at in enumerate(found)]
    out: list[int] = []
    placed: list[tuple[str, int, int]] = []
    prev = 0
    for slot, kind, k in sorted(slots):
        out += token_ids[prev:slot]
        placed.append((kind, k, len(out)))
        out += [pads[kind]] * inputs[kind][k].num_tokens
        prev = slot + 1
    return out + token_ids[prev:], placed


def mrope_positions(num_tokens: int, spans: list[tuple[int, tuple[int, int, int], float]], merge: int
                    ) -> tuple[np.ndarray, int]:
    """(t, h, w) rotary positions [3, num_tokens] of a prompt whose media tokens are `spans`
    (first index, grid, temporal step), and the delta that generated tokens add to their index.
    Text continues from the position after the previous text's + max(h, w) of the media between,
    as transformers 5 counts; a medium's tokens sit at its start + (frame * step, row, column),
    the frame position truncated to an integer (Qwen2.5-VL steps a video's frames by its seconds)."""
    pos = np.zeros((3, num_tokens), dtype=np.int64)
    at, cur = 0, 0
    for offset, (t, h, w), step in sorted(spans):
        pos[:, at:offset] = np.arange(offset - at) + cur
        cur += offset - at
        gh, gw = h // merge, w // merge
        frames = (np.arange(t, dtype=np.float32) * np.float32(step)).astype(np.int64)
        tt, hh, ww = np.meshgrid(frames, np.arange(gh), np.arange(gw), indexing="ij")
        n = t * gh * gw
        pos[:, offset : offset + n] = np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) + cur
        cur += max(gh, gw)
        at = offset + n
    pos[:, at:] = np.arange(num_tokens - at) + cur
    delta = int(pos.max()) + 1 - num_tokens if num_tokens else 0
    return pos, delta
