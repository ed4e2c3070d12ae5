"""The OpenAI API: POST /v1/chat/completions, POST /v1/completions, GET /v1/models[/{m}]."""

import asyncio
import dataclasses
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from jinja2 import TemplateError
from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response

from mindie.engine.request import MAX_STOP_CHARS_TOTAL, FinishReason, TokenLogprob
from mindie.server.errors import APIError, ErrorStyle
from mindie.server.fields import INT32_MAX, Body, number, parse
from mindie.server.protocols import tools as tools_support
from mindie.server.protocols.common import OPENAI_REASONS, ContentPart, join_parts, json_response, sse, stream_response
from mindie.server.protocols.tgi import StopList
from mindie.server.protocols.vllm import SamplingFields, TokenId
from mindie.server.serving import Generation, OutputStream, Result, Serving, StreamItem, until_disconnect
from mindie.structured.tool_parser import ContentDelta, ToolCallParser, parse_tool_calls

MAX_MESSAGES = 4096
MAX_PROMPTS = 128


class FunctionCall(Body):
    name: Annotated[str, Field(max_length=256)]
    arguments: str


class ToolCall(Body):
    id: Annotated[str, Field(max_length=256)]
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: Annotated[str, Field(max_length=256)] | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=128)] | None = None
    tool_call_id: Annotated[str, Field(max_length=256)] | None = None


class FunctionDef(Body):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Body):
    type: Literal["function"]
    function: FunctionDef


class StreamOptions(Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class OpenAIFields(SamplingFields):
    model: Annotated[str, Field(min_length=1)]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_completion_tokens: number(0, INT32_MAX, lo_open=True, integer=True) | None = None  # type: ignore[valid-type]
    user: str | None = None


class ChatRequest(OpenAIFields):
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    # seed 004's ranges where it and seed 001 differ
    temperature: number(0, 2) = 1.0  # type: ignore[valid-type]
    top_p: number(0, 1, lo_open=True) = 1.0  # type: ignore[valid-type]
    top_k: number(0, INT32_MAX, integer=True, also=(-1,)) = -1  # type: ignore[valid-type]  # 0 or -1: off
    logprobs: bool = False
    top_logprobs: number(0, 20, integer=True) | None = None  # type: ignore[valid-type]
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    chat_template: Annotated[str, Field(max_length=65536)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True


Prompt = (str | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
          | Annotated[list[TokenId], Field(min_length=1)]
          | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)])


class CompletionRequest(OpenAIFields):
    prompt: Prompt  # type: ignore[valid-type]
    # seed 002: a single stop string may be as long as a whole list (a list follows seed 004)
    stop: Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS_TOTAL)] | StopList | None = None
    max_tokens: number(0, INT32_MAX, integer=True) | None = None  # type: ignore[valid-type]  # 0: with echo
    logprobs: number(0, 5, integer=True) | None = None  # type: ignore[valid-type]
    echo: bool = False
    suffix: str | None = None


def check_model(ctx: Serving, model: str) -> None:
    if model != ctx.settings.model_name:
        raise APIError(404, f"The model `{model}` does not exist; this server serves `{ctx.settings.model_name}`",
                       "model")


# --- prompts -------------------------------------------------------------------------------------


