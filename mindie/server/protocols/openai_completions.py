"""OpenAI's POST /v1/completions: one engine request per prompt, echo and prompt scoring, best_of,
and beam search's single-event "fake stream"."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import Field

from mindie.engine.request import MAX_STOP_CHARS_TOTAL, EngineRequest, FinishReason, SamplingParams, TokenLogprob
from mindie.server.errors import APIError
from mindie.server.fields import INT32_MAX, number, validate
from mindie.server.protocols.base import OPENAI_REASONS, UNNAMED, Call, Renderer, sse
from mindie.server.protocols.guided import ResponseFormat, compile_guided, one_of, response_format
from mindie.server.protocols.openai import (
    OpenAIFields,
    OpenAIRenderer,
    StreamUsage,
    check_model,
    completion_logprobs,
    usage,
    vllm_prompt_logprobs,
)
from mindie.server.protocols.params import StopList, TokenId
from mindie.server.results import Result, StreamItem

if TYPE_CHECKING:
    from mindie.server.serving import Serving
    from mindie.tokenizer import Tokenizer

MAX_PROMPTS = 128

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
    response_format: ResponseFormat | None = None  # vLLM takes OpenAI's chat field here too


def _prompts(ctx: Serving, prompt: Any) -> list[tuple[str | None, list[int]]]:
    if isinstance(prompt, str):
        return [(prompt, ctx.encode(prompt, "prompt"))]
    if prompt and isinstance(prompt[0], str):
        return [(p, ctx.encode(p, f"prompt[{i}]")) for i, p in enumerate(prompt)]
    if prompt and isinstance(prompt[0], int):
        return [(None, ctx.check_token_ids(list(prompt), "prompt"))]
    return [(None, ctx.check_token_ids(list(p), f"prompt[{i}]")) for i, p in enumerate(prompt)]


async def parse(ctx: Serving, body: bytes, path: Mapping[str, str]) -> tuple[Call, Renderer]:
    req = validate(CompletionRequest, body)
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
    max_tokens = 1 if req.max_tokens == 0 else req.output_limit
    params = req.sampling_params(ctx, logprobs=req.logprobs, max_tokens=max_tokens, stream=req.stream)
    if scoring:
        params = dataclasses.replace(params, prompt_logprobs=req.logprobs)
    params = req.with_prompt_logprobs(params)
    prompts = _prompts(ctx, req.prompt)
    if len(prompts) * params.num_samples > ctx.max_n:
        raise APIError(422, f"prompts x best_of must be at most {ctx.max_n}, got {len(prompts)} x "
                            f"{params.num_samples}", "prompt")
    grammar = await compile_guided(ctx, one_of(response_format(req.response_format) + req.guided()), params.max_tokens)
    requests = [EngineRequest(UNNAMED, ids, params, prompt_text=text, grammar=grammar) for text, ids in prompts]
    echoed = [(text if text is not None else ctx.tokenizer.decode(ids)) if req.echo else "" for text, ids in prompts]
    renderer = CompletionRenderer(req, params, ctx.tokenizer, [ids for _, ids in prompts], echoed, scoring)
    return Call(requests, stream=req.stream), renderer


class CompletionRenderer(OpenAIRenderer):
    """Choice k * n + i is sample i of prompt k."""

    def __init__(self, req: CompletionRequest, params: SamplingParams, tokenizer: Tokenizer,
                 prompt_ids: list[list[int]], echoed: list[str], scoring: bool) -> None:
        super().__init__()
        self.req = req
        self.n = params.n
        self.beam = params.use_beam_search
        self.tokenizer = tokenizer
        self.prompt_ids = prompt_ids
        self.echoed = echoed  # per prompt: the text echo puts before its output ("" without echo)
        self.scoring = scoring  # echo with logprobs: the prompt's tokens are scored too
        self.drop_output = req.max_tokens == 0  # echo alone
        self.usage = StreamUsage(req.stream_options, sum(map(len, prompt_ids)))
        self.offsets: dict[tuple[int, int], int] = {}  # (prompt, sample) -> characters streamed so far
        self.started: set[tuple[int, int]] = set()  # (prompt, sample) with an output chunk sent

    def _head(self, results: list[Result]) -> dict[str, Any]:
        return {"id": results[0].request_id, "object": "text_completion", "created": self.created,
                "model": self.req.model}

    def whole(self, results: list[Result]) -> Any:
        choices = []
        for k, result in enumerate(results):
            for s in result.best(self.n):
                prefix = self.echoed[k]
                ids, lps = ([], []) if self.drop_output else (s.token_ids, list(s.logprobs))
                if self.scoring:
                    prompt = self.prompt_ids[k]
                    ids, lps = prompt + ids, (result.prompt_logprobs or [None] * len(prompt)) + lps
                choices.append({"index": k * self.n + s.index, "text": prefix + ("" if self.drop_output else s.text),
                                "logprobs": completion_logprobs(self.tokenizer, lps, 0 if self.scoring
                                                                else len(prefix), ids)
                                if self.req.logprobs is not None else None,
                                "stop_reason": None, "finish_reason": OPENAI_REASONS[s.finish_reason],
                                **self._extras(k, result, [] if self.drop_output else s.token_ids)})
        out = usage(results, self.usage.prompt_tokens)
        if self.drop_output:
            out.update(completion_tokens=0, total_tokens=self.usage.prompt_tokens, batch_size=[], queue_wait_time=[])
        return {**self._head(results), "choices": choices, "usage": out}

    def _extras(self, k: int, result: Result | None, token_ids: list[int]) -> dict[str, Any]:
        """vLLM's per-choice prompt_token_ids / token_ids and prompt_logprobs, when asked for
        (a stream's prompt fields ride on a choice's first chunk: `result` given)."""
        out: dict[str, Any] = {}
        if self.req.return_token_ids:
            out["token_ids"] = token_ids
            if result is not None:
                out["prompt_token_ids"] = self.prompt_ids[k]
        if self.req.prompt_logprobs is not None and result is not None:
            out["prompt_logprobs"] = vllm_prompt_logprobs(self.tokenizer, self.prompt_ids[k], result.prompt_logprobs)
        return out

    def _choice(self, k: int, index: int, text: str, lps: list[TokenLogprob] | None, offset: int,
                reason: FinishReason | None, token_ids: list[int] | None = None,
                result: Result | None = None) -> dict[str, Any]:
        """One choice of a stream chunk; `lps` None: none to report (the echoed prompt)."""
        return {"index": k * self.n + index, "text": text,
                "logprobs": completion_logprobs(self.tokenizer, lps, offset)
                if self.req.logprobs is not None and lps is not None else None,
                "stop_reason": None, "finish_reason": OPENAI_REASONS[reason] if reason else None,
                **self._extras(k, result, token_ids or [])}

    def begin(self, results: list[Result]) -> list[bytes]:
        if self.beam or not self.req.echo:
            return []
        events = []
        for k, echoed in enumerate(self.echoed):
            for i in range(self.n):
                self.offsets[(k, i)] = len(echoed)
                events.append(sse({**self._head(results), "choices": [self._choice(k, i, echoed, None, 0, None)]}))
        return events

    def event(self, k: int, item: StreamItem, results: list[Result]) -> list[bytes]:
        out = item.output
        reports_ids = self.req.return_token_ids and out.new_token_ids
        silent = not out.new_text and out.finish_reason is None and not reports_ids
        if self.beam or silent:
            return []
        first = (k, out.index) not in self.started
        self.started.add((k, out.index))
        offset = self.offsets.get((k, out.index), 0)
        self.offsets[(k, out.index)] = offset + len(out.new_text)
        chunk: dict[str, Any] = {**self._head(results), "choices": [
            self._choice(k, out.index, out.new_text, out.new_logprobs, offset, out.finish_reason, out.new_token_ids,
                         results[k] if first else None)]}
        return [sse(self.usage.running(chunk, results))]

    def end(self, results: list[Result]) -> list[bytes]:
        head = self._head(results)
        if not self.beam:
            return self.usage.chunks(head, results)
        # Seed 002's "fake stream": a beam search knows its choices only at its end, so they come
        # as one event carrying every choice, then [DONE].
        choices = [self._choice(k, s.index, self.echoed[k] + s.text, s.logprobs, len(self.echoed[k]),
                                s.finish_reason) for k, result in enumerate(results) for s in result.best(self.n)]
        return [sse(self.usage.running({**head, "choices": choices}, results)), *self.usage.chunks(head, results)]
