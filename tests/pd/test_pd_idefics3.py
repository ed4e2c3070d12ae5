"""Images through prefill/decode disaggregation on tiny Idefics3 (images of 3 x 3 tiles) and SmolVLM
(one tile): P fetches, tiles, encodes and prefills; D takes the prompt as P laid it out (tiles, rows,
wrapper tokens) with the tiles' spans and keys, and never fetches (this D may not: it allows no
loopback URL) nor expands an image. The tokens equal the single instance's and transformers', through
a D that sends the request back for recompute too."""

from __future__ import annotations

import dataclasses
import io
import json

import httpx
import pytest
from helpers.media_server import MediaServer
from helpers.pd import blocks_back, dmi_settings, pd_pair_of, through_pd
from helpers.server import RunningServer, local_settings
from helpers.tiny_idefics3 import IDS, IMAGE_SEQ_LEN, hf_generate, hf_model, hf_processor
from helpers.tiny_vl import draw
from test_pd_images import FETCHES, answer

from mindie.engine.request import MediaInputs, MediaItem
from mindie.pd.records import RecordKind
from mindie.server.dmi import ForcedPreemption
from mindie.server.errors import APIError
from mindie.server.protocols.media import HandedOver, MediaRef, take_handed_over

IMAGE = draw(120, 90, 1)  # Idefics3: 3 x 3 tiles and the global image; SmolVLM: the one tile
NEW = 6
PROMPT = "<|im_start|>User:<image>What is this?<end_of_utterance>\nAssistant:"  # SmolVLM's template


@pytest.fixture(scope="module")
def image_url():
    buf = io.BytesIO()
    IMAGE.save(buf, "PNG")
    server = MediaServer({"a.png": buf.getvalue()})
    yield f"{server.url}/a.png"
    server.close()


@pytest.fixture(scope="module", params=[("idefics3", "handoff"), ("idefics3", "recompute"), ("smolvlm", "handoff")],
                ids="-".join)
def setup(request, tiny_idefics3_dir, tiny_smolvlm_dir):
    """(P, D, D's record reader, how D ends, the image's tiles, the single instance, transformers'
    prompt ids and tokens)."""
    family, kind = request.param
    tiles = 1 if family == "smolvlm" else 10
    path = tiny_smolvlm_dir if family == "smolvlm" else tiny_idefics3_dir
    want_ids, want = hf_generate(hf_model(path), hf_processor(path), PROMPT, [IMAGE], NEW)
    single = RunningServer(local_settings(str(path), dtype="float32", model_name="tiny", media=FETCHES))
    for p, d, reader in pd_pair_of(dmi_settings(path, media=FETCHES), dmi_settings(path)):
        if kind == "recompute":
            d.ctx.pd.preemption = ForcedPreemption(3)
        yield p, d, reader, kind, tiles, single, want_ids, want.tokens
    single.close()


def test_tiled_images_through_pd_equal_one_instance_and_transformers(setup, image_url):
    p, d, reader, kind, tiles, single, want_ids, want_tokens = setup
    assert want_ids.count(IDS["<image>"]) == tiles * IMAGE_SEQ_LEN
    content = [{"type": "image_url", "image_url": {"url": image_url}}, {"type": "text", "text": "What is this?"}]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": NEW,
            "temperature": 0, "ignore_eos": True}
    whole = {**chat, "return_token_ids": True}
    got, went_to_d = through_pd(p, d, reader, "/v1/chat/completions", whole, False)
    assert went_to_d
    body = json.loads(got)
    # D's renderer holds P's prompt: the tile layout transformers' processor writes, counted in usage
    assert body["prompt_token_ids"] == want_ids and body["usage"]["prompt_tokens"] == len(want_ids)
    assert body["choices"][0]["token_ids"] == want_tokens
    blocks_back(p, d)
    streamed = {**chat, "stream": True, "stream_options": {"include_usage": True}}
    parts = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": image_url}]
    infer = {"inputs": parts, "parameters": {"do_sample": False, "max_new_tokens": NEW}}
    for path, request, stream in (("/v1/chat/completions", whole, False), ("/v1/chat/completions", streamed, True),
                                  ("/infer", infer, False)):
        expected = httpx.post(single.url + path, json=request, timeout=60)
        assert expected.status_code == 200, expected.text
        got, went_to_d = through_pd(p, d, reader, path, request, stream)
        assert went_to_d
        assert answer(got, path, stream) == answer(expected.content, path, stream), (path, stream)
        if path == "/v1/chat/completions" and not stream:
            assert json.loads(got)["choices"][0]["token_ids"] == expected.json()["choices"][0]["token_ids"]
        blocks_back(p, d)
    retried = sum(r.kind is RecordKind.RETRY for r in reader.records)
    assert retried == (4 if kind == "recompute" else 0)  # each request sent back once, and recomputed on P


def test_a_handover_that_disagrees_with_its_prompt_or_body_is_a_400():
    pad, text = 7, 1
    refs = [MediaRef("image", "messages[0].content[0].image_url", "http://x/a.png")]
    tile = MediaItem("image", 2, 3, b"k", None)
    prompt = [text, text, pad, pad, pad, text]
    assert take_handed_over(HandedOver(prompt, MediaInputs((tile,))), {"image": pad}, refs, "messages")[0] == prompt
    for handover, why in [
        (HandedOver(prompt, None), "no media were handed over"),
        (HandedOver(prompt, MediaInputs((dataclasses.replace(tile, kind="audio"),))), "not the ['audio']"),
        (HandedOver(prompt, MediaInputs((dataclasses.replace(tile, offset=1),))), "the 3 image tokens at 1"),
        (HandedOver(prompt, MediaInputs((dataclasses.replace(tile, num_tokens=2),))), "one to one"),
        (HandedOver(prompt, MediaInputs((tile, dataclasses.replace(tile, offset=3, num_tokens=2)))), "one to one"),
    ]:
        with pytest.raises(APIError) as exc:
            take_handed_over(handover, {"image": pad}, refs, "messages")
        assert (exc.value.status, exc.value.param) == (400, "messages") and why in exc.value.message, exc.value.message
