"""Images over HTTP: chat `content` lists and /infer `inputs` lists on a tiny Qwen2-VL server, the
usage that counts image tokens, the limits (20 media parts, one image on /infer), refusals with
their status codes and messages (text-only model, video, fetch rules), and the same image giving
the same answer from a data: URI, a URL and an allowed local path."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import re

import httpx
import pytest
from helpers.media_server import MediaServer
from helpers.server import RunningServer, assert_responds_as_chat, local_settings
from helpers.server import chat_with_parts as chat
from helpers.server import respond_with_parts as respond
from helpers.tiny_vl import draw

from mindie.media import MediaPolicy

PNG_IMAGE = draw(120, 90, 1)


def png(image=PNG_IMAGE) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


DATA_URI = "data:image/png;base64," + base64.b64encode(png()).decode()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    (d / "a.png").write_bytes(png())
    return d


@pytest.fixture(scope="module")
def vl_server(tiny_qwen2_vl_dir, media_dir):
    settings = local_settings(str(tiny_qwen2_vl_dir), dtype="float32", model_name="tiny-vl",
                              media=MediaPolicy(allowed_local_path=str(media_dir)))
    server = RunningServer(settings)
    yield server
    server.close()


@pytest.fixture(scope="module")
def media_server():
    server = MediaServer({"a.png": png()})
    yield server
    server.close()


def image_part(ref, openai_form: bool = True) -> dict:
    return {"type": "image_url", "image_url": {"url": ref} if openai_form else ref}


def test_chat_with_an_image_counts_its_tokens(vl_server):
    r = chat(vl_server, [image_part(DATA_URI), {"type": "text", "text": "What is this?"}])
    assert r.status_code == 200, r.text
    body = r.json()
    prompt_ids = body["prompt_token_ids"]
    pads = prompt_ids.count(261)  # <|image_pad|>: 120x90 -> 112x84 pixels -> 8x6 patches -> 4x3 tokens
    assert pads == 12
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    text_only = chat(vl_server, "What is this?").json()
    assert text_only["usage"]["prompt_tokens"] < len(prompt_ids) - pads + 4
    # a client's "<|image_pad|>" is text, never a placeholder
    spoof = chat(vl_server, [image_part(DATA_URI), {"type": "text", "text": "<|image_pad|><|vision_start|>"}])
    assert spoof.status_code == 200 and spoof.json()["prompt_token_ids"].count(261) == 12
    assert chat(vl_server, "<|image_pad|>").json()["prompt_token_ids"].count(261) == 0


def test_the_same_image_from_every_source_gives_the_same_answer(vl_server, media_server, media_dir):
    allowed = dataclasses.replace(vl_server.ctx.settings.media, allow_private_urls=True)
    vl_server.ctx.settings = dataclasses.replace(vl_server.ctx.settings, media=allowed)
    try:
        answers = [chat(vl_server, [image_part(ref, form), {"type": "text", "text": "Describe."}]).json()
                   for ref, form in ((DATA_URI, True), (f"{media_server.url}/a.png", False),
                                     (str(media_dir / "a.png"), True))]
    finally:
        vl_server.ctx.settings = dataclasses.replace(vl_server.ctx.settings,
                                                     media=dataclasses.replace(allowed, allow_private_urls=False))
    assert len({a["choices"][0]["message"]["content"] for a in answers}) == 1
    assert answers[2]["usage"]["prompt_tokens_details"]["cached_tokens"] > 12  # a prefix-cache hit


def test_infer_takes_one_image(vl_server):
    parts = [{"type": "text", "text": "My name is"}, {"type": "image_url", "image_url": DATA_URI}]
    r = httpx.post(f"{vl_server.url}/infer", json={"inputs": parts, "parameters": {"max_new_tokens": 4,
                                                                                   "details": True}}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["details"]["generated_tokens"] == 4
    r = httpx.post(f"{vl_server.url}/infer", json={"inputs": parts + parts[1:]}, timeout=60)
    assert r.status_code == 400
    assert r.json()["error"] == "the request has 2 media parts; the limit is 1"


def test_limits_and_refusals(vl_server):
    r = chat(vl_server, [image_part(DATA_URI)] * 21)
    assert (r.status_code, r.json()["error"]["message"]) == (400, "the request has 21 media parts; the limit is 20")
    r = chat(vl_server, [{"type": "audio_url", "audio_url": "/a.wav"}])
    assert (r.status_code, r.json()["error"]["message"]) == (400, (
        "messages[0].content[0].audio_url: the served model tiny-vl reads text, images and videos; it takes no audio "
        "parts"))
    r = chat(vl_server, [{"type": "video_url", "video_url": "/a.mp4"}])
    assert (r.status_code, r.json()["error"]["param"]) == (400, "messages[0].content[0].video_url")
    assert "'/a.mp4' is not under the allowed media directory" in r.json()["error"]["message"]
    r = chat(vl_server, [image_part("/etc/passwd")])
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("messages[0].content[0].image_url: '/etc/passwd' is not under the "
                                                   "allowed media directory")
    assert r.json()["error"]["param"] == "messages[0].content[0].image_url"
    r = chat(vl_server, [image_part("http://127.0.0.1:9/a.png")])
    assert (r.status_code, r.json()["error"]["message"]) == (400, (
        "messages[0].content[0].image_url: '127.0.0.1' resolves to 127.0.0.1, a loopback or link-local address; "
        "such URLs are refused unless the server runs with --allow-private-media-urls"))
    r = chat(vl_server, [{"type": "image_url"}])
    assert r.status_code == 400
    tall = "data:image/png;base64," + base64.b64encode(png(draw(10, 2100, 3))).decode()
    r = chat(vl_server, [image_part(tall)])
    assert (r.status_code, r.json()["error"]["message"]) == (400, (
        "messages[0].content[0].image_url: its aspect ratio must be at most 200, got 210"))
    r = httpx.post(f"{vl_server.url}/infer", json={"inputs": [{"type": "image_url", "image_url": "x.png"}]})
    assert (r.status_code, r.json()["error"]) == (400, (
        "inputs[0].image_url: 'x.png' is not under the allowed media directory "
        f"{vl_server.ctx.settings.media.allowed_local_path!r} (an absolute path is required; links are followed "
        "before the check)"))
    assert vl_server.ctx.engine.engine.scheduler.blocks.num_used_blocks() == 0


def test_text_only_model_refuses_images_naming_itself(tiny_server):
    r = chat(tiny_server, [image_part(DATA_URI), {"type": "text", "text": "hi"}])
    assert (r.status_code, r.json()["error"]["message"]) == (400, (
        "messages[0].content[0].image_url: the served model tiny reads text only; it takes no image parts"))
    r = httpx.post(f"{tiny_server.url}/infer", json={"inputs": [{"type": "image_url", "image_url": DATA_URI}]})
    assert (r.status_code, r.json()["error"]) == (400, (
        "inputs[0].image_url: the served model tiny reads text only; it takes no image parts"))


def test_tokenize_counts_image_tokens(vl_server):
    messages = [{"role": "user", "content": [image_part(DATA_URI), {"type": "text", "text": "What is this?"}]}]
    r = httpx.post(f"{vl_server.url}/tokenize", json={"messages": messages}, timeout=60)
    assert r.status_code == 200, r.text
    served = chat(vl_server, messages[0]["content"]).json()
    assert r.json()["count"] == served["usage"]["prompt_tokens"]
    assert r.json()["tokens"].count(261) == 12


def test_streamed_chat_with_an_image_equals_the_whole_answer(vl_server):
    content = [{"type": "text", "text": "Look:"}, image_part(DATA_URI)]
    whole = chat(vl_server, content).json()["choices"][0]["message"]["content"]
    body = {"model": "tiny-vl", "messages": [{"role": "user", "content": content}], "max_tokens": 6,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    text, usage = "", None
    with httpx.stream("POST", f"{vl_server.url}/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                text += "".join(c["delta"].get("content") or "" for c in chunk["choices"])
    assert text == whole
    assert usage["prompt_tokens"] > 12


def test_plain_routes_take_image_parts_as_one_user_turn(vl_server):
    """TGI's `inputs`, vLLM's `prompt` and Triton's `text_input` as part lists: the same prompt as
    /infer builds (one user turn through the chat template), so the same greedy answer."""
    parts = [{"type": "text", "text": "Name it:"}, {"type": "image_url", "image_url": DATA_URI}]
    params = {"max_new_tokens": 5, "details": True}
    native = httpx.post(f"{vl_server.url}/infer", json={"inputs": parts, "parameters": params}, timeout=60).json()
    tgi = httpx.post(f"{vl_server.url}/generate", json={"inputs": parts, "parameters": params}, timeout=60)
    assert tgi.status_code == 200, tgi.text
    assert tgi.json()["generated_text"] == native["generated_text"]
    triton = httpx.post(f"{vl_server.url}/v2/models/tiny-vl/generate",
                        json={"text_input": parts, "parameters": params}, timeout=60)
    assert triton.status_code == 200, triton.text
    assert triton.json()["text_output"] == native["generated_text"]
    vllm = httpx.post(f"{vl_server.url}/generate", json={"prompt": parts, "max_tokens": 5, "temperature": 0},
                      timeout=60)
    assert vllm.status_code == 200, vllm.text
    assert vllm.json()["text"] == ["Name it: " + native["generated_text"]]  # the text part, a space, the output
    r = httpx.post(f"{vl_server.url}/generate",
                   json={"inputs": parts, "parameters": {"max_new_tokens": 5, "truncate": 3}}, timeout=60)
    assert r.status_code == 400
    assert re.fullmatch(r"parameters\.truncate=3 would cut a prompt with images \(\d+ tokens\); images are never "
                        r"truncated", r.json()["error"]), r.json()


def test_responses_take_input_image_parts_as_chat_takes_image_url(vl_server, tiny_server):
    body = assert_responds_as_chat(vl_server, [{"type": "input_image", "image_url": DATA_URI},
                                               {"type": "input_text", "text": "What is this?"}],
                                   [image_part(DATA_URI), {"type": "text", "text": "What is this?"}])
    # the follow-up reads the image again, from the prefix cache
    again = httpx.post(f"{vl_server.url}/v1/responses", timeout=60, json={
        "model": "tiny-vl", "previous_response_id": body["id"], "input": "And its colour?", "max_output_tokens": 4})
    assert again.status_code == 200, again.text
    assert again.json()["usage"]["input_tokens"] > body["usage"]["input_tokens"]
    assert again.json()["usage"]["input_tokens_details"]["cached_tokens"] >= body["usage"]["input_tokens"] - 4
    r = respond(vl_server, [{"type": "input_image", "file_id": "file-1"}])
    assert (r.status_code, r.json()["error"]["param"]) == (400, "input[0].content[0].file_id")
    r = respond(vl_server, [{"type": "input_image"}])
    assert (r.status_code, r.json()["error"]["param"]) == (400, "input[0].content[0].image_url")
    r = respond(vl_server, [{"type": "input_image", "image_url": "/etc/passwd"}])
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(
        "input[0].content[0].image_url: '/etc/passwd' is not under the allowed media directory")
    r = respond(tiny_server, [{"type": "input_image", "image_url": DATA_URI}, {"type": "input_text", "text": "hi"}])
    assert (r.status_code, r.json()["error"]["message"]) == (400, (
        "input[0].content[0].image_url: the served model tiny reads text only; it takes no image parts"))
    assert vl_server.ctx.engine.engine.scheduler.blocks.num_used_blocks() == 0