def render_chat(ctx: Serving, messages: list[Any], tools: list[Tool] | None, add_generation_prompt: bool = True,
                template: str | None = None, kwargs: dict[str, Any] | None = None) -> tuple[str, list[int]]:
    """The conversation through the model's chat template (or the request's), in Jinja's sandbox,
    as text and token ids; tools through the template when it takes them, else through the
    fallback block. What the client wrote in a message is tokenized as plain text: a
    "<|im_start|>" there is text, never a control token. Only the template's own text can be."""
    plain = []
    for i, m in enumerate(messages):
        m = m if isinstance(m, Message) else parse_message(m, i)
        if m.role == "tool" and m.tool_call_id is None:
            raise APIError(422, f"messages[{i}].tool_call_id is required for a message of role 'tool'",
                           f"messages[{i}].tool_call_id")
        if not m.content and not (m.role == "assistant" and m.tool_calls):  # seed 004: absent or empty
            raise APIError(422, f"messages[{i}].content must be a non-empty string or list of parts (it may be "
                                "absent or empty only for an assistant message with tool_calls)",
                           f"messages[{i}].content")
        d: dict[str, Any] = {"role": m.role, "content": join_parts(m.content, f"messages[{i}].content")
                             if m.content is not None else None}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        plain.append(d)
    tool_dicts = [t.model_dump(exclude_none=True) for t in tools] if tools else None
    source = template if template is not None else ctx.tokenizer.chat_template
    if not tools_support.template_takes_tools(source):
        plain, tool_dicts = tools_support.apply_fallback(plain, tool_dicts), None
    # Each message's text goes through the template as a marker, so the rendered prompt can be
    # cut into the template's text and the client's.
    nonce = secrets.token_hex(8)
    contents: list[str] = []
    for m in plain:
        if isinstance(m.get("content"), str):
            contents.append(m["content"])
            m["content"] = f"\ue000{nonce}{len(contents) - 1}\ue001"
    ctx.check_chars(sum(map(len, contents)), "messages")  # before the template renders them
    try:
        rendered = ctx.tokenizer.apply_chat_template(plain, add_generation_prompt=add_generation_prompt,
                                                     tools=tool_dicts, template=template, **(kwargs or {}))
    except (TemplateError, TypeError, ValueError, KeyError, AttributeError) as exc:
        # the template is code over the client's messages: any failure is the request's
        raise APIError(422, f"the chat template failed on these messages: {exc}", "messages") from None
    pieces = re.split(f"\ue000{nonce}(\\d+)\ue001", rendered)
    text = "".join(contents[int(p)] if k % 2 else p for k, p in enumerate(pieces))
    if not any(s in c for c in contents for s in ctx.tokenizer.special_texts):
        # nothing to defuse: the whole prompt in one pass, exactly as transformers tokenizes it
        return text, ctx.tokenizer.encode(text, add_special_tokens=False)
    ids: list[int] = []
    for k, piece in enumerate(pieces):
        if k % 2:  # a message's text
            ids += ctx.tokenizer.encode_plain(contents[int(piece)])
        elif piece:
            ids += ctx.tokenizer.encode(piece, add_special_tokens=False)
    return text, ids


def parse_message(raw: Any, i: int) -> Message:
    from pydantic import ValidationError

    try:
        return Message.model_validate(raw)
    except ValidationError as exc:
        from mindie.server.fields import describe

        msg, param = describe(exc)
        raise APIError(422, f"messages[{i}].{msg}", f"messages[{i}]") from None


def _max_tokens(req: OpenAIFields) -> int | None:
    return req.max_completion_tokens or req.max_tokens


# --- log-probabilities ---------------------------------------------------------------------------


def _piece(ctx: Serving, token_id: int) -> str:
    return ctx.tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(ctx: Serving, lps: list[TokenLogprob]) -> dict[str, Any]:
    def entry(t: int, lp: float) -> dict[str, Any]:
        piece = _piece(ctx, t)
        return {"token": piece, "logprob": lp, "bytes": list(piece.encode())}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in lps]}


def _top(ctx: Serving, lp: TokenLogprob) -> dict[str, float]:
    """The top-N entries, and the chosen token when it is not among them (seed 002: N + 1)."""
    top = {_piece(ctx, t): v for t, v in lp.top}
    if all(t != lp.token_id for t, _ in lp.top):
        top.setdefault(_piece(ctx, lp.token_id), lp.logprob)
    return top


