"""Qwen3's thinking on /v1/chat/completions: `enable_thinking` reaches the chat template through
chat_template_kwargs, and what the model writes between <think> and </think> comes back as
reasoning_content (delta.reasoning_content when streaming), kept out of content. The chat renderer is
driven with known text; the server end to end with the tiny random Qwen3, steered with guided_regex
so that the exact texts are known from its tokens."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from helpers.server import RunningServer, local_settings

from mindie.engine.request import FinishReason, RequestOutput, SamplingParams
from mindie.server.protocols.openai_chat import ChatRenderer, ChatRequest
from mindie.server.results import Result, SampleResult, StreamItem
from mindie.structured.reasoning_parser import ThinkTags

# (model output, whether the prompt opened a think block, the message's reasoning_content and content)
RENDERED = [
    ("<think>\nTwo and two.\n</think>\n\nFour.", False, "\nTwo and two.\n", "\n\nFour."),
    ("Four.", False, None, "Four."),
    ("Two and two.</think>Four.", True, "Two and two.", "Four."),
    ("<think>Two and", False, "Two and", None),
]


def renderer(stream: bool, opened: bool) -> ChatRenderer:
    req = ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "2+2?"}],
                                      "stream": stream})
    return ChatRenderer(req, SamplingParams(), None, [1, 2], "", False, ThinkTags(), opened)


@pytest.mark.parametrize("text,opened,reasoning,content", RENDERED)
def test_chat_message_and_deltas_from_known_text(text, opened, reasoning, content):
    result = Result("r", [SampleResult(0, text=text, finish_reason=FinishReason.STOP)])
    message = renderer(False, opened).whole([result])["choices"][0]["message"]
    want = {"role": "assistant", "content": content}
    assert message == (want if reasoning is None else {**want, "reasoning_content": reasoning})
    streaming = renderer(True, opened)
    deltas = []
    for k, start in enumerate(range(0, len(text), 3)):  # three characters a step: tags cut across steps
        final = start + 3 >= len(text)
        out = RequestOutput("r", 0, [k], text[start:start + 3], [], FinishReason.STOP if final else None,
                            2, k + 1, 0.0, 0, [1], [0.0], None)
        for event in streaming.event(k, StreamItem(out, None, None), [result]):
            deltas += [c["delta"] for c in json.loads(event[6:])["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == (reasoning or "")
    assert "".join(d.get("content", "") for d in deltas) == (content or "")
    assert all(set(d) <= {"role", "content", "reasoning_content"} for d in deltas)


# The reply is steered to end at </think>: guided decoding ends the output at Qwen3's added
# (non-special) tag tokens, so no text can be made to follow one.
ENDS_THINKING = r"[a-z]{1,8}</think>"
# A template that ends the generation prompt inside a think block (Qwen3's thinking-only models).
OPENS = "{% for m in messages %}{{ m['content'] }}{% endfor %}<|im_start|>assistant\n<think>\n"


@pytest.fixture(scope="module")
def qwen3_server(tiny_qwen3_dir):
    server = RunningServer(local_settings(str(tiny_qwen3_dir), dtype="float32", model_name="qwen3"))
    yield server
    server.close()


@pytest.fixture(scope="module")
def decode(tiny_qwen3_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_qwen3_dir / "tokenizer.json"))
    return lambda ids: tok.decode(ids, skip_special_tokens=True)


def chat(server: RunningServer, **body) -> dict:
    body = {"model": "qwen3", "messages": [{"role": "user", "content": "2+2?"}], "temperature": 0,
            "max_tokens": 40, "return_token_ids": True, **body}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def stream(server: RunningServer, **body) -> tuple[str, str]:
    """The stream's joined reasoning_content and content deltas."""
    body = {"model": "qwen3", "messages": [{"role": "user", "content": "2+2?"}], "temperature": 0,
            "max_tokens": 40, "stream": True, **body}
    reasoning, content = "", ""
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    reasoning += choice["delta"].get("reasoning_content", "")
                    content += choice["delta"].get("content", "")
    return reasoning, content


def test_thinking_off_closes_the_block_in_the_prompt_and_leaves_content_unchanged(qwen3_server, decode):
    off = chat(qwen3_server, chat_template_kwargs={"enable_thinking": False})
    assert decode(off["prompt_token_ids"]) == "user\n2+2?\nassistant\n<think>\n\n</think>\n\n"
    text = decode(off["choices"][0]["token_ids"])
    assert "<think>" not in text and text
    assert off["choices"][0]["message"] == {"role": "assistant", "content": text}
    on = chat(qwen3_server)  # Qwen3's default: the model opens its own block, the prompt does not
    assert decode(on["prompt_token_ids"]) == "user\n2+2?\nassistant\n"


def test_a_prompt_that_opens_the_block_starts_the_reply_in_reasoning(qwen3_server, decode):
    reply = chat(qwen3_server, chat_template=OPENS, guided_regex=ENDS_THINKING)
    m = re.fullmatch(r"([a-z]+)</think>", decode(reply["choices"][0]["token_ids"]))
    assert m is not None
    assert reply["choices"][0]["message"] == {"role": "assistant", "content": None, "reasoning_content": m.group(1)}
    assert stream(qwen3_server, chat_template=OPENS, guided_regex=ENDS_THINKING) == (m.group(1), "")


def test_an_end_tag_without_a_block_stays_content(qwen3_server, decode):
    reply = chat(qwen3_server, guided_regex=ENDS_THINKING)
    text = decode(reply["choices"][0]["token_ids"])
    assert text.endswith("</think>") and reply["choices"][0]["message"] == {"role": "assistant", "content": text}


def test_reasoning_parser_none_keeps_the_tags_in_content(tiny_qwen3_dir, decode):
    server = RunningServer(local_settings(str(tiny_qwen3_dir), dtype="float32", model_name="qwen3",
                                          reasoning_parser="none"))
    try:
        reply = chat(server, chat_template=OPENS, guided_regex=ENDS_THINKING)
        text = decode(reply["choices"][0]["token_ids"])
        assert text.endswith("</think>") and reply["choices"][0]["message"] == {"role": "assistant", "content": text}
        assert stream(server, chat_template=OPENS, guided_regex=ENDS_THINKING) == ("", text)
    finally:
        server.close()


def test_the_flag_picks_the_parser():
    from mindie.cli import _parser, settings_from_args

    assert settings_from_args(_parser().parse_args(["serve"])).reasoning_parser == "auto"
    for name in ("qwen3", "none"):
        assert settings_from_args(_parser().parse_args(["serve", "--reasoning-parser", name])).reasoning_parser == name
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--reasoning-parser", "deepseek_r1"])
