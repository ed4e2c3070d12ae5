"""The TGI 0.9.4-compatible API: POST /generate (body with `inputs`), /generate_stream and `/`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal

from mindie.engine.request import EngineRequest, SamplingParams, TokenLogprob
from mindie.server.errors import APIError, ErrorStyle
from mindie.server.fields import INT32_MAX, Body, Seed, number, validate
from mindie.server.protocols.base import MINDIE_REASONS, UNNAMED, Call, Renderer, sse
from mindie.server.protocols.family import Family, Kind, Route, plain_prompt
from mindie.server.protocols.guided import Constraint, compile_guided, schema_value
from mindie.server.protocols.messages import render_parts
from mindie.server.protocols.params import (
    ContentPart,
    MaxNewTokens,
    Penalty,
    Priority,
    StopList,
    StopString,
    Temperature,
    Timeout,
    TopK,
    TypicalP,
    join_parts,
    sampling_params,
)
from mindie.server.results import Result, SampleResult, StreamItem

if TYPE_CHECKING:
    from mindie.server.serving import Serving
    from mindie.tokenizer import Tokenizer


class TGIGrammar(Body):
    """TGI's `parameters.grammar`: a JSON schema (as an object or its text) or a regex."""

    type: Literal["json", "json_schema", "regex"]
    value: Any

    def constraint(self) -> Constraint:
        param = "parameters.grammar.value"
        if self.type == "regex":
            if not isinstance(self.value, str):
                raise APIError(422, f"{param} must be a regular expression string for type 'regex'", param)
            return Constraint(param, "regex", self.value)
        value = self.value
        if self.type == "json_schema" and isinstance(value, dict) and isinstance(value.get("schema"), dict):
            value = value["schema"]  # {"name": ..., "schema": ...}, as OpenAI's json_schema
        return Constraint(param, "json", schema_value(value, param))


class TGIParameters(Body):
    decoder_input_details: bool = False
    details: bool = False
    do_sample: bool | None = None
    max_new_tokens: MaxNewTokens = 20
    repetition_penalty: Penalty = 1.0
    return_full_text: bool = False
    seed: Seed | None = None
    temperature: Temperature | None = None
    top_k: TopK | None = None
    top_p: number(1e-6, 1, lo_open=True, hi_open=True) | None = None  # type: ignore[valid-type]
    truncate: number(0, INT32_MAX, lo_open=True, integer=True) | None = None  # type: ignore[valid-type]
    typical_p: TypicalP | None = None  # accepted, not applied
    watermark: bool = False  # accepted, not applied
    stop: StopString | StopList | None = None
    adapter_id: str | None = None
    priority: Priority = 5
    timeout: Timeout = 600
    best_of: number(1, 128, integer=True) | None = None  # type: ignore[valid-type]
    top_n_tokens: number(0, 20, integer=True) | None = None  # type: ignore[valid-type]
    grammar: TGIGrammar | None = None


class TGIRequest(Body):
    inputs: str | list[ContentPart]
    parameters: TGIParameters = TGIParameters()
    stream: bool = False  # only read by POST /


async def parse_generate(ctx: Serving, body: bytes, path: Mapping[str, str]) -> tuple[Call, Renderer]:
    return await _parse(ctx, validate(TGIRequest, body), stream=False, wrap_in_list=False)


async def parse_generate_stream(ctx: Serving, body: bytes, path: Mapping[str, str]) -> tuple[Call, Renderer]:
    return await _parse(ctx, validate(TGIRequest, body), stream=True, wrap_in_list=False)


async def parse_root(ctx: Serving, body: bytes, path: Mapping[str, str]) -> tuple[Call, Renderer]:
    req = validate(TGIRequest, body)
    return await _parse(ctx, req, stream=req.stream, wrap_in_list=not req.stream)


def _tgi_sampling(p: TGIParameters, stream: bool) -> SamplingParams:
    """MindIE's parameters plus TGI's own best_of (sampled candidates, the likeliest returned)
    and top_n_tokens (the most likely tokens at each step)."""
    params = sampling_params(p, p.max_new_tokens)
    if p.best_of is not None and p.best_of > 1:
        if not params.do_sample:
            raise APIError(422, "parameters.best_of > 1 needs sampling: set do_sample or a sampling parameter "
                                "(temperature, top_k, top_p)", "parameters.best_of")
        if stream:
            raise APIError(422, "parameters.best_of > 1 is not supported when streaming", "parameters.best_of")
        params = replace(params, best_of=p.best_of)
    return replace(params, logprobs=p.top_n_tokens) if p.top_n_tokens else params


