"""The inference routes the coordinator serves, and what it needs to know of each API family to
answer for it: its error body (MindIE's `{"error","error_type"}` or OpenAI's), and how an error is
framed as the last event of a stream, as the single instance's renderers frame it (SSE `data: `,
Triton's `data:` without the space, vLLM's JSON ended by a NUL), and where its body carries the
prompt. The coordinator reads a body only to tell vLLM's `/generate` (`prompt`) from TGI's
(`inputs`), to find a Triton client's `id`, and for `cache_affinity` to read the prompt as sent.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mindie.server.errors import APIError, ErrorStyle
from mindie.server.protocols.base import dumps, sse


@dataclass(frozen=True)
class ChatPrompt:
    head: str  # what the chat template renders before the messages: the request's tools or own template
    messages: tuple[str, ...]  # each message as canonical JSON, in order


@dataclass(frozen=True)
class TextPrompt:
    text: str


@dataclass(frozen=True)
class TokenPrompt:
    ids: tuple[int, ...]


Prompt = ChatPrompt | TextPrompt | TokenPrompt


@dataclass(frozen=True)
class Family:
    name: str
    style: ErrorStyle
    frame: Callable[[dict[str, Any]], bytes]  # one stream event carrying an error body
    read_prompt: Callable[[dict[str, Any]], Prompt | None]  # the prompt in a parsed body

    def prompt(self, body: bytes) -> Prompt | None:
        """The request's prompt as its body carries it (the first prompt of an OpenAI batch); None
        when there is none to read: the instance will refuse such a body anyway."""
        parsed = _json_object(body)
        return self.read_prompt(parsed) if parsed is not None else None

    def error_body(self, err: APIError) -> dict[str, Any]:
        return err.for_style(self.style).body(self.style)

    def error_event(self, err: APIError) -> bytes:
        return self.frame(self.error_body(err))


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _plain(value: Any) -> Prompt | None:
    """A text (a string, or text content parts joined as the instance joins them) or token ids."""
    if isinstance(value, str):
        return TextPrompt(value)
    if not isinstance(value, list) or not value:
        return None
    if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return TokenPrompt(tuple(value))
    if all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in value):
        return TextPrompt("".join(p["text"] for p in value))
    return None


def _chat(body: dict[str, Any]) -> Prompt | None:
    messages = body["messages"]
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        return None
    head = {k: body[k] for k in ("tools", "chat_template", "chat_template_kwargs") if body.get(k) is not None}
    return ChatPrompt(_canonical(head), tuple(_canonical(m) for m in messages))


def _openai(body: dict[str, Any]) -> Prompt | None:
    if "messages" in body:
        return _chat(body)
    prompt = body.get("prompt")
    batch = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
    return _plain(prompt[0] if batch else prompt)


def _triton(body: dict[str, Any]) -> Prompt | None:
    if "text_input" in body:
        return _plain(body["text_input"])
    inputs = body.get("inputs")
    tensor = inputs[0] if isinstance(inputs, list) and inputs else None
    return _plain(tensor.get("data")) if isinstance(tensor, dict) else None


NATIVE = Family("native", ErrorStyle.MINDIE, sse,
                lambda body: _plain(body["inputs"] if "inputs" in body else body.get("input_id")))
TGI = Family("tgi", ErrorStyle.MINDIE, sse, lambda body: _plain(body.get("inputs")))
VLLM = Family("vllm", ErrorStyle.MINDIE, lambda body: (dumps(body) + "\0").encode(),
              lambda body: _plain(body.get("prompt")))
OPENAI = Family("openai", ErrorStyle.OPENAI, sse, _openai)
TRITON = Family("triton", ErrorStyle.MINDIE, lambda body: sse(body, space=False), _triton)

# The 11 inference routes of MindIE's coordinator (Coordinator.cpp, InitRequestListener), in the
# order they are matched; `None` for /generate, whose family the body decides.
INFERENCE_ROUTES: list[tuple[str, Family | None]] = [
    ("/infer", NATIVE), ("/infer_token", NATIVE), ("/generate", None), ("/generate_stream", TGI), ("/", TGI),
    ("/v1/chat/completions", OPENAI), ("/v1/completions", OPENAI), ("/v2/models/{model}/generate", TRITON),
    ("/v2/models/{model}/generate_stream", TRITON), ("/v2/models/{model}/infer", TRITON),
]


def _json_object(body: bytes) -> dict[str, Any] | None:
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return parsed if isinstance(parsed, dict) else None


def family_of(route: Family | None, body: bytes) -> Family:
    if route is not None:
        return route
    parsed = _json_object(body)
    return VLLM if parsed is not None and "prompt" in parsed else TGI


def triton_id(family: Family, body: bytes) -> str | None:
    """A Triton client's own request id: MindIE's D names that request's records by it."""
    if family is not TRITON:
        return None
    parsed = _json_object(body)
    value = parsed.get("id") if parsed is not None else None
    return value if isinstance(value, str) and value else None
