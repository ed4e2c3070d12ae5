"""No media bytes reach a decode node: the body P hands over names each image and audio clip by
`mindie-media:<kind>:<digest>` (mindie/pd/media.py), and the answer is still the single instance's,
through a D that sends the request back for recompute too (P reads the media again from the body
it holds). A recompute whose media P no longer holds is a 410 naming is-recompute, and what P
holds goes when D says the request ended."""

from __future__ import annotations

import base64
import io
import json
import time

import httpx
import pytest
from helpers.media_server import MediaServer
from helpers.pd import blocks_back, dmi_settings, next_req_id, pd_headers, pd_pair_of, through_pd
from helpers.server import RunningServer, local_settings
from helpers.tiny_audio import encode, tone
from helpers.tiny_vl import draw
from test_pd_images import FETCHES, answer

import mindie.server.decode as decode_module
from mindie.pd.media import HeldBodies, reference
from mindie.pd.params import DecodeParams
from mindie.pd.records import RecordKind
from mindie.server.dmi import ForcedPreemption


def png(seed: int) -> bytes:
    buf = io.BytesIO()
    draw(100, 70, seed).save(buf, "PNG")
    return buf.getvalue()


IMAGE = base64.b64encode(png(41)).decode()
IMAGE_URI = "data:image/png;base64," + IMAGE
FLAC = base64.b64encode(encode(tone(0.9, 520, seed=42), "flac")).decode()
WAV = base64.b64encode(encode(tone(0.7, 830, seed=43), "wav")).decode()


@pytest.fixture
def d_bodies(monkeypatch) -> list[str]:
    """Every `/pd/v1/decode` body D's handler gets, as JSON text."""
    seen: list[str] = []

    class Recording(DecodeParams):
        @classmethod
        def from_json(cls, raw):
            seen.append(json.dumps(raw))
            return DecodeParams.from_json(raw)

    monkeypatch.setattr(decode_module, "DecodeParams", Recording)
    return seen


@pytest.fixture(scope="module")
def url_image():
    server = MediaServer({"b.png": png(44)})
    yield f"{server.url}/b.png"
    server.close()


def pair(model_dir, param):
    p_settings = dmi_settings(model_dir, media=FETCHES, media_hold_bytes=64 * 2**20, media_hold_s=600)
    for p, d, reader in pd_pair_of(p_settings, dmi_settings(model_dir)):
        assert (p.ctx.pd.held_media.max_bytes, p.ctx.pd.held_media.ttl_s) == (64 * 2**20, 600)
        if param == "recompute":
            d.ctx.pd.preemption = ForcedPreemption(3)
        yield p, d, reader, param


@pytest.fixture(scope="module", params=["handoff", "recompute"])
def vl_pair(request, tiny_qwen2_vl_dir):
    yield from pair(tiny_qwen2_vl_dir, request.param)


@pytest.fixture(scope="module", params=["handoff", "recompute"])
def audio_pair(request, tiny_qwen2_audio_dir):
    yield from pair(tiny_qwen2_audio_dir, request.param)


def single(model_dir):
    server = RunningServer(local_settings(str(model_dir), dtype="float32", model_name="tiny", media=FETCHES))
    yield server
    server.close()


@pytest.fixture(scope="module")
def vl_single(tiny_qwen2_vl_dir):
    yield from single(tiny_qwen2_vl_dir)


@pytest.fixture(scope="module")
def audio_single(tiny_qwen2_audio_dir):
    yield from single(tiny_qwen2_audio_dir)


def nothing_held(p: RunningServer, timeout: float = 5) -> bool:
    """Whether P's hold empties (D tells P once each request ended)."""
    end = time.monotonic() + timeout
    while len(p.ctx.pd.held_media) and time.monotonic() < end:
        time.sleep(0.02)
    return len(p.ctx.pd.held_media) == 0


