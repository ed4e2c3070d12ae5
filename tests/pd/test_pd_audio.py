"""Audio through prefill/decode disaggregation on a tiny Qwen2-Audio: P fetches, encodes and
prefills; D continues with the clip's token count and cache key that P hands over, and never
fetches (this D may not: it allows no loopback URL). Through a D that sends the request back for
recompute too, the answer is the single instance's."""

from __future__ import annotations

import httpx
import pytest
from helpers.media_server import MediaServer
from helpers.pd import blocks_back, dmi_settings, pd_pair_of, through_pd
from helpers.server import RunningServer, local_settings
from helpers.tiny_audio import encode, tone
from test_pd_images import FETCHES, answer

from mindie.pd.records import RecordKind
from mindie.server.dmi import ForcedPreemption


@pytest.fixture(scope="module")
def audio_url():
    server = MediaServer({"a.flac": encode(tone(1.3, 610, seed=31), "flac")})
    yield f"{server.url}/a.flac"
    server.close()


@pytest.fixture(scope="module")
def audio_single(tiny_qwen2_audio_dir):
    server = RunningServer(local_settings(str(tiny_qwen2_audio_dir), dtype="float32", model_name="tiny",
                                          media=FETCHES))
    yield server
    server.close()


@pytest.fixture(scope="module", params=["handoff", "recompute"])
def audio_pair(request, tiny_qwen2_audio_dir):
    for p, d, reader in pd_pair_of(dmi_settings(tiny_qwen2_audio_dir, media=FETCHES),
                                   dmi_settings(tiny_qwen2_audio_dir)):
        if request.param == "recompute":
            d.ctx.pd.preemption = ForcedPreemption(3)
        yield p, d, reader, request.param


@pytest.mark.parametrize("stream", [False, True])
def test_audio_through_pd_equals_one_instance(audio_pair, audio_single, audio_url, stream):
    p, d, reader, kind = audio_pair
    before = sum(r.kind is RecordKind.RETRY for r in reader.records)
    content = [{"type": "audio_url", "audio_url": {"url": audio_url}}, {"type": "text", "text": "What is it?"}]
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 7, "temperature": 0,
            "stream": stream, "stream_options": {"include_usage": True} if stream else None}
    path = "/v1/chat/completions"
    expected = httpx.post(audio_single.url + path, json=body, timeout=60)
    assert expected.status_code == 200, expected.text
    got, went_to_d = through_pd(p, d, reader, path, body, stream)
    assert went_to_d
    assert answer(got, path, stream) == answer(expected.content, path, stream)
    blocks_back(p, d)
    assert sum(r.kind is RecordKind.RETRY for r in reader.records) - before == (kind == "recompute")
