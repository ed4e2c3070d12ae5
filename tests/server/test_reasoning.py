"""Qwen3's thinking on /v1/chat/completions: `enable_thinking` reaches the chat template through
chat_template_kwargs, and what the model writes between <think> and </think> comes back as
reasoning_content (delta.reasoning_content when streaming), kept out of content. The chat renderer is
driven with known text; the server end to end with the tiny random Qwen3, steered with guided_regex
so that the exact texts are known from its tokens."""

from __future__ import annotations

import json
from dataclasses import dataclass

import httpx
import jsonschema
import pytest
import torch
from helpers.guided import end_tag_bias, hf_biased_greedy, hf_guided_greedy
from helpers.server import RunningServer, local_settings
from helpers.tiny_models import QWEN3_EOS

from mindie.engine.request import FinishReason, RequestOutput, SamplingParams
from mindie.server.protocols.openai_chat import ChatRenderer, ChatRequest
from mindie.server.results import Result, SampleResult, StreamItem
from mindie.structured.reasoning_parser import Phase, ThinkTags

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
    return ChatRenderer(req, SamplingParams(), None, [1, 2], "", False, ThinkTags(),
                        Phase.INSIDE if opened else Phase.BEFORE)


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


# Free replies are steered to end at </think> with guided decoding (the grammar's output holds the
# tag as text): without a reasoning parser, or where the prompt opened no block, the grammar starts
# at the first token. With the parser a grammar waits for the end of the reasoning (tests below).
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


@pytest.fixture(scope="module")
def hf(tiny_qwen3_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def think(qwen3_server) -> ThinkTags:
    assert qwen3_server.ctx.reasoning is not None and qwen3_server.ctx.reasoning.end_id is not None
    return qwen3_server.ctx.reasoning


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


def test_a_prompt_that_opens_the_block_starts_the_reply_in_reasoning(qwen3_server, decode, hf, think):
    """The reply is reasoning until </think> (a bias makes the tiny model write it after a few tokens)."""
    prompt = chat(qwen3_server, chat_template=OPENS, max_tokens=1)["prompt_token_ids"]
    bias, at = end_tag_bias(hf, prompt, think.end_id)
    reply = chat(qwen3_server, chat_template=OPENS, logit_bias={str(think.end_id): bias}, max_tokens=at + 1)
    ids = reply["choices"][0]["token_ids"]
    assert ids == hf_biased_greedy(hf, prompt, {think.end_id: bias}, at + 1) and ids[-1] == think.end_id
    assert reply["choices"][0]["message"] == {"role": "assistant", "content": None,
                                              "reasoning_content": decode(ids[:-1])}
    assert stream(qwen3_server, chat_template=OPENS, logit_bias={str(think.end_id): bias},
                  max_tokens=at + 1) == (decode(ids[:-1]), "")


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


# Guided decoding with reasoning: the grammar starts after </think>. No free strings in the schema,
# so a bias on </think> (whose text a JSON string could hold) cannot reach the answer.
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["small", "large"]}},
          "required": ["ok", "size"]}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
TOOL = {"type": "function", "function": {"name": "measure", "parameters": SCHEMA}}


@dataclass(frozen=True)
class GuidedReply:
    reply: dict
    bias: dict[str, float]  # the request's logit_bias: on </think>
    reasoning: list[int]  # transformers' free greedy tokens, </think> included
    answer: list[int]  # then its greedy tokens under the grammar, EOS included


def guided_reply(server: RunningServer, hf, think: ThinkTags, grammar, **body) -> GuidedReply:
    """A reply to `body` made to reason for a few tokens (OPENS, a bias on </think>), with the
    free reasoning and the answer transformers' greedy gives under `grammar` after it."""
    prompt = chat(server, chat_template=OPENS, max_tokens=160, **body)["prompt_token_ids"]
    bias, at = end_tag_bias(hf, prompt, think.end_id)
    reasoning = hf_biased_greedy(hf, prompt, {think.end_id: bias}, at + 1)
    assert reasoning[-1] == think.end_id
    answer = hf_guided_greedy(hf, prompt + reasoning, grammar.matcher(), {QWEN3_EOS}, {think.end_id: bias})
    logit_bias = {str(think.end_id): bias}
    reply = chat(server, chat_template=OPENS, logit_bias=logit_bias, max_tokens=160, **body)
    assert reply["prompt_token_ids"] == prompt
    return GuidedReply(reply, logit_bias, reasoning, answer)


