"""MindIE's native API: POST /infer (text) and /infer_token (token ids), per seed 000."""

from typing import Any

from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response

from mindie.engine.request import SamplingParams
from mindie.server.errors import APIError, ErrorStyle
from mindie.server.fields import INT32_MAX, Body, Seed, number, parse
from mindie.server.protocols.common import (
    MINDIE_REASONS,
    ContentPart,
    join_parts,
    json_response,
    sampling_on,
    sse,
    stream_response,
)
from mindie.server.serving import Generation, Result, Serving

Temperature = number(0, None, lo_open=True)
TopK = number(0, INT32_MAX, lo_open=True, integer=True)
TopP = number(0, 1, lo_open=True, hi_open=True)
MaxNewTokens = number(0, INT32_MAX, lo_open=True, integer=True)
Penalty = number(0, None, lo_open=True)
TypicalP = number(0, 1, lo_open=True)
Priority = number(1, 5, integer=True)
Timeout = number(1, 3600, integer=True)
TokenId = number(0, INT32_MAX, integer=True)


class InferParameters(Body):
    temperature: Temperature | None = None
    top_k: TopK | None = None
    top_p: TopP | None = None
    max_new_tokens: MaxNewTokens = 20
    do_sample: bool | None = None
    seed: Seed | None = None
    repetition_penalty: Penalty = 1.0
    details: bool = False
    typical_p: TypicalP | None = None  # accepted, not applied (as MindIE)
    watermark: bool = False  # accepted, not applied (as MindIE)
    priority: Priority = 5
    timeout: Timeout = 600


class InferRequest(Body):
    inputs: str | list[ContentPart] | None = None
    input_id: list[TokenId] | None = Field(None, max_length=4 * 2**20)
    stream: bool = False
    parameters: InferParameters = InferParameters()


def stop_tuple(stop: str | list[str] | None) -> tuple[str, ...]:
    return (stop,) if isinstance(stop, str) else tuple(stop or ())


def sampling_params(p: Any, max_new_tokens: int) -> SamplingParams:
    """Parameters shared by the native, TGI and Triton routes (same names, same meaning)."""
    do_sample = sampling_on(p.do_sample, p.temperature, p.top_k, p.top_p)
    try:
        return SamplingParams(
            max_tokens=max_new_tokens,
            temperature=p.temperature if p.temperature is not None else 1.0,
            top_k=p.top_k or 0,
            top_p=p.top_p if p.top_p is not None else 1.0,
            repetition_penalty=p.repetition_penalty,
            seed=p.seed,
            do_sample=do_sample,
            stop=stop_tuple(getattr(p, "stop", None)),
        )
    except ValueError as exc:
        raise APIError(422, f"parameters.{exc}") from None


def _generation(ctx: Serving, req: InferRequest) -> Generation:
    if (req.inputs is None) == (req.input_id is None):
        raise APIError(422, "exactly one of inputs (text) and input_id (token ids) is required" if req.inputs is None
                       else "Input conflict: inputs and input_id cannot be used together", "inputs")
    if req.input_id is not None:
        ids, text = ctx.check_token_ids(list(req.input_id), "input_id"), None
    else:
        text = join_parts(req.inputs, "inputs")  # type: ignore[arg-type]
        ids = ctx.encode(text, "inputs")
    p = req.parameters
    return Generation(ids, sampling_params(p, p.max_new_tokens), priority=p.priority, timeout_s=p.timeout,
                      stream=req.stream, prompt_text=text)


def _details(result: Result, p: InferParameters, full: bool) -> dict[str, Any]:
    s = result.samples[0]
    d: dict[str, Any] = {"finish_reason": MINDIE_REASONS[s.finish_reason], "generated_tokens": len(s.token_ids)}
    if full:
        d["generated_token_ids"] = s.token_ids
    d["seed"] = result.seed
    return d


async def infer(ctx: Serving, request: Request, body: bytes) -> Response:
    req = parse(InferRequest, body)
    gen = _generation(ctx, req)
    stream = await ctx.start(gen)
    p = req.parameters
    if not req.stream:
        result = await ctx.collect(request, stream)
        out: dict[str, Any] = {"generated_text": result.samples[0].text}
        if p.details:
            out["details"] = _details(result, p, full=True)
        return json_response(out)

    async def events():  # type: ignore[no-untyped-def]
        result = Result.empty(gen.params)
        async for item in stream:
            result.add(item)
            out = item.output
            event: dict[str, Any] = {
                "prefill_time": round(item.prefill_ms, 2) if item.prefill_ms is not None else None,
                "decode_time": round(item.decode_ms, 2) if item.decode_ms is not None else None,
            }
            # Seed 000: token.id is the event's one token as an integer (an event per step, one
            # token each; None on an end without a token, such as an abort).
            token_id = out.new_token_ids[-1] if out.new_token_ids else None
            if out.finish_reason is None:
                event["token"] = {"id": token_id, "text": result.stream_text(out, ctx.settings.full_text)}
            else:
                event["generated_text"] = result.samples[0].text
                event["details"] = _details(result, p, full=False) if p.details else None
                event["token"] = {"id": token_id, "text": None}
            yield sse(event)

    return stream_response(stream, events, lambda e: sse(e.body(ErrorStyle.MINDIE)))
