"""Images over HTTP on a tiny Idefics3 server (chat, /tokenize, /infer): the chat template's
<image> expanded into the tile layout, usage counting the image tokens, the same greedy answer as
transformers, text-only turns through SmolVLM's template (which reads content as parts only), and
video parts refused with a 400 naming the model."""

from __future__ import annotations

import base64
import io

import httpx
import pytest
from helpers.server import RunningServer, local_settings
from helpers.tiny_idefics3 import IDS, IMAGE_SEQ_LEN, hf_generate, hf_model, hf_processor
from helpers.tiny_vl import draw

IMAGE = draw(120, 90, 1)  # -> 96 x 72 -> 96 x 96: 3 x 3 tiles and the global image


def data_uri(image=IMAGE) -> str:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def server(tiny_idefics3_dir):
    running = RunningServer(local_settings(str(tiny_idefics3_dir), dtype="float32", model_name="tiny-idefics3"))
    yield running
    running.close()


def chat(server, messages, max_tokens: int = 6) -> httpx.Response:
    body = {"model": "tiny-idefics3", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)


def test_chat_with_an_image_equals_transformers(server, tiny_idefics3_dir):
    content = [{"type": "image_url", "image_url": {"url": data_uri()}}, {"type": "text", "text": "What is this?"}]
    r = chat(server, [{"role": "user", "content": content}])
    assert r.status_code == 200, r.text
    body = r.json()
    prompt_ids = body["prompt_token_ids"]
    assert prompt_ids.count(IDS["<image>"]) == 10 * IMAGE_SEQ_LEN
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    text = "<|im_start|>User:<image>What is this?<end_of_utterance>\nAssistant:"  # SmolVLM's template
    want_ids, want = hf_generate(hf_model(tiny_idefics3_dir), hf_processor(tiny_idefics3_dir), text, [IMAGE], 6)
    assert prompt_ids == want_ids
    assert body["choices"][0]["token_ids"] == want.tokens
    r = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": content}]}, timeout=60)
    assert r.json()["count"] == len(prompt_ids)
    r = httpx.post(f"{server.url}/infer", json={"inputs": content, "parameters": {"max_new_tokens": 6}}, timeout=60)
    assert r.status_code == 200, r.text  # /infer's parts: one user turn, the same prompt
    assert r.json()["generated_text"] == body["choices"][0]["message"]["content"]


def test_text_turns_render_through_a_parts_only_template(server):
    """SmolVLM's template iterates a message's content as parts: string content reaches it as one
    text part, as vLLM's "openai" content format gives it."""
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "image_url", "image_url": data_uri()},
                                             {"type": "text", "text": "And this?"}]}]
    r = chat(server, messages, max_tokens=1)
    assert r.status_code == 200, r.text
    prompt = server.ctx.tokenizer.decode(r.json()["prompt_token_ids"], skip_special_tokens=True)
    assert prompt.startswith("System: Be brief.\nUser:") and "And this?" in prompt
    r = chat(server, [{"role": "user", "content": "Hello there"}], max_tokens=1)
    assert server.ctx.tokenizer.decode(r.json()["prompt_token_ids"]) == "User: Hello there\nAssistant:"
    tool = {"type": "function", "function": {"name": "look", "parameters": {"type": "object", "properties": {}}}}
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": "tiny-idefics3", "messages": messages, "tools": [tool], "max_tokens": 1, "return_token_ids": True})
    assert r.status_code == 200, r.text  # the tools block joins the system text before it becomes a part
    prompt = server.ctx.tokenizer.decode(r.json()["prompt_token_ids"], skip_special_tokens=True)
    assert prompt.startswith("System: Be brief.\n\n") and '"name": "look"' in prompt


def test_continue_final_message_through_a_parts_only_template(server):
    """The final message's text reaches SmolVLM's template as a part: the prompt ends where that
    part's text ends, and the model goes on writing it. A final message that ends in an image is refused."""
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite is"}]
    whole = httpx.post(f"{server.url}/tokenize", timeout=60,
                       json={"messages": messages, "add_generation_prompt": False}).json()["tokens"]
    cut = httpx.post(f"{server.url}/tokenize", timeout=60, json={
        "messages": messages, "add_generation_prompt": False, "continue_final_message": True}).json()["tokens"]
    assert whole[: len(cut)] == cut and len(cut) < len(whole)
    assert server.ctx.tokenizer.decode(cut) == "User: Name a colour.\nAssistant: My favourite is"
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": "tiny-idefics3", "messages": messages, "max_tokens": 2, "temperature": 0, "return_token_ids": True,
        "add_generation_prompt": False, "continue_final_message": True})
    assert r.status_code == 200, r.text
    assert r.json()["prompt_token_ids"] == cut
    ends_in_image = [{"role": "user", "content": [{"type": "text", "text": "Look:"},
                                                  {"type": "image_url", "image_url": data_uri()}]}]
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": "tiny-idefics3", "messages": ends_in_image, "max_tokens": 1,
        "add_generation_prompt": False, "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content", r.text
    assert server.ctx.engine.engine.scheduler.blocks.num_used_blocks() == 0


def test_video_parts_are_refused_naming_the_model(server):
    r = chat(server, [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "/a.mp4"}}]}])
    assert (r.status_code, r.json()["error"]["message"]) == (400, (
        "messages[0].content[0].video_url: the served model tiny-idefics3 reads text and images; it takes no "
        "video parts"))
    assert server.ctx.engine.engine.scheduler.blocks.num_used_blocks() == 0