def check_same_as_single(pd, one, d_bodies, path, body, stream, payloads, refs):
    p, d, reader, kind = pd
    retries = sum(r.kind is RecordKind.RETRY for r in reader.records)
    expected = httpx.post(one.url + path, json=body, timeout=60)
    assert expected.status_code == 200, expected.text
    got, went_to_d = through_pd(p, d, reader, path, body, stream)
    assert went_to_d
    assert answer(got, path, stream) == answer(expected.content, path, stream)
    assert sum(r.kind is RecordKind.RETRY for r in reader.records) - retries == (kind == "recompute")
    assert len(d_bodies) == (2 if kind == "recompute" else 1)  # a recompute is handed to D again
    for seen in d_bodies:
        for payload in payloads:
            third = len(payload) // 3  # any stretch of it: a payload re-encoded whole would hold this too
            assert payload not in seen and payload[third : third + 40] not in seen
        for ref in refs:
            assert ref in seen
    blocks_back(p, d)
    assert nothing_held(p)


@pytest.mark.parametrize("path,stream", [("/v1/chat/completions", False), ("/v1/chat/completions", True),
                                         ("/infer", False)])
def test_images_reach_d_as_references_only(vl_pair, vl_single, url_image, d_bodies, path, stream):
    if path == "/infer":
        body = {"inputs": [{"type": "text", "text": "Name:"}, {"type": "image_url", "image_url": IMAGE_URI}],
                "parameters": {"do_sample": False, "max_new_tokens": 7}}
        payloads, refs = [IMAGE], [reference("image", IMAGE_URI)]
    else:
        content = [{"type": "image_url", "image_url": {"url": IMAGE_URI}},
                   {"type": "image_url", "image_url": url_image}, {"type": "text", "text": "Compare them."}]
        body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 7,
                "temperature": 0, "stream": stream, "stream_options": {"include_usage": True} if stream else None}
        payloads, refs = [IMAGE, url_image], [reference("image", IMAGE_URI), reference("image", url_image)]
    check_same_as_single(vl_pair, vl_single, d_bodies, path, body, stream, payloads, refs)


def test_audio_reaches_d_as_references_only(audio_pair, audio_single, d_bodies):
    flac_uri = "data:audio/flac;base64," + FLAC
    content = [{"type": "audio_url", "audio_url": {"url": flac_uri}},
               {"type": "input_audio", "input_audio": {"data": WAV, "format": "wav"}},
               {"type": "text", "text": "What are they?"}]
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 7, "temperature": 0}
    check_same_as_single(audio_pair, audio_single, d_bodies, "/v1/chat/completions", body, False, [FLAC, WAV],
                         [reference("audio", flac_uri), reference("audio", WAV)])


def test_a_recompute_whose_media_p_dropped_is_a_410_naming_why(vl_pair):
    p, d, reader, kind = vl_pair
    if kind != "recompute":
        pytest.skip("needs a decode node that sends the request back")
    node = p.ctx.pd
    kept, node.held_media = node.held_media, HeldBodies(max_bytes=10)  # the body is past the size cap
    try:
        req_id = next_req_id()
        content = [{"type": "image_url", "image_url": IMAGE_URI}, {"type": "text", "text": "What is it?"}]
        body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 7,
                "temperature": 0}
        headers = {**pd_headers(req_id, d), "content-type": "application/json"}
        first = httpx.post(p.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
        assert first.status_code == 200, first.text
        retry = reader.until(req_id)[-1]
        assert retry.kind is RecordKind.RETRY
        refused = httpx.post(p.url + "/v1/chat/completions", content=retry.body,
                             headers={**headers, "is-recompute": "true"}, timeout=60)
        assert refused.status_code == 410, refused.text
        error = refused.json()["error"]
        assert error["param"] == "is-recompute"
        assert f"no longer holds the media of request {req_id}" in error["message"]
        blocks_back(p, d)
    finally:
        node.held_media = kept
