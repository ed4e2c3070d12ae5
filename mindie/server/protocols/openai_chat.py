"""OpenAI's POST /v1/chat/completions: messages through the chat template, tool calls and
structured output, and the chat shapes (choices with a message, or chunks with deltas)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field

from mindie.engine.request import EngineRequest, FinishReason, SamplingParams
from mindie.server.errors import APIError
from mindie.server.fields import INT32_MAX, number, validate
from mindie.server.protocols import tools as tools_support
from mindie.server.protocols.base import OPENAI_REASONS, UNNAMED, Call, Renderer, sse
from mindie.server.protocols.guided import ResponseFormat, compile_checked, compile_guided, one_of
from mindie.server.protocols.media import attach_media, chat_media_refs, check_media
from mindie.server.protocols.messages import Message, Tool, render_chat
from mindie.server.protocols.openai import (
    OpenAIFields,
    OpenAIRenderer,
    StreamUsage,
    chat_logprobs,
    check_model,
    usage,
    vllm_prompt_logprobs,
)
from mindie.server.results import Result, StreamItem
from mindie.structured.reasoning_gate import ReasoningGate
from mindie.structured.reasoning_parser import Phase, ReasoningSplitter, ThinkTags, split_reasoning
from mindie.structured.tool_parser import ContentDelta, ToolCallParser, parse_tool_calls

if TYPE_CHECKING:
    from mindie.server.serving import Serving
    from mindie.tokenizer import Tokenizer

MAX_MESSAGES = 4096


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
    # vLLM's: go on writing the final message, and (echo) start the reply with that message's text
    continue_final_message: bool = False
    echo: bool = False

    @property
    def reads_calls(self) -> bool:
        """Whether the output is scanned for tool calls."""
        return bool(self.tools) and self.tool_choice != "none"


async def parse(ctx: Serving, body: bytes, path: Mapping[str, str]) -> tuple[Call, Renderer]:
    req = validate(ChatRequest, body)
    check_model(ctx, req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(422, "top_logprobs requires logprobs to be true", "top_logprobs")
    tools = tools_support.check_tools(req.tools, req.tool_choice)
    offered = req.tools if req.tool_choice != "none" else None
    if req.continue_final_message and req.add_generation_prompt:
        raise APIError(422, "continue_final_message and add_generation_prompt cannot both be true: set "
                            "add_generation_prompt to false to continue the final message", "continue_final_message")
    refs = chat_media_refs(req.messages)
    check_media(ctx, refs)
    prompt, ids = render_chat(ctx, req.messages, offered, req.add_generation_prompt, req.chat_template,
                              dict(req.chat_template_kwargs or {}), continue_final=req.continue_final_message)
    ids, media = await attach_media(ctx, ids, refs, "messages")
    ids = ctx.fit_prompt(ids, "messages")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = req.with_prompt_logprobs(req.sampling_params(ctx, logprobs=logprobs, max_tokens=req.output_limit,
                                                          stream=req.stream))
    strict = any(t.function.strict for t in req.tools or ())
    formatted = req.response_format is not None and req.response_format.type != "text"
    guided = one_of(req.guided())
    # A reasoning model thinks freely first: its grammar starts after the think block.
    gate = ReasoningGate.for_prompt(ctx.reasoning, prompt) if ctx.reasoning is not None else None
    if tools_support.constrained(req.tool_choice, req.response_format, strict):
        if guided is not None:
            raise APIError(422, f"{guided.param} cannot be combined with response_format, a required or named "
                                "tool_choice, or strict tools: they constrain the same output", guided.param)
        grammar = await compile_checked(
            ctx, lambda: tools_support.constraint(ctx.grammars, tools, req.tool_choice, req.response_format, strict),
            params.max_tokens, "response_format" if formatted else "the tool call", gate=gate)
    else:
        grammar = await compile_guided(ctx, guided, params.max_tokens, gate)
    request = EngineRequest(UNNAMED, ids, params, prompt_text=prompt, grammar=grammar, media=media)
    final = req.messages[-1]
    echoed = final.content if req.echo and final.role == "assistant" and isinstance(final.content, str) else ""
    if gate is not None and grammar is not None:  # split as the gate let the grammar see the reply
        phase, opens_late = gate.phase, False
    else:  # a free reply: text is content until the model writes <think>, wherever that is
        thinking = ctx.reasoning is not None and ctx.reasoning.opened_by(prompt)
        phase, opens_late = (Phase.INSIDE if thinking else Phase.BEFORE), True
    return Call([request], stream=req.stream), ChatRenderer(req, params, ctx.tokenizer, ids, echoed,
                                                            ctx.settings.full_text, ctx.reasoning, phase, opens_late)


class ChatRenderer(OpenAIRenderer):
    def __init__(self, req: ChatRequest, params: SamplingParams, tokenizer: Tokenizer, prompt_ids: list[int],
                 echoed: str, full_text: bool, reasoning: ThinkTags | None, phase: Phase = Phase.BEFORE,
                 opens_late: bool = True) -> None:
        super().__init__()
        self.req = req
        self.n = params.n
        self.tokenizer = tokenizer
        self.prompt_ids = prompt_ids
        self.echoed = echoed  # the final message's text, which the reply starts with (echo)
        self.full_text = full_text
        self.usage = StreamUsage(req.stream_options, len(prompt_ids))
        self.names = [t.function.name for t in req.tools or ()]
        # per sample, when streaming: the parser that finds tool calls in its deltas, and whether
        # it found one (the finish reason is then tool_calls)
        streams_calls = req.stream and req.reads_calls
        self.parsers = {i: ToolCallParser(self.names) for i in range(params.num_outputs)} if streams_calls else {}
        self.called: set[int] = set()
        # The model's think tags (None: replies are not split), where the reply starts relative to a
        # think block and whether one may open after content began; when streaming, each sample's splitter.
        self.reasoning, self.phase, self.opens_late = reasoning, phase, opens_late
        self.splitters = ({i: ReasoningSplitter(reasoning, phase, opens_late) for i in range(params.num_outputs)}
                          if req.stream and reasoning is not None else {})

    def _head(self, results: list[Result], kind: str) -> dict[str, Any]:
        return {"id": results[0].request_id, "object": kind, "created": self.created, "model": self.req.model}

    def whole(self, results: list[Result]) -> Any:
        choices = []
        for s in results[0].best(self.n):
            message, called = self._message(s.text)
            reason = "tool_calls" if called and s.finish_reason is not FinishReason.LENGTH else \
                OPENAI_REASONS[s.finish_reason]
            choice = {"index": s.index, "message": message,
                      "logprobs": chat_logprobs(self.tokenizer, s.logprobs) if self.req.logprobs else None,
                      "finish_reason": reason}
            if self.req.return_token_ids:
                choice["token_ids"] = s.token_ids
            choices.append(choice)
        body = {**self._head(results, "chat.completion"), "choices": choices,
                "usage": usage(results, self.usage.prompt_tokens)}
        return self._with_prompt_extras(body, results)

    def _with_prompt_extras(self, body: dict[str, Any], results: list[Result]) -> dict[str, Any]:
        """vLLM's top-level prompt_token_ids and prompt_logprobs, when asked for."""
        if self.req.return_token_ids:
            body["prompt_token_ids"] = self.prompt_ids
        if self.req.prompt_logprobs is not None:
            body["prompt_logprobs"] = vllm_prompt_logprobs(self.tokenizer, self.prompt_ids, results[0].prompt_logprobs)
        return body

    def begin(self, results: list[Result]) -> list[bytes]:
        """With echo, each choice's first chunk is the final message's text; with
        return_token_ids, a chunk carries the prompt's ids before any output."""
        head = self._head(results, "chat.completion.chunk")
        events = []
        if self.req.return_token_ids:
            events.append(sse({**head, "choices": [], "prompt_token_ids": self.prompt_ids}))
        if self.echoed:
            for index in range(self.n):
                for delta in self._answer_deltas(index, self.echoed, False):
                    events.append(sse({**head, "choices": [{"index": index, "delta": {"role": "assistant", **delta},
                                                            "logprobs": None, "finish_reason": None}]}))
        return events

    def _message(self, text: str) -> tuple[dict[str, Any], bool]:
        """The assistant message for a finished sample (after the echoed text), and whether it is a
        tool call."""
        reasoning, content = None, text
        if self.reasoning is not None:
            reasoning, content = split_reasoning(self.reasoning, text, self.phase, self.opens_late)
        message, called = self._answer(self.echoed + (content or ""))
        if reasoning is not None:
            message["content"] = message["content"] or None  # as vLLM: nothing after the reasoning is null
            message["reasoning_content"] = reasoning
        return message, called

    def _answer(self, text: str) -> tuple[dict[str, Any], bool]:
        if not self.req.reads_calls:
            return {"role": "assistant", "content": text}, False
        parsed = parse_tool_calls(text, self.names)
        calls = [c.to_openai() for c in parsed.tool_calls]
        if not calls:  # omitted, not []: OpenAI leaves the field out when nothing was called
            return {"role": "assistant", "content": parsed.content}, False
        return {"role": "assistant", "content": parsed.content or None, "tool_calls": calls}, True

    def event(self, k: int, item: StreamItem, results: list[Result]) -> list[bytes]:
        # Seed 001's framing: every delta names the role, and each choice ends with a chunk whose
        # delta is {} and which carries the finish reason.
        head = self._head(results, "chat.completion.chunk")
        out = item.output
        final = out.finish_reason is not None
        lps = chat_logprobs(self.tokenizer, out.new_logprobs) if self.req.logprobs else None
        # the step's log-probabilities and token ids ride on its first chunk
        extras: dict[str, Any] = {"token_ids": out.new_token_ids} if self.req.return_token_ids else {}
        events = []
        deltas = self._deltas(out.index, out.new_text, final)
        if not deltas and not final and (lps or extras):  # tokens with no text yet: still reported
            deltas = [{"content": ""}]
        for delta in deltas:
            chunk = {**head, "choices": [{"index": out.index, "delta": {"role": "assistant", **delta},
                                          "logprobs": lps, "finish_reason": None, **extras}]}
            lps, extras = None, {}
            events.append(sse(self.usage.running(chunk, results)))
        if final:
            reason = "tool_calls" if out.index in self.called and out.finish_reason is not FinishReason.LENGTH \
                else OPENAI_REASONS[out.finish_reason]
            chunk = {**head, "choices": [{"index": out.index, "delta": {}, "logprobs": lps, "finish_reason": reason,
                                          **extras}]}
            if self.full_text:
                chunk["full_text"] = results[0].samples[out.index].text
            events.append(sse(self.usage.running(chunk, results)))
        return events

    def _deltas(self, index: int, text: str, final: bool) -> list[dict[str, Any]]:
        """Reasoning, content and tool-call deltas for new text of sample `index`."""
        splitter = self.splitters.get(index)
        if splitter is None:
            return self._answer_deltas(index, text, final)
        out: list[dict[str, Any]] = []
        for piece in splitter.feed(text) + (splitter.finish() if final else []):
            out += [{"reasoning_content": piece.text}] if piece.reasoning else self._answer_deltas(index, piece.text,
                                                                                                False)
        return out + (self._answer_deltas(index, "", True) if final else [])

    def _answer_deltas(self, index: int, text: str, final: bool) -> list[dict[str, Any]]:
        """Content and tool-call deltas for new answer text of sample `index`."""
        parser = self.parsers.get(index)
        if parser is None:
            return [{"content": text}] if text else []
        events = parser.feed(text) + (parser.finish() if final else [])
        out: list[dict[str, Any]] = []
        for e in events:
            if isinstance(e, ContentDelta):
                out.append({"content": e.text})
            else:
                self.called.add(index)
                out.append({"tool_calls": [e.to_openai_delta()]})
        return out

    def end(self, results: list[Result]) -> list[bytes]:
        return self.usage.chunks(self._head(results, "chat.completion.chunk"), results)
