"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

The input items become the chat route's messages (a `function_call` item an assistant message's
`tool_calls`, a `function_call_output` item a `tool` message), so the prompt goes through the same
chat template, tool prompting, constraint (tools.constraint) and tool-call parser as
/v1/chat/completions; only the shapes differ: output items instead of choices, typed stream events
(`event: <type>` with a `sequence_number`) instead of chunks. Finished responses are kept
(`store`, default true) in the server's bounded store (responses_store.py), so that
`previous_response_id` continues a conversation: its history (input and output, not its
instructions) comes before the new input.

What this server cannot honour is refused with a 400 naming the field, never ignored: built-in
tools, reasoning, background responses, conversations, prompt templates, image and file inputs,
logprobs. Errors carry OpenAI's body with `code` a string or null.
"""

from __future__ import annotations

import asyncio
import copy
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import AfterValidator, Field, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mindie.engine.request import EngineRequest, FinishReason, SamplingParams
from mindie.server.errors import APIError, ErrorStyle
from mindie.server.fields import INT32_MAX, Body, describe, number, validate
from mindie.server.protocols import tools as tools_support
from mindie.server.protocols.base import UNNAMED, Call, dumps
from mindie.server.protocols.messages import Tool, render_chat
from mindie.server.protocols.openai import OpenAIRenderer, check_model
from mindie.server.protocols.openai_chat import ResponseFormat
from mindie.server.protocols.responses_store import ResponseStore, store_of, stored_response
from mindie.server.responses import json_response
from mindie.server.results import Result, StreamItem
from mindie.structured.tool_parser import ContentDelta, ToolCallArguments, ToolCallParser, ToolCallStart

if TYPE_CHECKING:
    from mindie.server.serving import Serving
    from mindie.structured.grammar import Grammar

MAX_ITEMS = 4096
MAX_TOOLS = 128
NAME = r"^[A-Za-z0-9_-]{1,64}$"


class ResponsesError(APIError):
    """An APIError with the string `code` OpenAI's Responses API gives it."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(status, message, param)
        self.code = code


def _unsupported(param: str, why: str) -> ResponsesError:
    return ResponsesError(400, f"{param} is not supported: {why}", param, "unsupported_parameter")


def _unsupported_value(param: str, value: Any, why: str) -> ResponsesError:
    return ResponsesError(400, f"{param} {value!r} is not supported: {why}", param, "unsupported_value")


# --- the request body ----------------------------------------------------------------------------


def _metadata(value: dict[str, str]) -> dict[str, str]:
    """OpenAI's limits: 16 pairs, keys of up to 64 characters, values of up to 512."""
    if len(value) > 16:
        raise ValueError(f"must have at most 16 pairs, got {len(value)}")
    for k, v in value.items():
        if len(k) > 64 or len(v) > 512:
            raise ValueError(f"keys must have at most 64 characters and values 512, got {k[:70]!r}")
    return value


class FunctionTool(Body):
    """A function tool in the Responses API's flat shape (chat nests it under `function`)."""

    type: Literal["function"]
    name: Annotated[str, Field(pattern=NAME)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # absent or null: true, as OpenAI's default
    defer_loading: bool = False
    allowed_callers: list[str] | None = None
    output_schema: dict[str, Any] | None = None

    def to_chat(self) -> Tool:
        return Tool.model_validate({"type": "function", "function": {
            "name": self.name, "description": self.description, "parameters": self.parameters,
            "strict": self.strict is not False}})

    def echo(self) -> dict[str, Any]:
        return {"type": "function", "name": self.name, "description": self.description,
                "parameters": self.parameters, "strict": self.strict is not False}


class TextFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(pattern=NAME)] | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    def echo(self) -> dict[str, Any]:
        if self.type != "json_schema":
            return {"type": self.type}
        return {"type": "json_schema", "name": self.name, "schema": self.json_schema,
                "description": self.description, "strict": self.strict}


class TextConfig(Body):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class Reasoning(Body):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponseStreamOptions(Body):
    # Obfuscation pads stream events against length side channels; these events carry no padding.
    include_obfuscation: bool = True


