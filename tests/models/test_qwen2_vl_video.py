"""Videos on Qwen2-VL and Qwen2.5-VL: frame sampling and patches against a plain reference of
transformers' rules, and greedy tokens through the engine against transformers on the same tiny
random weights, fed the pixel values and grids our preprocessing produced (transformers' video
processor needs torchvision, which does not load beside the CPU torch here). Several frame counts,
a video beside an image, a batch with text requests and chunked prefill, and the prefix cache."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers.media_engine import NEW, assert_same, run, run_one_after_another
from helpers.tiny_vl import IDS, VIDEO_FPS, VIDEO_MAX_PIXELS, VIDEO_MIN_PIXELS, clip, draw, hf_generate, hf_model

from mindie.engine.request import MediaInputs, SamplingParams
from mindie.media.video import probe_video
from mindie.model.loader import LoadedModel, load_model
from mindie.model.qwen2_vl_processor import (
    ImageSpec,
    VideoSpec,
    mrope_positions,
    preprocess,
    preprocess_video,
    sample_frames,
    smart_resize,
)

FAMILIES = ["qwen2_vl", "qwen25_vl"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, tiny_qwen2_vl_dir, tiny_qwen25_vl_dir):
    path = tiny_qwen25_vl_dir if request.param == "qwen25_vl" else tiny_qwen2_vl_dir
    return path, load_model(str(path), dtype=torch.float32), hf_model(path)


def prompt(loaded: LoadedModel, videos: list, images: list = (), text: str = "What happens?"
           ) -> tuple[list[int], MediaInputs]:
    content = ([{"type": "image"} for _ in images] + [{"type": "video"} for _ in videos]
               + [{"type": "text", "text": text}])
    rendered = loaded.tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    ids = loaded.tokenizer.encode(rendered, add_special_tokens=False)
    return loaded.model.prepare_prompt(ids, list(images), videos)


def reference_indices(total: int, fps: float, spec: VideoSpec) -> list[int]:
    """transformers' Qwen2VLVideoProcessor.sample_frames with `fps`, restated in numpy (float32 steps)."""
    tp = spec.frame.temporal_patch_size
    max_frames = math.floor(min(spec.max_frames, total) / tp) * tp
    n = min(max(total / fps * spec.fps, spec.min_frames), max_frames, total)
    n = math.floor(n / tp) * tp
    if n == 0:
        return list(range(total))
    return np.arange(0, total, np.float32(total / n), dtype=np.float32).astype(np.int32).tolist()


@pytest.mark.parametrize("total,fps", [(1, 30.0), (3, 4.0), (8, 4.0), (13, 4.0), (97, 25.0), (300, 29.97),
                                       (5000, 30.0), (41, 2.5)])
def test_frame_sampling_follows_transformers(total, fps):
    spec = VideoSpec(ImageSpec(), fps=2.0, min_frames=4, max_frames=768)
    got = sample_frames(total, fps, spec)
    assert got == reference_indices(total, fps, spec)
    assert got == sorted(got) and all(0 <= i < total for i in got)
    assert len(got) % 2 == 0 or total < 2


