"""The TGI 0.9.4-compatible API: POST /generate (body with `inputs`), /generate_stream and `/`."""

from typing import Annotated, Any

from pydantic import AfterValidator, Field
from starlette.requests import Request
from starlette.responses import Response

from mindie.engine.request import MAX_STOP_CHARS_TOTAL, MAX_STOP_LIST_ITEM_CHARS, MAX_STOP_STRINGS
from mindie.server.errors import APIError, ErrorStyle
from mindie.server.fields import INT32_MAX, Body, number, parse
from mindie.server.protocols.common import (
    MINDIE_REASONS,
    ContentPart,
    join_parts,
    json_response,
    sse,
    stream_response,
)
from mindie.server.protocols.native import (
    MaxNewTokens,
    Penalty,
    Priority,
    Seed,
    Temperature,
    Timeout,
    TopK,
    TypicalP,
    sampling_params,
)
from mindie.server.serving import Generation, Result, SampleResult, Serving

StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LIST_ITEM_CHARS)]


def _stop_total(stops: list[str]) -> list[str]:
    total = sum(len(s) for s in stops)
    if total > MAX_STOP_CHARS_TOTAL:
        raise ValueError(f"must have at most {MAX_STOP_CHARS_TOTAL} characters in total, got {total}")
    return stops


# seed 004: up to 1024 strings of 1..1024 characters, 32768 in all
StopList = Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS), AfterValidator(_stop_total)]


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


class TGIRequest(Body):
    inputs: str | list[ContentPart]
    parameters: TGIParameters = TGIParameters()
    stream: bool = False  # only read by POST /


def _generation(ctx: Serving, req: TGIRequest, stream: bool) -> Generation:
    p = req.parameters
    if stream and p.decoder_input_details:
        raise APIError(422, "parameters.decoder_input_details must not be true when stream is true",
                       "parameters.decoder_input_details")
    if p.adapter_id not in (None, "None"):
        raise APIError(422, f"parameters.adapter_id {p.adapter_id!r} is not a loaded LoRA adapter (none are loaded)",
                       "parameters.adapter_id")
    text = join_parts(req.inputs, "inputs")
    ctx.check_text(text, "inputs")
    ids = ctx.tokenizer.encode(text)
    if p.truncate is not None and len(ids) > p.truncate:
        ids = ids[-p.truncate:]
    ids = ctx.fit_prompt(ids, "inputs")
    return Generation(ids, sampling_params(p, p.max_new_tokens), priority=p.priority, timeout_s=p.timeout,
                      stream=stream, prompt_text=text)


def _token(ctx: Serving, token_id: int, logprob: float | None) -> dict[str, Any]:
    return {"id": token_id, "text": ctx.tokenizer.decode([token_id], skip_special_tokens=False),
            "logprob": logprob, "special": token_id in ctx.tokenizer.special_ids}


def _details(ctx: Serving, gen: Generation, result: Result, s: SampleResult, prefill: bool) -> dict[str, Any]:
    return {
        "prompt_tokens": len(gen.prompt_ids),
        "finish_reason": MINDIE_REASONS[s.finish_reason],
        "generated_tokens": len(s.token_ids),
        "prefill": [_token(ctx, t, None) for t in gen.prompt_ids] if prefill else [],
        "seed": result.seed,
        "tokens": [_token(ctx, lp.token_id, lp.logprob) for lp in s.logprobs],
    }


async def _run(ctx: Serving, request: Request, req: TGIRequest, stream: bool, wrap_in_list: bool) -> Response:
    gen = _generation(ctx, req, stream)
    out_stream = await ctx.start(gen)
    p = req.parameters
    prefix = gen.prompt_text if p.return_full_text else ""
    if not stream:
        result = await ctx.collect(request, out_stream)
        s = result.samples[0]
        body: dict[str, Any] = {"generated_text": prefix + s.text}
        if p.details or p.decoder_input_details:
            body = {"details": _details(ctx, gen, result, s, p.decoder_input_details), **body}
        return json_response([body] if wrap_in_list else body)

    async def events():  # type: ignore[no-untyped-def]
        result = Result.empty(gen.params)
        async for item in out_stream:
            result.add(item)
            out, s = item.output, result.samples[0]
            for k, lp in enumerate(out.new_logprobs):
                token = _token(ctx, lp.token_id, lp.logprob)
                last = out.finish_reason is not None and k == len(out.new_logprobs) - 1
                token["text"] = result.stream_text(out, ctx.settings.full_text) if k == 0 else ""
                event: dict[str, Any] = {"token": token, "generated_text": None, "details": None}
                if last:
                    event["generated_text"] = prefix + s.text
                    if p.details:
                        event["details"] = {"prompt_tokens": len(gen.prompt_ids),
                                            "finish_reason": MINDIE_REASONS[s.finish_reason],
                                            "generated_tokens": len(s.token_ids), "seed": result.seed}
                yield sse(event)

    return stream_response(out_stream, events, lambda e: sse(e.body(ErrorStyle.MINDIE)))


async def generate(ctx: Serving, request: Request, req: TGIRequest) -> Response:
    return await _run(ctx, request, req, stream=False, wrap_in_list=False)


async def generate_stream(ctx: Serving, request: Request, body: bytes) -> Response:
    return await _run(ctx, request, parse(TGIRequest, body), stream=True, wrap_in_list=False)


async def root(ctx: Serving, request: Request, body: bytes) -> Response:
    req = parse(TGIRequest, body)
    return await _run(ctx, request, req, stream=req.stream, wrap_in_list=not req.stream)