class ResponsesRequest(Body):
    model: Annotated[str, Field(min_length=1)]
    # Items are read one by one (to_messages, _function_tools) so that a refusal names the item.
    input: str | Annotated[list[dict[str, Any]], Field(max_length=MAX_ITEMS, description=(
        "a user message, or message (role user/system/developer/assistant, content a string or input_text/"
        "output_text parts), function_call (call_id, name, arguments) and function_call_output (call_id, "
        "output) items"))]
    instructions: str | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS, description=(
        "function tools: {type: function, name, description, parameters, strict (default true)}"))] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    # A limit on calls to built-in tools; this server runs none, so any limit holds.
    max_tool_calls: number(0, INT32_MAX, integer=True) | None = None  # type: ignore[valid-type]
    text: TextConfig | None = None
    max_output_tokens: number(0, INT32_MAX, lo_open=True, integer=True) | None = None  # type: ignore[valid-type]
    temperature: number(0, 2) = 1.0  # type: ignore[valid-type]
    top_p: number(0, 1, lo_open=True) = 1.0  # type: ignore[valid-type]
    top_logprobs: number(0, 20, integer=True) | None = None  # type: ignore[valid-type]
    include: Annotated[list[str], Field(max_length=16)] | None = None
    metadata: Annotated[dict[str, str], AfterValidator(_metadata)] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # prefix caching needs no key: every prompt's blocks are cached
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    service_tier: str | None = None
    store: bool = True
    stream: bool = False
    stream_options: ResponseStreamOptions | None = None
    previous_response_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    reasoning: Reasoning | None = None
    background: bool = False
    # Refused whenever present (see _refuse).
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    moderation: Any = None
    image: Any = None
    access_programs: Any = None
    prompt_cache_options: Any = None
    background_options: Any = None

    @property
    def format(self) -> TextFormat | None:
        """The constrained output format, None for plain text."""
        fmt = self.text.format if self.text is not None else None
        return fmt if fmt is not None and fmt.type != "text" else None


_ABSENT_ONLY = {
    "conversation": "conversation objects are not kept here; continue a conversation with previous_response_id",
    "prompt": "stored prompt templates are not kept here; send the prompt as input and instructions",
    "context_management": "context compaction is not done here",
    "moderation": "moderation is not run here",
    "image": "this server does not generate images",
    "access_programs": "access programs do not apply to this server",
    "prompt_cache_options": "prefix caching here is automatic and takes no options",
    "background_options": "background responses are not run here",
}


def _refuse(req: ResponsesRequest) -> None:
    """A 400 for the first field whose value this server cannot honour."""
    for name, why in _ABSENT_ONLY.items():
        if getattr(req, name) is not None:
            raise _unsupported(name, why)
    if req.background:
        raise _unsupported("background", "responses run in the foreground; send background false")
    r = req.reasoning
    if r is not None and (r.effort not in (None, "none") or r.summary is not None or r.generate_summary is not None):
        raise _unsupported("reasoning", "the served model does not reason; send reasoning null")
    if req.truncation == "auto":
        raise _unsupported_value("truncation", "auto", "input items are never dropped; send 'disabled'")
    if req.text is not None and req.text.verbosity not in (None, "medium"):
        raise _unsupported_value("text.verbosity", req.text.verbosity, "the served model has one verbosity")
    if req.service_tier not in (None, "auto", "default"):
        raise _unsupported_value("service_tier", req.service_tier, "this server has one tier, 'default'")
    if req.prompt_cache_retention == "24h":
        raise _unsupported_value("prompt_cache_retention", "24h", "the prefix cache lives in memory")
    if req.include:
        raise _unsupported_value("include[0]", req.include[0], "no extra output data is produced here")
    if req.top_logprobs:
        raise _unsupported("top_logprobs", "log-probabilities are returned by /v1/chat/completions (logprobs)")


# --- input items -> chat messages ----------------------------------------------------------------


class _MessageItem(Body):
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict[str, Any]]


class _FunctionCallItem(Body):
    call_id: Annotated[str, Field(min_length=1, max_length=256)]
    name: Annotated[str, Field(min_length=1, max_length=256)]
    arguments: str


class _FunctionCallOutputItem(Body):
    call_id: Annotated[str, Field(min_length=1, max_length=256)]
    output: str | list[dict[str, Any]]


def _item(model: type[Body], raw: dict[str, Any], where: str) -> Any:
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        message, param = describe(exc)
        raise ResponsesError(400, f"{where}.{message}", f"{where}.{param}" if param else where) from None


