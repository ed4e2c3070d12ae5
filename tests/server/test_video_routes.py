"""Videos over HTTP: chat `video_url` parts on a tiny Qwen2-VL server (an allowed local path, a URL,
a data: URI, mp4 / avi / wmv), the usage that counts video tokens, the same answer as the engine
gives offline, and the refusals with their messages (another container, a file that is not a video,
the size rule, a text-only model)."""

from __future__ import annotations

import base64

import pytest
from helpers.media_server import MediaServer
from helpers.server import RunningServer, assert_responds_as_chat, local_settings
from helpers.server import chat_with_parts as chat
from helpers.server import respond_with_parts as respond
from helpers.tiny_vl import IDS, clip

from mindie.media import MediaPolicy

MP4 = clip(8, fps=4, seed=51)


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("videos")
    (d / "a.mp4").write_bytes(MP4)
    (d / "a.avi").write_bytes(clip(8, fps=4, container="avi", seed=51))
    (d / "a.wmv").write_bytes(clip(8, fps=4, container="wmv", seed=51))
    (d / "a.mkv").write_bytes(clip(8, fps=4, container="matroska", seed=51))
    (d / "not-a-video.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 64)
    return d


@pytest.fixture(scope="module")
def vl_server(tiny_qwen2_vl_dir, media_dir):
    settings = local_settings(str(tiny_qwen2_vl_dir), dtype="float32", model_name="tiny-vl",
                              media=MediaPolicy(allowed_local_path=str(media_dir), allow_private_urls=True))
    server = RunningServer(settings)
    yield server
    server.close()


def video_part(ref, openai_form: bool = True) -> dict:
    return {"type": "video_url", "video_url": {"url": ref} if openai_form else ref}


def test_chat_with_a_video_counts_its_tokens_and_answers_as_the_engine(vl_server, media_dir, tiny_qwen2_vl_dir):
    from mindie import LLM, SamplingParams

    r = chat(vl_server, [video_part(str(media_dir / "a.mp4")), {"type": "text", "text": "What happens?"}])
    assert r.status_code == 200, r.text
    body = r.json()
    ids = body["prompt_token_ids"]
    # 8 frames at 4 fps, sampled at 2 fps -> 4 frames, 2 temporal patches; 96x64 -> 84x56 pixels ->
    # 6x4 patches -> 3x2 tokens a temporal patch
    assert ids.count(IDS["<|video_pad|>"]) == 12
    assert body["usage"]["prompt_tokens"] == len(ids)
    llm = LLM(str(tiny_qwen2_vl_dir), dtype="float32")
    text = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}],
        add_generation_prompt=True)
    out = llm.generate({"prompt": text, "multi_modal_data": {"video": MP4}},
                       SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == body["choices"][0]["token_ids"]


def test_the_same_video_from_every_source_and_container_gives_the_same_answer(vl_server, media_dir):
    server = MediaServer({"a.mp4": MP4})
    try:
        sources = [(str(media_dir / "a.mp4"), True), (f"{server.url}/a.mp4", False),
                   ("data:video/mp4;base64," + base64.b64encode(MP4).decode(), True)]
        answers = [chat(vl_server, [video_part(ref, form), {"type": "text", "text": "Describe."}]).json()
                   for ref, form in sources]
    finally:
        server.close()
    assert len({a["choices"][0]["message"]["content"] for a in answers}) == 1
    assert answers[2]["usage"]["prompt_tokens_details"]["cached_tokens"] > 12  # a prefix-cache hit
    # the same pictures in other containers and codecs decode to nearly the same frames: same grid
    for name in ("a.avi", "a.wmv"):
        r = chat(vl_server, [video_part(str(media_dir / name)), {"type": "text", "text": "Describe."}])
        assert r.status_code == 200, r.text
        assert r.json()["prompt_token_ids"].count(IDS["<|video_pad|>"]) == 12


def test_refusals_name_the_part_and_the_rule(vl_server, media_dir, tiny_server):
    r = chat(vl_server, [video_part(str(media_dir / "a.mkv"))])
    assert (r.status_code, r.json()["error"]["message"]) == (400, (
        "messages[0].content[0].video_url is a matroska,webm file; the video formats read are mp4, avi and wmv"))
    r = chat(vl_server, [video_part(str(media_dir / "not-a-video.mp4"))])
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("messages[0].content[0].video_url is not a readable video")
    with open(media_dir / "huge.mp4", "wb") as f:  # sparse: judged by its size, never read
        f.truncate(513 * 2**20)
    r = chat(vl_server, [video_part(str(media_dir / "huge.mp4"))])
    assert (r.status_code, r.json()["error"]["message"]) == (400, (
        "messages[0].content[0].video_url is 513.0 MB; the limit is 512 MB for videos"))
    r = chat(vl_server, [{"type": "video_url"}])
    assert (r.status_code, r.json()["error"]["param"]) == (400, "messages[0].content[0].video_url")
    assert vl_server.ctx.engine.engine.scheduler.blocks.num_used_blocks() == 0
    r = chat(tiny_server, [video_part("/a.mp4"), {"type": "text", "text": "hi"}])
    assert (r.status_code, r.json()["error"]["message"]) == (400, (
        "messages[0].content[0].video_url: the served model tiny reads text only; it takes no video parts"))


def test_responses_take_video_parts_as_chat_does(vl_server, media_dir):
    part = video_part(str(media_dir / "a.mp4"))
    body = assert_responds_as_chat(vl_server, [part, {"type": "input_text", "text": "What happens?"}],
                                   [part, {"type": "text", "text": "What happens?"}])
    assert body["usage"]["input_tokens"] > 12  # the clip's 12 tokens and the text's
    r = respond(vl_server, [{"type": "video_url"}])
    assert (r.status_code, r.json()["error"]["param"]) == (400, "input[0].content[0].video_url")
    r = respond(vl_server, [video_part(str(media_dir / "a.mkv"))])
    assert (r.status_code, r.json()["error"]["message"]) == (400, (
        "input[0].content[0].video_url is a matroska,webm file; the video formats read are mp4, avi and wmv"))