async def _parse(ctx: Serving, req: TGIRequest, stream: bool, wrap_in_list: bool) -> tuple[Call, Renderer]:
    p = req.parameters
    if stream and p.decoder_input_details:
        raise APIError(422, "parameters.decoder_input_details must not be true when stream is true",
                       "parameters.decoder_input_details")
    if p.adapter_id not in (None, "None"):
        raise APIError(422, f"parameters.adapter_id {p.adapter_id!r} is not a loaded LoRA adapter (none are loaded)",
                       "parameters.adapter_id")
    media = None
    if (parts := await render_parts(ctx, req.inputs, "inputs")) is not None:
        text, ids, media = parts
        if p.truncate is not None and len(ids) > p.truncate:
            raise APIError(400, f"parameters.truncate={p.truncate} would cut a prompt with images ({len(ids)} tokens); "
                                "images are never truncated", "parameters.truncate")
    else:
        text = join_parts(req.inputs, "inputs")
        ctx.check_text(text, "inputs")
        ids = ctx.tokenizer.encode(text)
        if p.truncate is not None and len(ids) > p.truncate:
            ids = ids[-p.truncate:]
        ids = ctx.fit_prompt(ids, "inputs")
    params = _tgi_sampling(p, stream)
    grammar = await compile_guided(ctx, p.grammar.constraint() if p.grammar else None, params.max_tokens)
    request = EngineRequest(UNNAMED, ids, params, priority=p.priority, prompt_text=text, grammar=grammar,
                            media=media)
    renderer = TGIRenderer(ctx.tokenizer, p, ids, text if p.return_full_text else "", ctx.settings.full_text,
                           wrap_in_list)
    return Call([request], stream=stream, timeout_s=p.timeout), renderer


class TGIRenderer(Renderer):
    def __init__(self, tokenizer: Tokenizer, p: TGIParameters, prompt_ids: list[int], prefix: str,
                 full_text: bool, wrap_in_list: bool) -> None:
        self.tokenizer = tokenizer
        self.p = p
        self.prompt_ids = prompt_ids
        self.prefix = prefix  # the prompt, with return_full_text
        self.full_text = full_text
        self.wrap_in_list = wrap_in_list  # POST / answers a list

    def whole(self, results: list[Result]) -> Any:
        result = results[0]
        s, *others = result.ranked()
        body: dict[str, Any] = {"generated_text": self.prefix + s.text}
        if self.p.details or self.p.decoder_input_details:
            details = self._details(result, s, self.p.decoder_input_details)
            if others:
                details["best_of_sequences"] = [
                    {"generated_text": self.prefix + o.text, **self._details(result, o, self.p.decoder_input_details)}
                    for o in others]
            body = {"details": details, **body}
        return [body] if self.wrap_in_list else body

    def event(self, k: int, item: StreamItem, results: list[Result]) -> list[bytes]:
        result = results[0]
        out, s = item.output, result.samples[0]
        events = []
        for i, lp in enumerate(out.new_logprobs):
            token = self._token(lp.token_id, lp.logprob)
            last = out.finish_reason is not None and i == len(out.new_logprobs) - 1
            token["text"] = result.stream_text(out, self.full_text) if i == 0 else ""
            event: dict[str, Any] = {"token": token, "generated_text": None, "details": None}
            if self.p.top_n_tokens:
                event["top_tokens"] = self._top(lp)
            if last:
                event["generated_text"] = self.prefix + s.text
                if self.p.details:
                    event["details"] = {"prompt_tokens": len(self.prompt_ids),
                                        "finish_reason": MINDIE_REASONS[s.finish_reason],
                                        "generated_tokens": len(s.token_ids), "seed": result.seed}
            events.append(sse(event))
        return events

    def _token(self, token_id: int, logprob: float | None) -> dict[str, Any]:
        return {"id": token_id, "text": self.tokenizer.decode([token_id], skip_special_tokens=False),
                "logprob": logprob, "special": token_id in self.tokenizer.special_ids}

    def _top(self, lp: TokenLogprob) -> list[dict[str, Any]]:
        return [self._token(t, v) for t, v in lp.top[: self.p.top_n_tokens]]

    def _details(self, result: Result, s: SampleResult, prefill: bool) -> dict[str, Any]:
        details = {
            "prompt_tokens": len(self.prompt_ids),
            "finish_reason": MINDIE_REASONS[s.finish_reason],
            "generated_tokens": len(s.token_ids),
            "prefill": [self._token(t, None) for t in self.prompt_ids] if prefill else [],
            "seed": result.seed,
            "tokens": [self._token(lp.token_id, lp.logprob) for lp in s.logprobs],
        }
        if self.p.top_n_tokens:
            details["top_tokens"] = [self._top(lp) for lp in s.logprobs]
        return details


FAMILY = Family("tgi", ErrorStyle.MINDIE, sse, lambda body: plain_prompt(body.get("inputs")), routes=(
    Route("POST", "/generate", Kind.GENERATE, parse_generate, claims="inputs", body_model=TGIRequest,
          summary="TGI (a body with `inputs`)"),
    Route("POST", "/generate_stream", Kind.GENERATE, parse_generate_stream, stream=True, body_model=TGIRequest,
          summary="TGI streaming"),
    Route("POST", "/", Kind.GENERATE, parse_root, stream=None, body_model=TGIRequest, summary="TGI root"),
))