def _text(content: str | list[dict[str, Any]], where: str) -> str:
    """The text of a string or a list of text parts; this server reads text only."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind in ("input_image", "input_file", "input_audio"):
            raise _unsupported_value(f"{where}[{j}].type", kind, "the served model reads text only")
        if kind not in ("input_text", "output_text") or not isinstance(part.get("text"), str):
            raise ResponsesError(400, f"{where}[{j}] must be an input_text or output_text part with a string text",
                                 f"{where}[{j}]", "invalid_value")
        texts.append(part["text"])
    return "".join(texts)


def _nonempty(text: str, where: str) -> str:
    if not text:
        raise ResponsesError(400, f"{where} must not be empty", where, "invalid_value")
    return text


def to_messages(items: list[dict[str, Any]], field_name: str = "input") -> list[dict[str, Any]]:
    """Responses items (input items, or a response's output items) as chat messages: consecutive
    function calls, and the assistant text before them, make one assistant message."""
    out: list[dict[str, Any]] = []
    for i, raw in enumerate(items):
        where = f"{field_name}[{i}]"
        kind = raw.get("type") or ("message" if "role" in raw else None)
        if kind == "message":
            m = _item(_MessageItem, raw, where)
            out.append({"role": m.role, "content": _nonempty(_text(m.content, f"{where}.content"), f"{where}.content")})
        elif kind == "function_call":
            c = _item(_FunctionCallItem, raw, where)
            call = {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            o = _item(_FunctionCallOutputItem, raw, where)
            text = _nonempty(_text(o.output, f"{where}.output"), f"{where}.output")
            out.append({"role": "tool", "tool_call_id": o.call_id, "content": text})
        elif kind == "reasoning":
            raise _unsupported_value(f"{where}.type", kind, "the served model does not reason")
        else:
            raise ResponsesError(400, f"{where}.type {kind!r} is not supported: the items taken are message, "
                                      "function_call and function_call_output", f"{where}.type", "unsupported_value")
    return out


# --- tools and the output constraint -------------------------------------------------------------


def _function_tools(raw: list[dict[str, Any]]) -> list[FunctionTool]:
    tools = []
    for i, t in enumerate(raw):
        where = f"tools[{i}]"
        if t.get("type") != "function":
            raise _unsupported_value(f"{where}.type", t.get("type"), "this server runs only function tools, which "
                                                                      "your code executes; built-in tools are not run")
        tool = _item(FunctionTool, t, where)
        if tool.defer_loading:
            raise _unsupported(f"{where}.defer_loading", "there is no tool search here")
        if tool.allowed_callers not in (None, ["direct"]):
            raise _unsupported(f"{where}.allowed_callers", "only the model calls functions here ('direct')")
        if tool.output_schema is not None:
            raise _unsupported(f"{where}.output_schema", "function outputs are passed to the model as given")
        tools.append(tool)
    return tools


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    """The chat route's tool_choice for a Responses one."""
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function":
        raise _unsupported_value("tool_choice.type", choice.get("type"), "send 'none', 'auto', 'required' or "
                                                                         '{"type": "function", "name": <a tool name>}')
    name = choice.get("name")
    if not isinstance(name, str):
        raise ResponsesError(400, "tool_choice.name is required: the name of a function in tools",
                             "tool_choice.name", "invalid_value")
    return {"type": "function", "function": {"name": name}}


def _as_responses(err: APIError) -> APIError:
    """A shared helper's error (written for the chat route) with the Responses API's field names."""
    def rename(s: str) -> str:
        return s.replace(".function.", ".").replace("response_format.json_schema.schema", "text.format.schema")

    param = "input" if err.param == "messages" else rename(err.param) if err.param else None
    return APIError(err.status, rename(err.message), param, err.headers)


def _chat_format(fmt: TextFormat | None) -> ResponseFormat | None:
    """The chat route's response_format for a Responses text.format (None: plain text)."""
    if fmt is None:
        return None
    if fmt.type == "json_object":
        return ResponseFormat.model_validate({"type": "json_object"})
    if fmt.name is None:
        raise ResponsesError(400, "text.format.name is required for a json_schema format", "text.format.name",
                             "missing_required_parameter")
    if fmt.json_schema is None:
        raise ResponsesError(400, "text.format.schema is required for a json_schema format: a JSON schema object",
                             "text.format.schema", "missing_required_parameter")
    return ResponseFormat.model_validate({"type": "json_schema",
                                          "json_schema": {"name": fmt.name, "schema": fmt.json_schema}})


# --- parse ---------------------------------------------------------------------------------------


def _history(store: ResponseStore, previous_response_id: str | None) -> list[dict[str, Any]]:
    if previous_response_id is None:
        return []
    previous = store.get(previous_response_id)
    if previous is None:
        raise ResponsesError(404, f"Previous response with id '{previous_response_id}' not found.",
                             "previous_response_id", "previous_response_not_found")
    return previous.history


def _input(req: ResponsesRequest) -> list[dict[str, Any]]:
    if isinstance(req.input, str):
        return [{"role": "user", "content": _nonempty(req.input, "input")}]
    messages = to_messages(req.input)
    if not messages:
        raise ResponsesError(400, "input must not be empty", "input", "invalid_value")
    return messages


async def _constraint(ctx: Serving, by_name: dict[str, dict[str, Any] | None], tool_choice: str | dict[str, Any],
                      fmt: ResponseFormat | None, strict: bool, max_tokens: int | None) -> Grammar | None:
    """The grammar the output must follow, as the chat route decides it, and a 400 when
    max_output_tokens is too small for any output that follows it."""
    calls = tool_choice == "required" or isinstance(tool_choice, dict)
    if not (calls or fmt is not None or (strict and tool_choice != "none")):
        return None
    grammar = await asyncio.to_thread(tools_support.constraint, ctx.grammars, by_name, tool_choice, fmt, strict)
    if grammar is not None and max_tokens is not None:
        needed = grammar.matcher().min_tokens(limit=max_tokens + 1)
        if needed is None or needed > max_tokens:
            what = "text.format" if fmt is not None and not calls else "the tool call"
            raise ResponsesError(400, f"max_output_tokens is {max_tokens}, too few for any valid output: {what} "
                                      f"needs at least {needed or 'more than ' + str(max_tokens)} tokens",
                                 "max_output_tokens", "invalid_value")
    return grammar


async def parse(ctx: Serving, body: bytes, path: Mapping[str, str]) -> tuple[Call, ResponsesRenderer]:
    req = validate(ResponsesRequest, body)
    check_model(ctx, req.model)
    _refuse(req)
    store = store_of(ctx)
    history = [*_history(store, req.previous_response_id), *_input(req)]
    tools = _function_tools(req.tools or [])
    tool_choice = _chat_tool_choice(req.tool_choice)
    chat_tools = [t.to_chat() for t in tools]
    fmt = _chat_format(req.format)
    instructions = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages = [*instructions, *history]
    greedy = req.temperature == 0
    params = SamplingParams(max_tokens=req.max_output_tokens, temperature=req.temperature,
                            top_p=1.0 if greedy else req.top_p)
    try:
        by_name = tools_support.check_tools(chat_tools, tool_choice)
        ctx.check_chars(sum(len(m["content"] or "") for m in messages), "input")
        prompt, ids = render_chat(ctx, messages, chat_tools if tool_choice != "none" and chat_tools else None)
        ids = ctx.fit_prompt(ids, "input")
        strict = any(t.strict is not False for t in tools)
        grammar = await _constraint(ctx, by_name, tool_choice, fmt, strict, params.max_tokens)
    except ResponsesError:
        raise
    except APIError as exc:
        raise _as_responses(exc) from None
    request = EngineRequest(UNNAMED, ids, params, prompt_text=prompt, grammar=grammar)
    reads_calls = bool(tools) and tool_choice != "none"
    renderer = ResponsesRenderer(req, tools, len(ids), store, history,
                                 [t.name for t in tools] if reads_calls else None)
    return Call([request], stream=req.stream), renderer


# --- output items --------------------------------------------------------------------------------


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


class OutputItems:
    """The response's output items, built from the model's text as it comes: text becomes a message
    item, each tool call a function_call item, in the order written. Every change is also returned
    as the stream events that announce it (without their sequence numbers)."""

    def __init__(self, tool_names: list[str] | None, max_calls: int | None) -> None:
        """`tool_names` None: the output is text, never scanned for calls. `max_calls`: calls past
        it are dropped (1 when parallel_tool_calls is false)."""
        self.items: list[dict[str, Any]] = []
        self.max_calls = max_calls
        self._parser = ToolCallParser(tool_names) if tool_names is not None else None
        self._open = False  # whether the last item is still being written
        self._dropped: set[int] = set()

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self._parser is None:
            return self._text(text) if text else []
        events: list[dict[str, Any]] = []
        for e in self._parser.feed(text):
            events += self._on(e)
        return events

    def finish(self, status: str) -> list[dict[str, Any]]:
        """The events that end the output: the last item closed with `status` (completed or
        incomplete); an output with nothing in it is one empty message."""
        events: list[dict[str, Any]] = []
        if self._parser is not None:
            for e in self._parser.finish():
                events += self._on(e)
        if not self.items:
            events += self._open_message()
        return events + self._close(status)

    def _on(self, e: ContentDelta | ToolCallStart | ToolCallArguments) -> list[dict[str, Any]]:
        if isinstance(e, ContentDelta):
            return self._text(e.text)
        if self.max_calls is not None and e.index >= self.max_calls:
            self._dropped.add(e.index)
            return []
        if isinstance(e, ToolCallStart):
            item = {"id": _new_id("fc"), "type": "function_call", "status": "in_progress", "call_id": e.id,
                    "name": e.name, "arguments": ""}
            return self._close("completed") + self._add(item)
        if e.index in self._dropped:
            return []
        item = self.items[-1]
        item["arguments"] += e.arguments
        return [{"type": "response.function_call_arguments.delta", "item_id": item["id"],
                 "output_index": len(self.items) - 1, "delta": e.arguments}]

    def _text(self, text: str) -> list[dict[str, Any]]:
        events = [] if self._open and self.items[-1]["type"] == "message" else \
            self._close("completed") + self._open_message()
        part = self.items[-1]["content"][0]
        part["text"] += text
        return events + [{"type": "response.output_text.delta", "item_id": self.items[-1]["id"],
                          "output_index": len(self.items) - 1, "content_index": 0, "delta": text, "logprobs": []}]

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.items.append(item)
        self._open = True
        return [{"type": "response.output_item.added", "output_index": len(self.items) - 1,
                 "item": copy.deepcopy(item)}]

    def _open_message(self) -> list[dict[str, Any]]:
        item: dict[str, Any] = {"id": _new_id("msg"), "type": "message", "status": "in_progress",
                                "role": "assistant", "content": []}
        events = self._add(item)
        part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item["content"].append(part)
        return events + [{"type": "response.content_part.added", "item_id": item["id"],
                          "output_index": len(self.items) - 1, "content_index": 0, "part": dict(part)}]

    def _close(self, status: str) -> list[dict[str, Any]]:
        if not self._open:
            return []
        self._open = False
        item, index = self.items[-1], len(self.items) - 1
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            events = [{"type": "response.output_text.done", "item_id": item["id"], "output_index": index,
                       "content_index": 0, "text": part["text"], "logprobs": []},
                      {"type": "response.content_part.done", "item_id": item["id"], "output_index": index,
                       "content_index": 0, "part": copy.deepcopy(part)}]
        else:
            events = [{"type": "response.function_call_arguments.done", "item_id": item["id"],
                       "output_index": index, "name": item["name"], "arguments": item["arguments"]}]
        return events + [{"type": "response.output_item.done", "output_index": index, "item": copy.deepcopy(item)}]


# --- the renderer --------------------------------------------------------------------------------


class ResponsesRenderer(OpenAIRenderer):
    """One response: its whole object, or its typed stream events; it stores the finished response
    when the request asked for that."""

    def __init__(self, req: ResponsesRequest, tools: list[FunctionTool], prompt_tokens: int, store: ResponseStore,
                 history: list[dict[str, Any]], tool_names: list[str] | None) -> None:
        super().__init__()
        self.req = req
        self.tools = tools
        self.prompt_tokens = prompt_tokens
        self.store = store
        self.history = history  # the conversation before this response's output
        self.id = _new_id("resp")
        self.output = OutputItems(tool_names, 1 if not req.parallel_tool_calls else None)
        self.sequence = 0

    def whole(self, results: list[Result]) -> Any:
        sample = results[0].samples[0]
        self.output.feed(sample.text)
        self.output.finish(self._status(sample.finish_reason))
        return self._finished(results, sample.finish_reason)

    def begin(self, results: list[Result]) -> list[bytes]:
        snapshot = self._object("in_progress", [], None)
        return [self._event({"type": "response.created", "response": snapshot}),
                self._event({"type": "response.in_progress", "response": snapshot})]

    def event(self, k: int, item: StreamItem, results: list[Result]) -> list[bytes]:
        out = item.output
        events = self.output.feed(out.new_text)
        if out.finish_reason is not None:
            status = self._status(out.finish_reason)
            events += self.output.finish(status)
            kind = "response.completed" if status == "completed" else "response.incomplete"
            events.append({"type": kind, "response": self._finished(results, out.finish_reason)})
        return [self._event(e) for e in events]

    def error(self, err: APIError) -> bytes:
        body = error_body(err)["error"]
        return self._event({"type": "error", "code": body["code"], "message": body["message"], "param": body["param"]})

    def _event(self, event: dict[str, Any]) -> bytes:
        event["sequence_number"] = self.sequence
        self.sequence += 1
        return f"event: {event['type']}\ndata: {dumps(event)}\n\n".encode()

    @staticmethod
    def _status(reason: FinishReason | None) -> str:
        return "incomplete" if reason is FinishReason.LENGTH else "completed"

    def _finished(self, results: list[Result], reason: FinishReason | None) -> dict[str, Any]:
        """The final response object, kept in the store when asked."""
        r = results[0]
        output_tokens = r.num_output_tokens
        # every prompt token the prefix cache did not have is computed into it
        cache = {"cached_tokens": r.num_cached_tokens, "cache_write_tokens": self.prompt_tokens - r.num_cached_tokens}
        usage = {"input_tokens": self.prompt_tokens, "input_tokens_details": cache,
                 "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": self.prompt_tokens + output_tokens}
        body = self._object(self._status(reason), copy.deepcopy(self.output.items), usage)
        if self.req.store:
            said = [i for i in self.output.items if i["type"] != "message" or i["content"][0]["text"]]
            self.store.put(self.id, stored_response(body, [*self.history, *to_messages(said, "output")]))
        return body

    def _object(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        req = self.req
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
            "background": False, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": req.max_tool_calls, "model": req.model, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": req.previous_response_id,
            "prompt_cache_key": req.prompt_cache_key, "reasoning": {"effort": None, "summary": None},
            "safety_identifier": req.safety_identifier, "service_tier": "default", "store": req.store,
            "temperature": req.temperature,
            "text": {"format": fmt.echo() if fmt is not None else {"type": "text"}, "verbosity": "medium"},
            "tool_choice": req.tool_choice, "tools": [t.echo() for t in self.tools], "top_logprobs": 0,
            "top_p": req.top_p, "truncation": "disabled", "usage": usage, "user": req.user,
            "metadata": req.metadata or {},
        }


# --- routes and errors ---------------------------------------------------------------------------

Handler = Callable[..., Awaitable[Response]]


def error_body(err: APIError) -> dict[str, Any]:
    """The OpenAI routes' error body, with a ResponsesError's own code (OpenAI's names for what the
    Responses API refuses, such as previous_response_not_found) in place of the status's."""
    body = err.for_style(ErrorStyle.OPENAI).body(ErrorStyle.OPENAI)
    code = getattr(err, "code", None)
    if code is not None:
        body["error"]["code"] = code
    return body


def _error_response(err: APIError) -> Response:
    return JSONResponse(error_body(err), status_code=err.for_style(ErrorStyle.OPENAI).status, headers=err.headers)


def with_errors(handler: Handler) -> Handler:
    """Answers the handler's refusals with their own codes (the route wrapper in app.py knows only
    the status's)."""
    async def route(ctx: Serving, request: Request, *body: bytes) -> Response:
        try:
            return await handler(ctx, request, *body)
        except APIError as exc:
            return _error_response(exc)
        except ValidationError as exc:
            message, param = describe(exc)
            return _error_response(ResponsesError(400, message, param))

    return route


def create_route(generate: Handler) -> Handler:
    """POST /v1/responses around the generic generation handler. Not on a prefill/decode node: the
    store lives in one process, and a decode node would continue a conversation it never saw."""
    async def create(ctx: Serving, request: Request, body: bytes) -> Response:
        if ctx.pd is not None:
            raise APIError(501, "/v1/responses is not served in inferMode dmi: use /v1/chat/completions")
        return await generate(ctx, request, body)

    return with_errors(create)


def _not_found(response_id: str) -> ResponsesError:
    return ResponsesError(404, f"Response with id '{response_id}' not found.", "response_id")


@with_errors
async def get_response(ctx: Serving, request: Request) -> Response:
    if request.query_params.get("stream") in ("true", "1"):
        raise _unsupported("stream", "a stored response is returned whole; background responses are not run here")
    response_id = request.path_params["response_id"]
    entry = store_of(ctx).get(response_id)
    if entry is None:
        raise _not_found(response_id)
    return json_response(entry.body)


@with_errors
async def delete_response(ctx: Serving, request: Request) -> Response:
    response_id = request.path_params["response_id"]
    if not store_of(ctx).delete(response_id):
        raise _not_found(response_id)
    return json_response({"id": response_id, "object": "response.deleted", "deleted": True})