def reference_patches(frames: np.ndarray, spec: ImageSpec) -> np.ndarray:
    """transformers' Qwen2VLVideoProcessor.patchify (after rescale and normalize) on torch tensors."""
    x = torch.from_numpy(frames.copy()).permute(0, 3, 1, 2).double().mul(1 / 255).float()
    x = (x - torch.tensor(spec.mean).view(1, 3, 1, 1)) / torch.tensor(spec.std).view(1, 3, 1, 1)
    videos = x[None]
    tp, p, m = spec.temporal_patch_size, spec.patch_size, spec.merge_size
    if pad := -videos.shape[1] % tp:
        videos = torch.cat((videos, videos[:, -1:].expand(-1, pad, -1, -1, -1)), dim=1)
    b, n, c, h, w = videos.shape
    patches = videos.view(b, n // tp, tp, c, h // p // m, m, p, w // p // m, m, p)
    patches = patches.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    return patches.reshape(n // tp * (h // p) * (w // p), c * tp * p * p).numpy()


@pytest.mark.parametrize("frames,size", [(3, (96, 64)), (8, (64, 120)), (13, (200, 90))])
def test_video_patches_follow_transformers(frames, size):
    from PIL import Image

    clip_ = probe_video(clip(frames, fps=4, size=size, seed=frames), "video")
    spec = VideoSpec(ImageSpec(min_pixels=VIDEO_MIN_PIXELS, max_pixels=VIDEO_MAX_PIXELS), fps=VIDEO_FPS)
    ours = preprocess_video(clip_, spec)
    indices = reference_indices(frames, 4.0, spec)
    h, w = smart_resize(size[1], size[0], 28, VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS)
    resized = np.stack([np.asarray(Image.fromarray(f).resize((w, h), Image.Resampling.BICUBIC))
                        for f in clip_.frames(indices)])
    assert ours.grid == (-(-len(indices) // 2), h // 14, w // 14)
    np.testing.assert_allclose(ours.pixels, reference_patches(resized, spec.frame), rtol=0, atol=1e-6)
    assert ours.seconds_per_grid == pytest.approx(2 / (len(indices) / frames * 4.0))
    assert ours.num_tokens == ours.grid[0] * ours.grid[1] * ours.grid[2] // 4


def test_an_image_is_a_one_frame_video_in_patches():
    image = draw(120, 90, 3)
    spec = ImageSpec(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64)
    ours = preprocess(image, spec)
    h, w = ours.grid[1] * 14, ours.grid[2] * 14
    from PIL import Image

    frame = np.asarray(image.resize((w, h), Image.Resampling.BICUBIC))[None]
    np.testing.assert_array_equal(ours.pixels, reference_patches(frame, spec))


def test_video_positions_step_frames_by_seconds():
    """A Qwen2.5-VL video's t positions: frame * tokens_per_second * seconds per patch, truncated."""
    pos, delta = mrope_positions(3 + 2 * 4 + 2, [(3, (2, 4, 4), 1.5)], 2)
    t = pos[0, 3:11].tolist()
    assert t == [3, 3, 3, 3, 4, 4, 4, 4]  # 0 * 1.5 and int(1 * 1.5) = 1
    assert pos[:, 11:].tolist() == [[5, 6]] * 3  # text goes on from 3 + max(h, w) / merge
    assert delta == 7 - 13


@pytest.mark.parametrize("frames", [3, 8, 13])
def test_one_video_matches_transformers(family, frames):
    path, loaded, hf = family
    video = probe_video(clip(frames, fps=4, seed=frames), "video")
    ids, media = prompt(loaded, [video])
    item = media.items[0]
    assert (item.kind, ids.count(IDS["<|video_pad|>"])) == ("video", item.num_tokens)
    assert item.data.grid[0] == -(-len(sample_frames(frames, 4.0, loaded.model.video_spec)) // 2)
    assert_same(run(loaded, [(ids, media)])[0], hf_generate(hf, ids, [], NEW, videos=[item.data]))


def test_a_video_beside_an_image_and_text_requests(family):
    path, loaded, hf = family
    video, image = probe_video(clip(8, fps=4, size=(80, 80), seed=21), "video"), draw(100, 70, 22)
    ids, media = prompt(loaded, [video], [image], "Compare them.")
    assert [i.kind for i in media.items] == ["image", "video"]
    video_input = media.items[1].data  # the engine lets the pixels go once it has encoded them
    text_only = (loaded.tokenizer.encode("Tell me a story.", add_special_tokens=False), None)
    together = run(loaded, [(ids, media), text_only], max_prefill_tokens=16)
    assert_same(together[0], hf_generate(hf, ids, [image], NEW, videos=[video_input]))
    assert together[1][0] == run(loaded, [text_only])[0][0]


def test_prefix_cache_hits_the_same_video_and_never_another(family):
    path, loaded, hf = family
    a = prompt(loaded, [probe_video(clip(8, fps=4, seed=31), "video")])
    b = prompt(loaded, [probe_video(clip(8, fps=4, seed=32), "video")])
    assert a[0] == b[0] and a[1].items[0].content_hash != b[1].items[0].content_hash
    b_input = b[1].items[0].data
    results = dict(zip(("a1", "a2", "b"), run_one_after_another(loaded, [a, a, b]), strict=True))
    assert results["a2"][1] >= len(a[0]) - 4 and results["a2"][0] == results["a1"][0]
    assert results["b"][1] <= a[1].items[0].offset  # another video: nothing from its first token on
    assert results["b"][0] == hf_generate(hf, b[0], [], NEW, videos=[b_input])[0]


def test_offline_api_takes_a_video_file(family, tmp_path):
    from mindie import LLM

    path, loaded, hf = family
    file = tmp_path / "clip.avi"
    file.write_bytes(clip(6, fps=4, container="avi", seed=41))
    ids, media = prompt(loaded, [probe_video(file.read_bytes(), "video")])
    text = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}],
        add_generation_prompt=True)
    llm = LLM(str(path), dtype="float32")
    out = llm.generate({"prompt": text, "multi_modal_data": {"video": str(file)}},
                       SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == run(loaded, [(ids, media)])[0][0]
