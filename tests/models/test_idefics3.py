"""Idefics3 and SmolVLM through the engine against transformers on the same tiny random weights and
images: preprocessing (tiles, pixel values), the prompt layout, the encoder and connector, greedy
tokens and their log-probabilities for images of one tile and of several, two images in one
prompt, a batch mixing image and text requests in chunked prefill, the prefix cache (a hit on the
same image, never on another), and the quantized C++ step."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from helpers.media_engine import (
    NEW,
    Greedy,
    assert_quantized_step_reads_images,
    assert_same,
    assert_same_until_a_near_tie,
    run,
    run_one_after_another,
)
from helpers.tiny_idefics3 import IDS, IMAGE_SEQ_LEN, TILE, hf_generate, hf_model, hf_processor, preprocessor
from helpers.tiny_vl import draw

from mindie.engine.request import MediaInputs
from mindie.model.idefics3 import Idefics3Model
from mindie.model.idefics3_processor import TileSpec, preprocess
from mindie.model.llama_quant import QuantizedLlamaModel
from mindie.model.loader import LoadedModel, load_model

SIZES = [(20, 30), (32, 32), (100, 60), (60, 200), (300, 90)]


@pytest.fixture(scope="module", params=["idefics3", "smolvlm"])
def family(request: pytest.FixtureRequest, tiny_idefics3_dir, tiny_smolvlm_dir):
    """Idefics3 with images of up to 3 x 3 tiles; SmolVLM with images of one tile."""
    path = tiny_smolvlm_dir if request.param == "smolvlm" else tiny_idefics3_dir
    return path, load_model(str(path), dtype=torch.float32), hf_model(path), hf_processor(path)


def render(loaded: LoadedModel, images: list, text: str = "What is this?") -> str:
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    return loaded.tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)


def prompt(loaded: LoadedModel, images: list, text: str = "What is this?") -> tuple[list[int], MediaInputs | None]:
    ids = loaded.tokenizer.encode(render(loaded, images, text), add_special_tokens=False)
    return (ids, None) if not images else loaded.model.prepare_prompt(ids, images)


def reference(family, images: list, text: str = "What is this?") -> Greedy:
    """transformers' greedy generation, after checking its processor's prompt is ours."""
    path, loaded, hf, processor = family
    hf_ids, want = hf_generate(hf, processor, render(loaded, images, text), images, NEW)
    assert hf_ids == prompt(loaded, images, text)[0]
    return want


@pytest.mark.parametrize("spec", [{}, {"size": {"longest_edge": TILE}}, {"do_image_splitting": False}],
                         ids=["tiles", "one-tile", "no-splitting"])
@pytest.mark.parametrize("size", [*SIZES, (7, 500)])
def test_preprocessing_equals_transformers(spec, size):
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    config = {**preprocessor(), **spec}
    image = draw(*size, seed=size[0])
    ours = preprocess(image, dataclasses.replace(
        TileSpec(), longest_edge=config["size"]["longest_edge"], tile=TILE, split=config["do_image_splitting"]))
    want = Idefics3ImageProcessorPil(**config)(images=[[image]], return_tensors="np", return_row_col_info=True)
    assert (ours.rows, ours.cols) == (want["rows"][0][0], want["cols"][0][0])
    np.testing.assert_array_equal(np.stack([t.pixels for t in ours.tiles]), want["pixel_values"][0])


def test_transparent_and_grey_images_as_transformers():
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    for image in (draw(90, 70, 3, mode="RGBA"), draw(90, 70, 4, mode="L")):
        ours = preprocess(image, TileSpec(longest_edge=96, tile=TILE))
        want = Idefics3ImageProcessorPil(**preprocessor())(images=[[image]], return_tensors="np")
        np.testing.assert_array_equal(np.stack([t.pixels for t in ours.tiles]), want["pixel_values"][0])


def test_layout_and_encoder_equal_transformers(family):
    """Two images in one prompt: the same token ids as transformers' processor, one media item per
    tile at its <image> run, and the encoder + connector's output equal to transformers'."""
    path, loaded, hf, processor = family
    images = [draw(100, 60, 6), draw(40, 90, 7)]
    inputs = processor(text=[render(loaded, images)], images=[images], return_tensors="pt")
    ids, media = prompt(loaded, images)
    assert ids == inputs["input_ids"][0].tolist()
    assert len(media.items) == inputs["pixel_values"].shape[1]
    assert all(ids[i.offset : i.offset + i.num_tokens] == [IDS["<image>"]] * IMAGE_SEQ_LEN for i in media.items)
    assert ids.count(IDS["<image>"]) == media.num_tokens
    with torch.no_grad():
        want = hf.model.get_image_features(inputs["pixel_values"], inputs["pixel_attention_mask"]).pooler_output[0]
    ours = torch.cat([loaded.model.encode_media(item) for item in media.items])
    torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("size", SIZES)
def test_one_image_matches_transformers(family, size):
    path, loaded, hf, processor = family
    image = draw(*size, seed=size[1])
    assert_same(run(loaded, [prompt(loaded, [image])])[0], reference(family, [image]))


def test_two_images_in_one_prompt(family):
    path, loaded, hf, processor = family
    images = [draw(120, 90, 1), draw(60, 200, 2)]
    ids, media = prompt(loaded, images, "Compare them.")
    assert_same(run(loaded, [(ids, media)])[0], reference(family, images, "Compare them."))


def test_batch_mixes_image_and_text_requests_with_chunked_prefill(family):
    path, loaded, hf, processor = family
    image = draw(110, 140, 5)
    with_image, text_only = prompt(loaded, [image]), prompt(loaded, [], "Tell me a story.")
    together = run(loaded, [with_image, text_only, with_image], max_prefill_tokens=16)
    assert_same(together[0], reference(family, [image]))
    assert_same(together[1], reference(family, [], "Tell me a story."))
    assert together[2][0] == together[0][0]


def test_prefix_cache_hits_the_same_image_and_never_another(family):
    path, loaded, hf, processor = family
    first, other = draw(120, 120, 8), draw(120, 120, 9)
    a, b = prompt(loaded, [first]), prompt(loaded, [other])
    assert a[0] == b[0]  # the same tokens ...
    results = dict(zip(("a1", "a2", "b"), run_one_after_another(loaded, [a, a, b]), strict=True))
    assert results["a2"][1] >= len(a[0]) - 4 and results["a2"][0] == results["a1"][0]
    # ... another image behind them: only the blocks before its first tile's tokens are shared
    assert results["b"][1] <= a[1].items[0].offset
    assert results["b"][0] == reference(family, [other])[0]


def test_preemption_recomputes_without_encoding_again(family):
    path, loaded, hf, processor = family
    image = draw(100, 100, 11)
    ids, media = prompt(loaded, [image])
    need = -(-(len(ids) + NEW) // 4)
    outs = run(loaded, [(ids, media)] * 3, num_kv_blocks=need * 2 + 1)
    assert run.preemptions > 0  # type: ignore[attr-defined]
    want = reference(family, [image])
    for out in outs:
        assert out[0] == want[0]


def test_quantized_step_reads_images_as_the_exact_path_does(family):
    """q8_0 weights in the C++ step, the tiles' rows passed in with the batch: close to the exact
    path (until 8-bit weights flip a near tie), and a row's bits depend on that row only."""
    path, loaded, hf, processor = family
    quant = load_model(str(path), dtype=torch.float32, quantization="q8_0")
    assert isinstance(quant.model, QuantizedLlamaModel)
    assert_quantized_step_reads_images(loaded, quant, prompt, draw(130, 100, 12), draw(130, 100, 13))


