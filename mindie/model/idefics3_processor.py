"""Idefics3 / SmolVLM image preprocessing and prompt layout, as transformers computes them
(`Idefics3ImageProcessorPil` / `SmolVLMImageProcessorPil`, `Idefics3Processor.replace_image_token`);
tests compare both with it.

Preprocessing: RGB (transparency composited on white) -> longest edge resized to size.longest_edge
(Lanczos, Pillow, uint8) -> each side rounded up to a multiple of the tile (max_image_size) -> split
into tiles in row-major order plus the whole image resized to one tile (the global image) -> x / 255
-> (x - mean) / std. An image that fits one tile is that tile alone. Each tile takes image_seq_len
tokens; the prompt's single image placeholder becomes per tile <fake_token_around_image>
<row_r_col_c> <image>*image_seq_len, a newline after each row, and the global block.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from mindie.model.hf_dir import read_optional_json
from mindie.model.qwen2_vl_processor import to_rgb

MAX_IMAGE_SIZE = 4096  # transformers' cap on the resized image's longest edge
MAX_GRID = 6  # the <row_r_col_c> tokens Idefics3's tokenizers hold: r, c <= 6


@dataclass(frozen=True)
class TileSpec:
    longest_edge: int = 4 * 364  # size.longest_edge: the image is first resized to this longest edge
    tile: int = 364  # max_image_size.longest_edge: the side of a tile and of the global image
    split: bool = True  # do_image_splitting
    resize: bool = True  # do_resize
    resample: int = 1  # PIL.Image.Resampling.LANCZOS
    rescale: float = 1 / 255
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.5, 0.5, 0.5)

    @staticmethod
    def from_hf_dir(path: str, image_size: int) -> TileSpec:
        """preprocessor_config.json where the directory has one; transformers' defaults otherwise,
        with tiles the vision encoder's image size."""
        pre = read_optional_json(path, "preprocessor_config.json")
        tile = int((pre.get("max_image_size") or {}).get("longest_edge") or image_size)
        return TileSpec(
            longest_edge=int((pre.get("size") or {}).get("longest_edge") or 4 * tile), tile=tile,
            split=bool(pre.get("do_image_splitting", True)), resize=bool(pre.get("do_resize", True)),
            resample=int(pre.get("resample", 1)), rescale=float(pre.get("rescale_factor", 1 / 255)),
            mean=tuple(pre.get("image_mean") or (0.5, 0.5, 0.5)), std=tuple(pre.get("image_std") or (0.5, 0.5, 0.5)))

    @property
    def max_grid(self) -> int:
        """The most rows (or columns) of tiles an image can take."""
        return math.ceil(min(self.longest_edge, MAX_IMAGE_SIZE) / self.tile) if self.split else 0


@dataclass(frozen=True)
class Tile:
    """One tile of an image (or its global image), what the vision encoder reads."""

    pixels: np.ndarray  # float32 [3, tile, tile], normalised
    content_hash: bytes  # sha256 of the tile's 8-bit pixels: the prefix cache's key for its tokens


@dataclass(frozen=True)
class TiledImage:
    tiles: tuple[Tile, ...]  # row-major tiles, then the global image; one tile when rows == cols == 0
    rows: int
    cols: int


@dataclass(frozen=True)
class ImageLayout:
    """The token ids an image's placeholder expands into."""

    image: int  # <image>: each of a tile's image_seq_len tokens
    fake: int  # <fake_token_around_image>
    global_image: int  # <global-img>
    grid: dict[tuple[int, int], int]  # (row, col) from 1 -> <row_r_col_c>
    newline: list[int]  # "\n" after each row of tiles but the last
    blank: list[int]  # "\n\n" after the last row, before the global image
    image_seq_len: int

    @staticmethod
    def from_tokenizer(tokenizer: Any, image_token_id: int, image_seq_len: int, max_grid: int) -> ImageLayout:
        """ValueError naming a special token the tokenizer lacks."""
        def special(text: str) -> int:
            found = tokenizer.backend.token_to_id(text)
            if found is None:
                raise ValueError(f"the tokenizer has no {text} token, which Idefics3's image prompts need")
            return found

        grid = {(r, c): special(f"<row_{r}_col_{c}>") for r in range(1, max_grid + 1) for c in range(1, max_grid + 1)}
        return ImageLayout(image_token_id, special("<fake_token_around_image>"), special("<global-img>"), grid,
                           tokenizer.encode("\n", add_special_tokens=False),
                           tokenizer.encode("\n\n", add_special_tokens=False), image_seq_len)

    def expand(self, image: TiledImage) -> tuple[list[int], list[int]]:
        """(the tokens that replace the placeholder, the offset of each tile's first <image> token
        among them, in image.tiles' order)."""
        out: list[int] = []
        starts: list[int] = []

        def tile(*lead: int) -> None:
            out.extend(lead)
            starts.append(len(out))
            out.extend([self.image] * self.image_seq_len)

        for r in range(1, image.rows + 1):
            for c in range(1, image.cols + 1):
                tile(self.fake, self.grid[r, c])
            out.extend(self.newline if r < image.rows else self.blank)
        tile(self.fake, self.global_image)
        out.append(self.fake)
        return out, starts


def _resize(image: Any, height: int, width: int, spec: TileSpec) -> Any:
    return image.resize((width, height), resample=spec.resample)


def _longest_edge_size(height: int, width: int, longest: int) -> tuple[int, int]:
    """transformers' _resize_output_size_rescale_to_max_len, then its scale_below_upper_bound."""
    aspect = width / height
    if width >= height:
        width = longest
        height = int(width / aspect)
        height += height % 2
    else:
        height = longest
        width = int(height * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect)
    elif height > width and height > MAX_IMAGE_SIZE:
        height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect)
    return max(height, 1), max(width, 1)


def _tile_multiple_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """transformers' resize_for_vision_encoder: both sides up to multiples of the tile, the short
    one from the long one's rounded length and the aspect ratio."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


def preprocess(image: Any, spec: TileSpec) -> TiledImage:
    """A Pillow image -> its tiles and their grid."""
    rgb = to_rgb(image)
    if spec.resize:
        rgb = _resize(rgb, *_longest_edge_size(rgb.height, rgb.width, spec.longest_edge), spec)
    t = spec.tile
    if not spec.split:
        return TiledImage((_tile(_resize(rgb, t, t, spec), spec),), 0, 0)
    rgb = _resize(rgb, *_tile_multiple_size(rgb.height, rgb.width, t), spec)
    if rgb.height <= t and rgb.width <= t:
        return TiledImage((_tile(rgb, spec),), 0, 0)
    rows, cols = rgb.height // t, rgb.width // t
    crops = [rgb.crop((c * t, r * t, (c + 1) * t, (r + 1) * t)) for r in range(rows) for c in range(cols)]
    return TiledImage(tuple(_tile(x, spec) for x in [*crops, _resize(rgb, t, t, spec)]), rows, cols)


def _tile(image: Any, spec: TileSpec) -> Tile:
    raw = np.asarray(image)  # uint8 [h, w, 3]
    x = (raw.astype(np.float64) * spec.rescale).astype(np.float32)  # float64 first, as transformers
    x = (x - np.array(spec.mean, dtype=np.float32)) / np.array(spec.std, dtype=np.float32)
    digest = hashlib.sha256(np.asarray(raw.shape, dtype=np.int64).tobytes() + np.ascontiguousarray(raw).data).digest()
    return Tile(np.ascontiguousarray(x.transpose(2, 0, 1), dtype=np.float32), digest)
