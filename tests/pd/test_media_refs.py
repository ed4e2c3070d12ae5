"""The body a decode node gets names media by reference (mindie/pd/media.py), and P's hold of the
client's bodies for recomputes: restored only for the body it handed over, bounded in size and age."""

from __future__ import annotations

import hashlib
import json

import pytest

from mindie.engine.request import RequestOutput
from mindie.pd.media import HeldBodies, MediaGone, redact, reference, retry_names_held_media
from mindie.pd.recompute import retry_body
from mindie.server.results import StreamItem

IMAGE = "data:image/png;base64," + "QUJD" * 50
URL = "http://127.0.0.1:9/a.mp4"
AUDIO = "UklGRg" * 40
OUTPUT = RequestOutput("7", 0, [9], "x", [], None, 2, 1, 0.0, 3, [1], [0.0], None)


def chat_body() -> bytes:
    content = [{"type": "image_url", "image_url": {"url": IMAGE, "detail": "high"}},
               {"type": "video_url", "video_url": URL},
               {"type": "input_audio", "input_audio": {"data": AUDIO, "format": "wav"}},
               {"type": "text", "text": "image_url mindie-media:image:00"}]
    return json.dumps({"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 5}).encode()


def test_redact_names_each_medium_by_the_digest_of_its_reference_and_keeps_the_rest():
    text, has_media = redact(chat_body())
    assert has_media
    assert IMAGE[30:] not in text and URL not in text and AUDIO not in text
    content = json.loads(text)["messages"][0]["content"]
    assert content == [
        {"type": "image_url", "image_url": {"url": "mindie-media:image:" + hashlib.sha256(IMAGE.encode()).hexdigest(),
                                            "detail": "high"}},
        {"type": "video_url", "video_url": "mindie-media:video:" + hashlib.sha256(URL.encode()).hexdigest()},
        {"type": "input_audio", "input_audio": {"data": reference("audio", AUDIO), "format": "wav"}},
        {"type": "text", "text": "image_url mindie-media:image:00"}]
    assert json.loads(text)["max_tokens"] == 5


def test_a_body_without_media_goes_byte_for_byte():
    body = b'{"inputs": "hi",  "parameters": {"max_new_tokens": 3}}'
    assert redact(body) == (body.decode(), False)
    parts = json.dumps({"inputs": [{"type": "text", "text": "hi"}]}).encode()
    assert redact(parts) == (parts.decode(), False)


def test_infer_parts_are_redacted_too():
    body = json.dumps({"inputs": [{"type": "text", "text": "Name:"}, {"type": "image_url", "image_url": IMAGE}]})
    text, has_media = redact(body.encode())
    assert has_media and json.loads(text)["inputs"][1]["image_url"] == reference("image", IMAGE)


def test_restore_gives_back_the_body_handed_over_and_only_that():
    held = HeldBodies()
    body = chat_body()
    held.hold("7", body)
    redacted = redact(body)[0].encode()
    assert held.restore("7", redacted) == body
    with pytest.raises(MediaGone, match="no longer holds the media of request 8"):
        held.restore("8", redacted)
    other = redact(body.replace(b"QUJD", b"QUJE"))[0].encode()
    with pytest.raises(MediaGone, match="not those of the body"):
        held.restore("7", other)
    text_only = b'{"inputs": "1,5,6,7"}'
    assert held.restore("9", text_only) == text_only  # nothing to restore: no media references
    held.drop("7")
    assert len(held) == 0 and held.size == 0


def test_hold_is_bounded_in_bytes_oldest_first_and_in_age():
    now = [0.0]
    held = HeldBodies(max_bytes=250, ttl_s=10, clock=lambda: now[0])
    for req_id in "abc":
        held.hold(req_id, b"x" * 100)
    assert len(held) == 2 and held.size == 200  # "a" went first
    with pytest.raises(MediaGone):
        held.restore("a", redact(chat_body())[0].encode())
    held.hold("big", b"x" * 251)  # larger than the whole cap: never held
    assert len(held) == 2
    now[0] = 10.0
    held.hold("d", b"x" * 10)  # "b" and "c" are past their age
    assert len(held) == 1 and held.size == 10


def test_a_retry_body_says_whether_its_client_body_names_held_media():
    def retry(client: bytes) -> bytes:
        return retry_body("/v1/chat/completions", client.decode(), [1, 2], [StreamItem(OUTPUT, None, None)], {})

    assert retry_names_held_media(retry(redact(chat_body())[0].encode()))
    assert not retry_names_held_media(retry(chat_body()))  # the client's own media: any P reads them
    assert not retry_names_held_media(retry(b'{"messages": [{"role": "user", "content": "mindie-media:image:0"}]}'))
    assert not retry_names_held_media(b"[1]") and not retry_names_held_media(b"not json")
