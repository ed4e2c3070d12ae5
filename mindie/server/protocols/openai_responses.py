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
tools, reasoning, background responses, conversations, prompt templates, file inputs,
logprobs. Errors carry OpenAI's body with `code` a string or null.
"""

from __future__ import annotations

import copy
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mindie.engine.request import EngineRequest, FinishReason, SamplingParams
from mindie.server.errors import APIError, ErrorStyle
from mindie.server.fields import describe, validate
from mindie.server.http import json_response
from mindie.server.protocols import tools as tools_support
from mindie.server.protocols.base import UNNAMED, Call, dumps
from mindie.server.protocols.guided import ResponseFormat, compile_checked
from mindie.server.protocols.media import MediaRef, attach_media, check_media, media_refs
from mindie.server.protocols.messages import parse_message, render_chat
from mindie.server.protocols.openai import OpenAIRenderer, check_model
from mindie.server.protocols.responses_request import (
    FunctionTool,
    ResponsesError,
    ResponsesRequest,
    as_responses,
    chat_format,
    chat_tool_choice,
    function_tools,
    nonempty,
    refuse,
    to_messages,
    unsupported,
)
from mindie.server.protocols.responses_store import ResponseStore, store_of, stored_response
from mindie.server.results import Result, StreamItem
from mindie.structured.tool_parser import ContentDelta, ToolCallArguments, ToolCallParser, ToolCallStart

if TYPE_CHECKING:
    from mindie.server.serving import Serving
    from mindie.structured.grammar import Grammar

# --- parse ---------------------------------------------------------------------------------------


def _history(store: ResponseStore, previous_response_id: str | None) -> list[dict[str, Any]]:
    if previous_response_id is None:
        return []
    previous = store.get(previous_response_id)
    if previous is None:
        raise ResponsesError(404, f"Previous response with id '{previous_response_id}' not found.",
                             "previous_response_id", "previous_response_not_found")
    return previous.history


def _chars(content: str | list[dict[str, Any]] | None) -> str:
    """A message's text (a media part counts none)."""
    if isinstance(content, list):
        return "".join(p.get("text") or "" for p in content)
    return content or ""


def _input(req: ResponsesRequest) -> tuple[list[dict[str, Any]], list[MediaRef]]:
    """The input as chat messages, and the media parts they hold, named by their input items."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": nonempty(req.input, "input")}], []
    sources: list[int] = []
    messages = to_messages(req.input, sources=sources)
    if not messages:
        raise ResponsesError(400, "input must not be empty", "input", "invalid_value")
    refs = [ref for m, i in zip(messages, sources, strict=True) if isinstance(m["content"], list)
            for ref in media_refs(parse_message(m, i).content, f"input[{i}].content")]
    return messages, refs


async def _constraint(ctx: Serving, by_name: dict[str, dict[str, Any] | None], tool_choice: str | dict[str, Any],
                      fmt: ResponseFormat | None, strict: bool, max_tokens: int | None) -> Grammar | None:
    """The grammar the output must follow, as the chat route decides it, and a 400 when
    max_output_tokens is too small for any output that follows it."""
    if not tools_support.constrained(tool_choice, fmt, strict):
        return None
    calls = tool_choice == "required" or isinstance(tool_choice, dict)
    return await compile_checked(
        ctx, lambda: tools_support.constraint(ctx.grammars, by_name, tool_choice, fmt, strict), max_tokens,
        "text.format" if fmt is not None and not calls else "the tool call", budget_param="max_output_tokens")


async def parse(ctx: Serving, body: bytes, path: Mapping[str, str]) -> tuple[Call, ResponsesRenderer]:
    req = validate(ResponsesRequest, body)
    check_model(ctx, req.model)
    refuse(req)
    store = store_of(ctx)
    given, refs = _input(req)
    previous = _history(store, req.previous_response_id)
    # a previous response's media are read again (its blocks are still in the prefix cache)
    refs = [ref for k, m in enumerate(previous) if isinstance(m["content"], list)
            for ref in media_refs(parse_message(m, k).content, f"previous_response_id's messages[{k}].content")
            ] + refs
    history = [*previous, *given]
    tools = function_tools(req.tools or [])
    tool_choice = chat_tool_choice(req.tool_choice)
    chat_tools = [t.to_chat() for t in tools]
    fmt = chat_format(req.format)
    instructions = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages = [*instructions, *history]
    greedy = req.temperature == 0
    params = SamplingParams(max_tokens=req.max_output_tokens, temperature=req.temperature,
                            top_p=1.0 if greedy else req.top_p)
    try:
        by_name = tools_support.check_tools(chat_tools, tool_choice)
        ctx.check_chars(sum(len(_chars(m["content"])) for m in messages), "input")
        check_media(ctx, refs)
        prompt, ids = render_chat(ctx, messages, chat_tools if tool_choice != "none" and chat_tools else None)
        ids, media = await attach_media(ctx, ids, refs, "input")
        ids = ctx.fit_prompt(ids, "input")
        strict = any(t.strict is not False for t in tools)
        grammar = await _constraint(ctx, by_name, tool_choice, fmt, strict, params.max_tokens)
    except ResponsesError:
        raise
    except APIError as exc:
        raise as_responses(exc) from None
    request = EngineRequest(UNNAMED, ids, params, prompt_text=prompt, grammar=grammar, media=media)
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
        raise unsupported("stream", "a stored response is returned whole; background responses are not run here")
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