def test_bfloat16_reads_images(family):
    path, loaded, hf, processor = family
    model = load_model(str(path), dtype=torch.bfloat16)
    image = draw(90, 120, 14)
    assert run(model, [prompt(model, [image])])[0][0][:3] == run(loaded, [prompt(loaded, [image])])[0][0][:3]


@pytest.fixture(scope="module")
def bf16_family(family):
    """The family's model and transformers' loaded in bfloat16: each runs its encoder in bfloat16."""
    path, loaded, hf, processor = family
    return path, load_model(str(path), dtype=torch.bfloat16), hf_model(path, torch.bfloat16), processor


def test_bfloat16_encoder_matches_transformers_bfloat16(family, bf16_family):
    """Every value rounded to bfloat16 where transformers rounds it, but the layer norms and GELU (C++
    kernels) compute their float32 values another way, so an output may differ from transformers' by a
    bfloat16 step or a few (one flipped rounding, carried through the later layers): within 1.6e-2
    relative (2 steps) of transformers' bfloat16 encoder, and no farther from its float32 one than
    transformers' bfloat16 encoder is, give or take one step."""
    path, loaded, hf, processor = bf16_family
    images = [draw(100, 60, 6), draw(40, 90, 7)]
    inputs = processor(text=[render(loaded, images)], images=[images], return_tensors="pt")
    with torch.no_grad():
        pixels, mask = inputs["pixel_values"], inputs["pixel_attention_mask"]
        want, exact = (m.model.get_image_features(pixels, mask).pooler_output[0] for m in (hf, family[2]))
    ids, media = prompt(loaded, images)
    ours = torch.cat([loaded.model.encode_media(item) for item in media.items])
    assert ours.dtype == want.dtype == torch.bfloat16
    step = 2**-7 * exact.abs().max().item()
    torch.testing.assert_close(ours, want, rtol=1.6e-2, atol=2 * step)
    assert (ours.float() - exact).abs().max() <= (want.float() - exact).abs().max() + step


@pytest.mark.parametrize("size", [(32, 32), (100, 60), (300, 90)])
def test_bfloat16_matches_transformers_bfloat16(bf16_family, size):
    path, loaded, hf, processor = bf16_family
    image = draw(*size, seed=size[1])
    assert_same_until_a_near_tie(run(loaded, [prompt(loaded, [image])])[0], reference(bf16_family, [image]))


def test_videos_and_miscounted_placeholders_are_refused(family):
    path, loaded, hf, processor = family
    assert isinstance(loaded.model, Idefics3Model)
    assert "video" not in loaded.model.media_tokens.pads
    ids = loaded.tokenizer.encode(render(loaded, [draw(40, 40)]), add_special_tokens=False)
    name = "SmolVLM" if "smolvlm" in str(path) else "Idefics3"
    with pytest.raises(ValueError, match=f"{name} reads images only"):
        loaded.model.prepare_prompt(ids, [draw(40, 40)], [object()])
    with pytest.raises(ValueError, match="1 image placeholders for 2 images"):
        loaded.model.prepare_prompt(ids, [draw(40, 40), draw(50, 50)])
