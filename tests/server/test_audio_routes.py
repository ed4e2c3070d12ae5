"""Audio over HTTP: chat `audio_url` parts (an allowed local path, a URL, a data: URI; wav / mp3 /
flac) and OpenAI's `input_audio` parts on a tiny Qwen2-Audio server, the usage that counts audio
tokens, the same answer as the engine gives offline, and the refusals with their messages (another
format, a file that is not audio, the size rule, the 30 s window, a model that reads no audio)."""

from __future__ import annotations

import base64

import httpx
import pytest
from helpers.media_server import MediaServer
from helpers.server import RunningServer, assert_responds_as_chat, local_settings
from helpers.server import chat_with_parts as chat
from helpers.server import respond_with_parts as respond
from helpers.tiny_audio import IDS, encode, tone

from mindie.media import MediaPolicy

CLIP = tone(1.0, 480, seed=41)
WAV = encode(CLIP, "wav")


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("audio")
    (d / "a.wav").write_bytes(WAV)
    (d / "a.mp3").write_bytes(encode(CLIP, "mp3"))
    (d / "a.flac").write_bytes(encode(CLIP, "flac"))
    (d / "long.flac").write_bytes(encode(tone(31.0, 300), "flac"))
    (d / "not-audio.wav").write_bytes(b"RIFF\x00\x00\x00\x00WAVEjunk" + b"\x00" * 64)
    return d


@pytest.fixture(scope="module")
def audio_server(tiny_qwen2_audio_dir, media_dir):
    settings = local_settings(str(tiny_qwen2_audio_dir), dtype="float32", model_name="tiny-audio",
                              media=MediaPolicy(allowed_local_path=str(media_dir), allow_private_urls=True))
    server = RunningServer(settings)
    yield server
    server.close()


def audio_part(ref, openai_form: bool = True) -> dict:
    return {"type": "audio_url", "audio_url": {"url": ref} if openai_form else ref}