def completion_logprobs(ctx: Serving, lps: list[TokenLogprob | None], offset: int, token_ids: list[int] | None = None
                        ) -> dict[str, Any]:
    """The legacy completions shape. With `token_ids` (echo), entries may be None: the prompt's
    first token has no log-probability."""
    ids = token_ids if token_ids is not None else [lp.token_id for lp in lps]  # type: ignore[union-attr]
    tokens, offsets = [], []
    for t in ids:
        offsets.append(offset)
        piece = _piece(ctx, t)
        tokens.append(piece)
        offset += len(piece)
    return {"tokens": tokens, "token_logprobs": [lp.logprob if lp else None for lp in lps],
            "top_logprobs": [_top(ctx, lp) if lp else None for lp in lps],
            "text_offset": offsets}


# --- running one or many engine requests ---------------------------------------------------------


def _usage(results: list[Result], prompt_tokens: int) -> dict[str, Any]:
    completion = sum(r.num_output_tokens for r in results)
    usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                             "total_tokens": prompt_tokens + completion}
    # always present: clients read it without checking (0 without a prefix-cache hit)
    usage["prompt_tokens_details"] = {"cached_tokens": sum(r.num_cached_tokens for r in results)}
    usage["batch_size"] = [b for r in results for b in r.batch_sizes]
    usage["queue_wait_time"] = [q for r in results for q in r.queue_wait_us]
    return usage


@dataclass
class _StreamUsage:
    """Where a stream's usage goes: a chunk of its own at the end (include_usage), else on the
    chunk that ends the request (MindIE); with continuous_usage_stats on every chunk as well."""

    options: StreamOptions | None
    compute: Callable[[list[Result]], dict[str, Any]]

    @property
    def include(self) -> bool:
        return bool(self.options and self.options.include_usage)

    def running(self, chunk: dict[str, Any], *results: Result) -> dict[str, Any]:
        if self.options and self.options.continuous_usage_stats:
            chunk["usage"] = self.compute(list(results))
        return chunk

    def last(self, chunk: dict[str, Any], *results: Result) -> dict[str, Any]:
        """The chunk after which the request produces nothing more."""
        if not self.include:
            chunk["usage"] = self.compute(list(results))
        return self.running(chunk, *results)