def test_a_json_schema_applies_after_the_reasoning(qwen3_server, decode, hf, think):
    grammar = qwen3_server.ctx.grammars.json_schema(SCHEMA)
    got = guided_reply(qwen3_server, hf, think, grammar, response_format=FORMAT)
    choice = got.reply["choices"][0]
    assert choice["token_ids"] == got.reasoning + got.answer
    content = decode(got.answer)  # its EOS is special: not in the text
    jsonschema.validate(json.loads(content), SCHEMA)
    assert choice["message"] == {"role": "assistant", "content": content,
                                 "reasoning_content": decode(got.reasoning[:-1])}
    assert choice["finish_reason"] == "stop"
    assert stream(qwen3_server, chat_template=OPENS, logit_bias=got.bias, max_tokens=160,
                  response_format=FORMAT) == (decode(got.reasoning[:-1]), content)


def test_a_named_tool_call_is_made_after_the_reasoning(qwen3_server, decode, hf, think):
    grammar = qwen3_server.ctx.grammars.tool_call({"measure": SCHEMA})
    got = guided_reply(qwen3_server, hf, think, grammar, tools=[TOOL],
                       tool_choice={"type": "function", "function": {"name": "measure"}})
    choice = got.reply["choices"][0]
    assert choice["token_ids"] == got.reasoning + got.answer
    call = json.loads(decode(got.answer))
    message = choice["message"]
    assert message["reasoning_content"] == decode(got.reasoning[:-1]) and message["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("measure", call["arguments"])]
    jsonschema.validate(call["arguments"], SCHEMA)
    assert choice["finish_reason"] == "tool_calls"


def test_thinking_off_puts_the_grammar_on_the_first_token(qwen3_server, decode, hf):
    off = {"enable_thinking": False}
    prompt = chat(qwen3_server, chat_template_kwargs=off, max_tokens=1)["prompt_token_ids"]
    answer = hf_guided_greedy(hf, prompt, qwen3_server.ctx.grammars.json_schema(SCHEMA).matcher(), {QWEN3_EOS})
    reply = chat(qwen3_server, chat_template_kwargs=off, response_format=FORMAT)
    assert reply["choices"][0]["token_ids"] == answer
    assert reply["choices"][0]["message"] == {"role": "assistant", "content": decode(answer)}
    jsonschema.validate(json.loads(decode(answer)), SCHEMA)


def test_max_tokens_must_leave_room_for_the_end_tag(qwen3_server):
    needed = qwen3_server.ctx.grammars.json_schema(SCHEMA).matcher().min_tokens()
    assert needed is not None
    body = {"model": "qwen3", "messages": [{"role": "user", "content": "2+2?"}], "chat_template": OPENS,
            "response_format": FORMAT, "max_tokens": needed}
    r = httpx.post(qwen3_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and f"needs at least {needed + 1} tokens" in r.json()["error"]["message"]
    assert chat(qwen3_server, **{**body, "max_tokens": needed + 1})["choices"][0]["message"]["content"] is not None


def test_the_flag_picks_the_parser():
    from mindie.cli import _parser, settings_from_args

    assert settings_from_args(_parser().parse_args(["serve"])).reasoning_parser == "auto"
    for name in ("qwen3", "none"):
        assert settings_from_args(_parser().parse_args(["serve", "--reasoning-parser", name])).reasoning_parser == name
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--reasoning-parser", "deepseek_r1"])


def test_a_stop_string_in_the_reasoning_ends_the_reply_unanswered_as_vllm_does(qwen3_server, decode):
    """Stop strings apply to the whole output text, reasoning included, as vLLM's detokenizer applies
    them (vllm-project/vllm#52393, open: a stop string the reasoning writes ends the reply with
    content None): the reply ends at the stop, its reasoning is the text before it, it has no content."""
    free = decode(chat(qwen3_server, chat_template=OPENS, max_tokens=24)["choices"][0]["token_ids"])
    stop = free[-2:]  # the reasoning's last two characters: first written some way into it
    at = free.find(stop)
    assert "</think>" not in free and 0 < at < len(free) - 2
    reply = chat(qwen3_server, chat_template=OPENS, max_tokens=24, stop=[stop])["choices"][0]
    assert reply["finish_reason"] == "stop"
    assert reply["message"] == {"role": "assistant", "content": None, "reasoning_content": free[:at]}
    assert stream(qwen3_server, chat_template=OPENS, max_tokens=24, stop=[stop]) == (free[:at], "")