def input_audio(data: bytes, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def test_chat_with_audio_counts_its_tokens_and_answers_as_the_engine(audio_server, media_dir, tiny_qwen2_audio_dir):
    from mindie import LLM, SamplingParams

    r = chat(audio_server, [audio_part(str(media_dir / "a.wav")), {"type": "text", "text": "What is that sound?"}])
    assert r.status_code == 200, r.text
    body = r.json()
    ids = body["prompt_token_ids"]
    # 16000 samples -> 100 feature frames -> 50 encoder positions -> 25 tokens after the pool
    assert ids.count(IDS["<|AUDIO|>"]) == 25
    assert body["usage"]["prompt_tokens"] == len(ids)
    llm = LLM(str(tiny_qwen2_audio_dir), dtype="float32")
    text = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "What is that sound?"}]}],
        add_generation_prompt=True)
    out = llm.generate({"prompt": text, "multi_modal_data": {"audio": WAV}},
                       SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == body["choices"][0]["token_ids"]


def test_the_same_audio_from_every_source_gives_the_same_answer(audio_server, media_dir):
    server = MediaServer({"a.wav": WAV})
    try:
        parts = [audio_part(str(media_dir / "a.wav")), audio_part(f"{server.url}/a.wav", False),
                 audio_part("data:audio/wav;base64," + base64.b64encode(WAV).decode()), input_audio(WAV)]
        answers = [chat(audio_server, [part, {"type": "text", "text": "Describe."}]).json() for part in parts]
    finally:
        server.close()
    assert len({a["choices"][0]["message"]["content"] for a in answers}) == 1
    assert answers[3]["usage"]["prompt_tokens_details"]["cached_tokens"] > 25  # a prefix-cache hit
    # the same tone in other formats decodes to nearly the same samples: the same token count
    for part in (audio_part(str(media_dir / "a.flac")), input_audio((media_dir / "a.mp3").read_bytes(), "mp3")):
        r = chat(audio_server, [part, {"type": "text", "text": "Describe."}])
        assert r.status_code == 200, r.text
        assert r.json()["prompt_token_ids"].count(IDS["<|AUDIO|>"]) >= 25  # MP3 pads its frames


def test_two_clips_in_one_message(audio_server, media_dir):
    r = chat(audio_server, [audio_part(str(media_dir / "a.wav")), input_audio(encode(tone(0.5, 900), "flac"), "flac"),
                            {"type": "text", "text": "Compare."}])
    assert r.status_code == 200, r.text
    assert r.json()["prompt_token_ids"].count(IDS["<|AUDIO|>"]) == 25 + 12


def test_refusals_name_the_part_and_the_rule(audio_server, media_dir, tiny_server):
    r = chat(audio_server, [input_audio(WAV, "ogg")])
    assert (r.status_code, r.json()["error"]["message"]) == (400, (
        "messages[0].content[0].input_audio.format is 'ogg'; the audio formats read are wav, mp3, flac"))
    r = chat(audio_server, [input_audio(b"\x89PNG\r\n\x1a\n" + b"\x00" * 64, "wav")])
    assert (r.status_code, r.json()["error"]["message"]) == (400, (
        "messages[0].content[0].input_audio is a png_pipe file; the audio formats read are wav, mp3 and flac"))
    r = chat(audio_server, [audio_part(str(media_dir / "not-audio.wav"))])
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("messages[0].content[0].audio_url is not readable audio")
    r = chat(audio_server, [audio_part(str(media_dir / "long.flac"))])
    assert (r.status_code, r.json()["error"]["message"]) == (400, (
        "messages[0].content[0].audio_url is longer than 30 s, the served model's audio window; send a shorter clip"))
    with open(media_dir / "huge.wav", "wb") as f:  # sparse: judged by its size, never read
        f.truncate(21 * 2**20)
    r = chat(audio_server, [audio_part(str(media_dir / "huge.wav"))])
    assert (r.status_code, r.json()["error"]["message"]) == (400, (
        "messages[0].content[0].audio_url is 21.0 MB; the limit is 20 MB for audio clips"))
    r = chat(audio_server, [audio_part("data:video/mp4;base64,AAAA")])
    assert r.status_code == 400 and "is not one of audio/wav" in r.json()["error"]["message"]
    r = chat(audio_server, [{"type": "image_url", "image_url": "/a.png"}])
    assert (r.status_code, r.json()["error"]["message"]) == (400, (
        "messages[0].content[0].image_url: the served model tiny-audio reads text and audio; it takes no image parts"))
    assert audio_server.ctx.engine.engine.scheduler.blocks.num_used_blocks() == 0
    r = chat(tiny_server, [input_audio(WAV), {"type": "text", "text": "hi"}])
    assert (r.status_code, r.json()["error"]["message"]) == (400, (
        "messages[0].content[0].input_audio: the served model tiny reads text only; it takes no audio parts"))


def test_tokenize_counts_audio_tokens(audio_server, media_dir):
    messages = [{"role": "user", "content": [audio_part(str(media_dir / "a.wav")), {"type": "text", "text": "Hi"}]}]
    r = httpx.post(f"{audio_server.url}/tokenize", json={"model": "tiny-audio", "messages": messages}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"].count(IDS["<|AUDIO|>"]) == 25


def test_infer_reads_an_audio_part_as_the_chat_does(audio_server, media_dir):
    part = audio_part(str(media_dir / "a.wav"), False)
    want = chat(audio_server, [{"type": "text", "text": "Name:"}, part]).json()["choices"][0]["message"]["content"]
    r = httpx.post(f"{audio_server.url}/infer", json={"inputs": [{"type": "text", "text": "Name:"}, part],
                                                       "parameters": {"do_sample": False, "max_new_tokens": 6}},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["generated_text"] == want


def test_responses_take_audio_parts_as_chat_does(audio_server, media_dir, tiny_server):
    for part in (input_audio(WAV), audio_part(str(media_dir / "a.wav"))):
        body = assert_responds_as_chat(audio_server, [{"type": "input_text", "text": "What is that sound?"}, part],
                                       [{"type": "text", "text": "What is that sound?"}, part])
        assert body["usage"]["input_tokens"] > 25  # the clip's 25 tokens and the text's
    r = respond(audio_server, [{"type": "input_text", "text": "Hear:"}, input_audio(WAV, "ogg")])
    assert (r.status_code, r.json()["error"]["message"]) == (400, (
        "input[0].content[1].input_audio.format is 'ogg'; the audio formats read are wav, mp3, flac"))
    r = respond(audio_server, [{"type": "input_text", "text": "Hear:"}, {"type": "input_audio", "input_audio": {}}])
    assert (r.status_code, r.json()["error"]["param"]) == (400, "input[0].content[1].input_audio.data")
    r = respond(audio_server, [audio_part(str(media_dir / "long.flac"))])
    assert (r.status_code, r.json()["error"]["message"]) == (400, (
        "input[0].content[0].audio_url is longer than 30 s, the served model's audio window; send a shorter clip"))
    r = respond(audio_server, [{"type": "input_file", "file_data": "data:audio/wav;base64,AAAA"}])
    assert (r.status_code, r.json()["error"]["param"]) == (400, "input[0].content[0].type")
    r = respond(tiny_server, [input_audio(WAV), {"type": "input_text", "text": "hi"}])
    assert (r.status_code, r.json()["error"]["message"]) == (400, (
        "input[0].content[0].input_audio: the served model tiny reads text only; it takes no audio parts"))
    assert audio_server.ctx.engine.engine.scheduler.blocks.num_used_blocks() == 0
