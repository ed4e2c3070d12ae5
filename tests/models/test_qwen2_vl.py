"""Qwen2-VL and Qwen2.5-VL through the engine against transformers on the same tiny random weights
and images: preprocessing, greedy tokens and their log-probabilities over several resolutions,
two images in one prompt, a batch mixing image and text requests, chunked prefill, preemption,
and the prefix cache (a hit on the same image, never on another)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.media_engine import (
    NEW,
    assert_quantized_step_reads_images,
    assert_same,
    assert_same_until_a_near_tie,
    run,
    run_one_after_another,
)
from helpers.tiny_vl import IDS, draw, hf_generate, hf_model, hf_processor

from mindie.engine.request import MediaInputs, SamplingParams
from mindie.model.llama_quant import QuantizedLlamaModel
from mindie.model.loader import LoadedModel, load_model
from mindie.model.qwen2_vl_processor import ImageSpec, preprocess
from mindie.model.qwen2_vl_vision import segment_attention

FAMILIES = ["qwen2_vl", "qwen25_vl"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, tiny_qwen2_vl_dir, tiny_qwen25_vl_dir):
    path = tiny_qwen25_vl_dir if request.param == "qwen25_vl" else tiny_qwen2_vl_dir
    return path, load_model(str(path), dtype=torch.float32), hf_model(path)


def prompt(loaded: LoadedModel, images: list, text: str = "What is this?") -> tuple[list[int], MediaInputs | None]:
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    rendered = loaded.tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    ids = loaded.tokenizer.encode(rendered, add_special_tokens=False)
    if not images:
        return ids, None
    return loaded.model.prepare_prompt(ids, images)


@pytest.mark.parametrize("size", [(56, 56), (120, 90), (60, 230), (400, 300)])
def test_preprocessing_equals_transformers(size):
    image = draw(*size, seed=size[0])
    ours = preprocess(image, ImageSpec(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64))
    want = hf_processor()(images=[image], return_tensors="np")
    assert tuple(want["image_grid_thw"][0]) == ours.grid
    np.testing.assert_array_equal(ours.pixels, want["pixel_values"])


def test_transparent_and_grey_images_as_transformers():
    for image in (draw(90, 70, 3, mode="RGBA"), draw(90, 70, 4, mode="L")):
        ours = preprocess(image, ImageSpec(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64))
        np.testing.assert_array_equal(ours.pixels, hf_processor()(images=[image], return_tensors="np")["pixel_values"])


def test_vision_tower_equals_transformers(family):
    """Our tower's output for two images (one spans several Qwen2.5-VL windows) against transformers'."""
    path, loaded, hf = family
    images = [draw(400, 300, 6), draw(60, 130, 7)]
    pre = hf_processor()(images=images, return_tensors="pt")
    with torch.no_grad():
        want = hf.model.visual(pre["pixel_values"], grid_thw=pre["image_grid_thw"]).pooler_output
    ids, media = prompt(loaded, images)
    ours = torch.cat([loaded.model.encode_media(item) for item in media.items])
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("size", [(56, 56), (150, 100), (70, 260)])
def test_one_image_matches_transformers(family, size):
    path, loaded, hf = family
    image = draw(*size, seed=size[1])
    ids, media = prompt(loaded, [image])
    assert ids.count(IDS["<|image_pad|>"]) == media.items[0].num_tokens
    assert_same(run(loaded, [(ids, media)])[0], hf_generate(hf, ids, [image], NEW))


def test_two_images_in_one_prompt(family):
    path, loaded, hf = family
    images = [draw(120, 90, 1), draw(60, 200, 2)]
    ids, media = prompt(loaded, images, "Compare them.")
    assert len(media.items) == 2
    assert_same(run(loaded, [(ids, media)])[0], hf_generate(hf, ids, images, NEW))


def test_batch_mixes_image_and_text_requests_with_chunked_prefill(family):
    path, loaded, hf = family
    image = draw(110, 140, 5)
    with_image, text_only = prompt(loaded, [image]), prompt(loaded, [], "Tell me a story.")
    together = run(loaded, [with_image, text_only, with_image], max_prefill_tokens=16)
    assert_same(together[0], hf_generate(hf, with_image[0], [image], NEW))
    assert_same(together[1], hf_generate(hf, text_only[0], [], NEW))
    assert together[2][0] == together[0][0]
    # a text request on the VL model gives the same tokens alone and beside an image
    assert run(loaded, [text_only])[0][0] == together[1][0]


def test_prefix_cache_hits_the_same_image_and_never_another(family):
    path, loaded, hf = family
    first, other = draw(120, 120, 8), draw(120, 120, 9)
    a, b = prompt(loaded, [first]), prompt(loaded, [other])
    assert a[0] == b[0]  # the same placeholder tokens ...
    results = dict(zip(("a1", "a2", "b"), run_one_after_another(loaded, [a, a, b]), strict=True))
    assert results["a2"][1] >= len(a[0]) - 4 and results["a2"][0] == results["a1"][0]
    # ... another image behind them: only the blocks before its first image token are shared
    assert results["b"][1] <= a[1].items[0].offset
    assert results["b"][0] == hf_generate(hf, b[0], [other], NEW)[0]


def test_preemption_recomputes_with_the_same_positions(family):
    path, loaded, hf = family
    image = draw(100, 100, 11)
    ids, media = prompt(loaded, [image])
    # a pool too small for three at once: sequences are preempted and recomputed
    need = -(-(len(ids) + NEW) // 4)
    outs = run(loaded, [(ids, media)] * 3, num_kv_blocks=need * 2 + 1)
    assert run.preemptions > 0  # type: ignore[attr-defined]
    want = hf_generate(hf, ids, [image], NEW)
    for out in outs:
        assert out[0] == want[0]


def test_quantized_step_reads_images_as_the_exact_path_does(family):
    """q8_0 weights in the C++ step, the image rows and M-RoPE rows passed in with the batch: close
    to the exact path (until 8-bit weights flip a near tie), and a row's bits depend on that row
    only, whether its image is prefilled in chunks beside other requests or alone."""
    path, loaded, hf = family
    quant = load_model(str(path), dtype=torch.float32, quantization="q8_0")
    assert isinstance(quant.model, QuantizedLlamaModel)
    assert_quantized_step_reads_images(loaded, quant, prompt, draw(130, 100, 12), draw(130, 100, 13))


@pytest.mark.parametrize("quantization", ["none", "q8_0"])
def test_bfloat16_reads_images(family, quantization):
    path, loaded, hf = family
    model = load_model(str(path), dtype=torch.bfloat16, quantization=quantization)
    exact = loaded if quantization == "none" else load_model(str(path), dtype=torch.float32, quantization="q8_0")
    image = draw(90, 120, 14)
    assert run(model, [prompt(model, [image])])[0][0][:3] == run(exact, [prompt(exact, [image])])[0][0][:3]


@pytest.fixture(scope="module")
def bf16_family(family):
    """The family's model and transformers' loaded in bfloat16: each runs its tower in bfloat16."""
    path, loaded, hf = family
    return path, load_model(str(path), dtype=torch.bfloat16), hf_model(path, torch.bfloat16)


def test_bfloat16_tower_equals_transformers_bfloat16(bf16_family):
    """The same kernels in the same order: equal bit for bit (a tolerance would let a step rounded
    where transformers does not round pass, e.g. the rotary embedding done in bfloat16, one
    bfloat16 step being within it)."""
    path, loaded, hf = bf16_family
    images = [draw(400, 300, 6), draw(60, 130, 7)]
    pre = hf_processor()(images=images, return_tensors="pt")
    with torch.no_grad():
        want = hf.model.visual(pre["pixel_values"].to(torch.bfloat16), grid_thw=pre["image_grid_thw"]).pooler_output
    ids, media = prompt(loaded, images)
    ours = torch.cat([loaded.model.encode_media(item) for item in media.items])
    assert ours.dtype == want.dtype == torch.bfloat16
    assert torch.equal(ours, want)


@pytest.mark.parametrize("size", [(56, 56), (150, 100), (70, 260), (400, 300)])
def test_bfloat16_matches_transformers_bfloat16(bf16_family, size):
    path, loaded, hf = bf16_family
    image = draw(*size, seed=size[1])
    ids, media = prompt(loaded, [image])
    assert_same_until_a_near_tie(run(loaded, [(ids, media)])[0], hf_generate(hf, ids, [image], NEW))


def test_bfloat16_two_images_and_a_text_request_in_chunks(bf16_family):
    path, loaded, hf = bf16_family
    images = [draw(120, 90, 1), draw(60, 200, 2)]
    with_images, text_only = prompt(loaded, images, "Compare them."), prompt(loaded, [], "Tell me a story.")
    together = run(loaded, [with_images, text_only], max_prefill_tokens=16)
    assert_same_until_a_near_tie(together[0], hf_generate(hf, with_images[0], images, NEW))
    assert_same_until_a_near_tie(together[1], hf_generate(hf, text_only[0], [], NEW))


@pytest.mark.parametrize("segments", [[16, 16, 8, 16, 4, 16, 8], [16] * 4, [64]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_segment_attention_equals_one_call_per_run(segments, dtype):
    """Windows of several lengths (a Qwen2.5-VL image's edge windows are shorter), of one length, or
    one run: each run's rows equal scaled_dot_product_attention on that run alone, bit for bit, as
    transformers computes them window by window."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(segments), 2, 16, generator=g).to(dtype) for _ in range(3))
    starts = np.cumsum([0, *segments[:-1]])
    want = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        *(x[s : s + n].transpose(0, 1)[None] for x in (q, k, v)))[0].transpose(0, 1)
        for s, n in zip(starts, segments, strict=True)])
    assert torch.equal(segment_attention(q, k, v, segments), want)


def test_offline_api_takes_images_as_vllm_does(family):
    from mindie import LLM

    path, loaded, hf = family
    image = draw(100, 80, 15)
    ids, media = prompt(loaded, [image])
    text = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}])
    llm = LLM(str(path), dtype="float32")
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": image}},
                       SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == run(loaded, [(ids, media)])[0][0]
