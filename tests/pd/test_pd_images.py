"""Images and videos through prefill/decode disaggregation on a tiny Qwen2-VL: P fetches, encodes and
prefills; D continues from P's KV with the media tokens' counts, cache keys and rotary delta P
hands over, and never fetches (this D may not: it allows no local path and no loopback URL). Through
a D that sends the request back for recompute too, the answer is the single instance's."""

from __future__ import annotations

import io
import json

import httpx
import pytest
from helpers.media_server import MediaServer
from helpers.pd import blocks_back, dmi_settings, pd_pair_of, through_pd
from helpers.server import RunningServer, local_settings
from helpers.tiny_vl import clip, draw

from mindie.media import MediaPolicy
from mindie.pd.records import RecordKind
from mindie.server.dmi import ForcedPreemption

FETCHES = MediaPolicy(allow_private_urls=True)


@pytest.fixture(scope="module")
def image_url():
    buf = io.BytesIO()
    draw(120, 90, 21).save(buf, "PNG")
    server = MediaServer({"a.png": buf.getvalue()})
    yield f"{server.url}/a.png"
    server.close()


@pytest.fixture(scope="module")
def video_url():
    server = MediaServer({"a.mp4": clip(8, fps=4, seed=22)})
    yield f"{server.url}/a.mp4"
    server.close()


@pytest.fixture(scope="module")
def vl_single(tiny_qwen2_vl_dir):
    server = RunningServer(local_settings(str(tiny_qwen2_vl_dir), dtype="float32", model_name="tiny", media=FETCHES))
    yield server
    server.close()


@pytest.fixture(scope="module", params=["handoff", "recompute"])
def vl_pair(request, tiny_qwen2_vl_dir):
    for p, d, reader in pd_pair_of(dmi_settings(tiny_qwen2_vl_dir, media=FETCHES), dmi_settings(tiny_qwen2_vl_dir)):
        if request.param == "recompute":
            d.ctx.pd.preemption = ForcedPreemption(3)
        yield p, d, reader, request.param


def answer(raw: bytes, path: str, stream: bool) -> tuple[str, int | None]:
    """(generated text, prompt tokens where the body reports them)."""
    if not stream:
        body = json.loads(raw)
        if path == "/infer":
            return body["generated_text"], None
        return body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens"]
    text, usage = "", None
    for event in raw.split(b"\n\n"):
        if event.startswith(b"data: {"):
            chunk = json.loads(event[6:])
            usage = (chunk.get("usage") or {}).get("prompt_tokens", usage)
            text += "".join(c["delta"].get("content") or "" for c in chunk.get("choices", []))
    return text, usage


def test_images_through_pd_equal_one_instance(vl_pair, vl_single, image_url):
    p, d, reader, kind = vl_pair
    content = [{"type": "image_url", "image_url": {"url": image_url}}, {"type": "text", "text": "What is it?"}]
    cases = [("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": content}],
                                       "max_tokens": 7, "temperature": 0, "stream": stream,
                                       "stream_options": {"include_usage": True} if stream else None}, stream)
             for stream in (False, True)]
    parts = [{"type": "text", "text": "Name:"}, {"type": "image_url", "image_url": image_url}]
    cases.append(("/infer", {"inputs": parts, "parameters": {"do_sample": False, "max_new_tokens": 7}}, False))
    for path, body, stream in cases:
        expected = httpx.post(vl_single.url + path, json=body, timeout=60)
        assert expected.status_code == 200, expected.text
        got, went_to_d = through_pd(p, d, reader, path, body, stream)
        assert went_to_d
        assert answer(got, path, stream) == answer(expected.content, path, stream), (path, stream)
        blocks_back(p, d)
    retried = sum(r.kind is RecordKind.RETRY for r in reader.records)
    assert retried == (3 if kind == "recompute" else 0)  # each request sent back once, and recomputed on P


def test_a_video_beside_an_image_through_pd_equals_one_instance(vl_pair, vl_single, image_url, video_url):
    p, d, reader, kind = vl_pair
    before = sum(r.kind is RecordKind.RETRY for r in reader.records)
    content = [{"type": "video_url", "video_url": {"url": video_url}}, {"type": "image_url", "image_url": image_url},
               {"type": "text", "text": "Compare them."}]
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 7, "temperature": 0}
    expected = httpx.post(vl_single.url + "/v1/chat/completions", json=body, timeout=60)
    assert expected.status_code == 200, expected.text
    got, went_to_d = through_pd(p, d, reader, "/v1/chat/completions", body, False)
    assert went_to_d
    assert answer(got, "/v1/chat/completions", False) == answer(expected.content, "/v1/chat/completions", False)
    blocks_back(p, d)
    assert sum(r.kind is RecordKind.RETRY for r in reader.records) - before == (kind == "recompute")