async def _merge(streams: list[OutputStream]) -> AsyncIterator[tuple[int, StreamItem]]:
    """Items of several requests as they come, tagged with the request's position."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, StreamItem | BaseException | None]] = asyncio.Queue()

    async def pump(k: int, s: OutputStream) -> None:
        try:
            async for item in s:
                queue.put_nowait((k, item))
            queue.put_nowait((k, None))
        except BaseException as exc:  # handed to the consumer, which re-raises it
            queue.put_nowait((k, exc))

    tasks = [asyncio.ensure_future(pump(k, s)) for k, s in enumerate(streams)]
    try:
        live = len(streams)
        while live:
            k, item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield k, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            await s.aclose()


class _Multi:
    """Closes several streams as one (what stream_response needs)."""

    def __init__(self, streams: list[OutputStream]) -> None:
        self.streams = streams

    async def aclose(self) -> None:
        for s in self.streams:
            await s.aclose()


async def _start_all(ctx: Serving, gens: list[Generation]) -> list[OutputStream]:
    streams: list[OutputStream] = []
    try:
        for g in gens:
            streams.append(await ctx.start(g))
    except BaseException:
        for s in streams:
            await s.aclose()
        raise
    return streams


async def _collect_all(ctx: Serving, request: Request, streams: list[OutputStream]) -> list[Result]:
    if len(streams) == 1:
        return [await ctx.collect(request, streams[0])]
    results = [Result.empty(s.gen.params) for s in streams]

    async def fold() -> list[Result]:
        async for k, item in _merge(streams):
            results[k].add(item)
        return results

    return await until_disconnect(request, fold(), _Multi(streams))


# --- chat ----------------------------------------------------------------------------------------


async def _chat_generation(ctx: Serving, req: ChatRequest) -> Generation:
    check_model(ctx, req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(422, "top_logprobs requires logprobs to be true", "top_logprobs")
    tools = tools_support.check_tools(req.tools, req.tool_choice)
    offered = req.tools if req.tool_choice != "none" else None
    prompt, ids = render_chat(ctx, req.messages, offered, req.add_generation_prompt, req.chat_template,
                              dict(req.chat_template_kwargs or {}))
    ids = ctx.fit_prompt(ids, "messages")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = req.sampling_params(ctx, logprobs=logprobs, max_tokens=_max_tokens(req), stream=req.stream)
    grammar = None
    strict = any(t.function.strict for t in req.tools or ())
    if req.tool_choice == "required" or isinstance(req.tool_choice, dict) or req.response_format is not None or (
            strict and req.tool_choice != "none"):
        grammar = await asyncio.to_thread(tools_support.constraint, ctx.grammars, tools, req.tool_choice,
                                          req.response_format, strict)
        if grammar is not None and params.max_tokens is not None:
            needed = grammar.matcher().min_tokens(limit=params.max_tokens + 1)
            if needed is None or needed > params.max_tokens:
                what = "response_format" if req.response_format is not None else "the tool call"
                raise APIError(422, f"max_tokens is {params.max_tokens}, too few for any valid output: {what} "
                                    f"needs at least {needed or 'more than ' + str(params.max_tokens)} tokens",
                               "max_tokens")
    return Generation(ids, params, stream=req.stream, prompt_text=prompt, grammar=grammar)


def _reads_calls(req: ChatRequest) -> bool:
    return bool(req.tools) and req.tool_choice != "none"


def _message(req: ChatRequest, text: str) -> tuple[dict[str, Any], bool]:
    """The assistant message for a finished sample, and whether it is a tool call."""
    if not _reads_calls(req):
        return {"role": "assistant", "content": text, "tool_calls": []}, False
    parsed = parse_tool_calls(text, [t.function.name for t in req.tools or ()])
    calls = [c.to_openai() for c in parsed.tool_calls]
    return {"role": "assistant", "content": parsed.content if parsed.content or not calls else None,
            "tool_calls": calls}, bool(calls)


async def chat(ctx: Serving, request: Request, body: bytes) -> Response:
    req = parse(ChatRequest, body)
    gen = await _chat_generation(ctx, req)
    stream = await ctx.start(gen)
    created = int(time.time())
    head = {"id": stream.request_id, "object": "chat.completion", "created": created, "model": req.model}
    if not req.stream:
        result = await ctx.collect(request, stream)
        choices = []
        for s in result.best(gen.params.n):
            message, called = _message(req, s.text)
            reason = "tool_calls" if called and s.finish_reason is not FinishReason.LENGTH else \
                OPENAI_REASONS[s.finish_reason]
            choices.append({"index": s.index, "message": message,
                            "logprobs": chat_logprobs(ctx, s.logprobs) if req.logprobs else None,
                            "finish_reason": reason})
        return json_response({**head, "choices": choices, "usage": _usage([result], len(gen.prompt_ids))})

    head["object"] = "chat.completion.chunk"
    usage = _StreamUsage(req.stream_options, lambda results: _usage(results, len(gen.prompt_ids)))
    names = [t.function.name for t in req.tools or ()]
    parsers = {i: ToolCallParser(names) for i in range(gen.params.num_outputs)} if _reads_calls(req) else {}
    called: set[int] = set()

    def deltas(index: int, text: str, final: bool) -> list[dict[str, Any]]:
        """Content and tool-call deltas for new text of sample `index`."""
        parser = parsers.get(index)
        if parser is None:
            return [{"content": text}] if text else []
        events = parser.feed(text) + (parser.finish() if final else [])
        out: list[dict[str, Any]] = []
        for e in events:
            if isinstance(e, ContentDelta):
                out.append({"content": e.text})
            else:
                called.add(index)
                out.append({"tool_calls": [e.to_openai_delta()]})
        return out

    async def events():  # type: ignore[no-untyped-def]
        # Seed 001's framing: every delta names the role, and each choice ends with a chunk whose
        # delta is {} and which carries the finish reason.
        result = Result.empty(gen.params)
        async for item in stream:
            result.add(item)
            out = item.output
            final = out.finish_reason is not None
            lps = chat_logprobs(ctx, out.new_logprobs) if req.logprobs else None
            for delta in deltas(out.index, out.new_text, final):
                chunk = {**head, "choices": [{"index": out.index, "delta": {"role": "assistant", **delta},
                                              "logprobs": lps, "finish_reason": None}]}
                lps = None  # the step's log-probabilities ride on its first chunk
                yield sse(usage.running(chunk, result))
            if final:
                reason = "tool_calls" if out.index in called and out.finish_reason is not FinishReason.LENGTH \
                    else OPENAI_REASONS[out.finish_reason]
                chunk = {**head, "choices": [{"index": out.index, "delta": {}, "logprobs": lps,
                                              "finish_reason": reason}]}
                if ctx.settings.full_text:
                    chunk["full_text"] = result.samples[out.index].text
                yield sse(usage.last(chunk, result) if out.request_done else usage.running(chunk, result))
        if usage.include:
            yield sse({**head, "choices": [], "usage": _usage([result], len(gen.prompt_ids))})
        yield b"data: [DONE]\n\n"

    return stream_response(stream, events, lambda e: sse(e.body(ErrorStyle.OPENAI)))


# --- completions ---------------------------------------------------------------------------------


def _prompts(ctx: Serving, prompt: Any) -> list[tuple[str | None, list[int]]]:
    if isinstance(prompt, str):
        return [(prompt, ctx.encode(prompt, "prompt"))]
    if prompt and isinstance(prompt[0], str):
        return [(p, ctx.encode(p, f"prompt[{i}]")) for i, p in enumerate(prompt)]
    if prompt and isinstance(prompt[0], int):
        return [(None, ctx.check_token_ids(list(prompt), "prompt"))]
    return [(None, ctx.check_token_ids(list(p), f"prompt[{i}]")) for i, p in enumerate(prompt)]


async def completions(ctx: Serving, request: Request, body: bytes) -> Response:
    req = parse(CompletionRequest, body)
    check_model(ctx, req.model)
    scoring = req.echo and req.logprobs is not None  # evaluation harnesses score text this way
    if scoring and req.stream:
        raise APIError(422, "echo with logprobs (prompt log-probabilities) is available without stream only",
                       "stream")
    if req.max_tokens == 0 and not req.echo:
        raise APIError(422, "max_tokens must be in (0, 2147483647] (0 only with echo), got 0", "max_tokens")
    if req.suffix:
        raise APIError(422, "suffix is not supported by this model", "suffix")
    # max_tokens 0 with echo: the prompt alone; one token is generated and dropped
    max_tokens = 1 if req.max_tokens == 0 else _max_tokens(req)
    params = req.sampling_params(ctx, logprobs=req.logprobs, max_tokens=max_tokens, stream=req.stream)
    if scoring:
        params = dataclasses.replace(params, prompt_logprobs=req.logprobs)
    drop_output = req.max_tokens == 0
    prompts = _prompts(ctx, req.prompt)
    if len(prompts) * params.num_samples > ctx.max_n:
        raise APIError(422, f"prompts x best_of must be at most {ctx.max_n}, got {len(prompts)} x "
                            f"{params.num_samples}", "prompt")
    gens = [Generation(ids, params, stream=req.stream, prompt_text=text) for text, ids in prompts]
    streams = await _start_all(ctx, gens)
    created = int(time.time())
    head = {"id": streams[0].request_id, "object": "text_completion", "created": created, "model": req.model}
    n = params.n
    prompt_tokens = sum(len(g.prompt_ids) for g in gens)

    def echo_text(k: int) -> str:
        text = prompts[k][0]
        return (text if text is not None else ctx.tokenizer.decode(prompts[k][1])) if req.echo else ""

    if not req.stream:
        results = await _collect_all(ctx, request, streams)
        choices = []
        for k, result in enumerate(results):
            for s in result.best(n):
                prefix = echo_text(k)
                ids, lps = ([], []) if drop_output else (s.token_ids, list(s.logprobs))
                if scoring:
                    ids, lps = prompts[k][1] + ids, (result.prompt_logprobs or [None] * len(prompts[k][1])) + lps
                choices.append({"index": k * n + s.index, "text": prefix + ("" if drop_output else s.text),
                                "logprobs": completion_logprobs(ctx, lps, 0 if scoring else len(prefix), ids)
                                if req.logprobs is not None else None,
                                "stop_reason": None, "finish_reason": OPENAI_REASONS[s.finish_reason]})
        usage = _usage(results, prompt_tokens)
        if drop_output:
            usage.update(completion_tokens=0, total_tokens=prompt_tokens, batch_size=[], queue_wait_time=[])
        return json_response({**head, "choices": choices, "usage": usage})

    usage = _StreamUsage(req.stream_options, lambda rs: _usage(rs, prompt_tokens))

    def choice(k: int, index: int, text: str, lps: list[TokenLogprob] | None, offset: int,
               reason: FinishReason | None) -> dict[str, Any]:
        """One choice of a stream chunk; `lps` None: none to report (the echoed prompt)."""
        return {"index": k * n + index, "text": text,
                "logprobs": completion_logprobs(ctx, lps, offset) if req.logprobs is not None and lps is not None
                else None,
                "stop_reason": None, "finish_reason": OPENAI_REASONS[reason] if reason else None}

    async def beam_events():  # type: ignore[no-untyped-def]
        """Seed 002's "fake stream": a beam search knows its choices only at its end, so they
        come as one event carrying every choice, then [DONE]."""
        results = await _collect_all(ctx, request, streams)
        choices = [choice(k, s.index, echo_text(k) + s.text, s.logprobs, len(echo_text(k)), s.finish_reason)
                   for k, result in enumerate(results) for s in result.best(n)]
        yield sse(usage.last({**head, "choices": choices}, *results))
        if usage.include:
            yield sse({**head, "choices": [], "usage": _usage(results, prompt_tokens)})
        yield b"data: [DONE]\n\n"

    async def events():  # type: ignore[no-untyped-def]
        results = [Result.empty(params) for _ in streams]
        offsets = {}
        if req.echo:
            for k in range(len(streams)):
                for i in range(n):
                    offsets[(k, i)] = len(echo_text(k))
                    yield sse({**head, "choices": [choice(k, i, echo_text(k), None, 0, None)]})
        done = 0
        async for k, item in _merge(streams):
            results[k].add(item)
            out = item.output
            if not out.new_text and out.finish_reason is None:
                continue
            offset = offsets.get((k, out.index), 0)
            offsets[(k, out.index)] = offset + len(out.new_text)
            chunk: dict[str, Any] = {**head, "choices": [choice(k, out.index, out.new_text, out.new_logprobs,
                                                                offset, out.finish_reason)]}
            done += out.request_done
            last = done == len(streams) and out.request_done
            yield sse(usage.last(chunk, *results) if last else usage.running(chunk, *results))
        if usage.include:
            yield sse({**head, "choices": [], "usage": _usage(results, prompt_tokens)})
        yield b"data: [DONE]\n\n"

    return stream_response(_Multi(streams), beam_events if params.use_beam_search else events,
                           lambda e: sse(e.body(ErrorStyle.OPENAI)))


# --- models --------------------------------------------------------------------------------------


def _model_card(ctx: Serving) -> dict[str, Any]:
    return {"id": ctx.settings.model_name, "object": "model", "created": ctx.created, "owned_by": "MindIE Server",
            "root": ctx.settings.model_name, "parent": None, "max_model_len": ctx.settings.engine.max_seq_len}


async def list_models(ctx: Serving, request: Request) -> Response:
    return json_response({"object": "list", "data": [_model_card(ctx)]})


async def get_model(ctx: Serving, request: Request) -> Response:
    model = request.path_params["model"]
    if model != ctx.settings.model_name:
        raise APIError(404, f"Model {model} not found.", "model")
    return json_response(_model_card(ctx))

