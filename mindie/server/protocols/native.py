"""MindIE's native API: POST /infer (text) and /infer_token (token ids), per seed 000, and its
tokenizer route."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import Field

from mindie.engine.request import EngineRequest
from mindie.server.errors import APIError, ErrorStyle
from mindie.server.fields import Body, Seed, number, validate
from mindie.server.http import json_response
from mindie.server.protocols.base import MINDIE_REASONS, UNNAMED, Call, Renderer, sse
from mindie.server.protocols.family import Family, Kind, Route, plain_prompt
from mindie.server.protocols.messages import render_parts
from mindie.server.protocols.params import (
    ContentPart,
    MaxNewTokens,
    Penalty,
    Priority,
    Temperature,
    Timeout,
    TokenId,
    TopK,
    TypicalP,
    join_parts,
    sampling_params,
)
from mindie.server.results import Result, StreamItem

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.responses import Response

    from mindie.server.serving import Serving


MAX_INFER_IMAGES = 1  # seed 000: "at most 1 image"


class InferParameters(Body):
    temperature: Temperature | None = None
    top_k: TopK | None = None
    top_p: number(0, 1, lo_open=True, hi_open=True) | None = None  # type: ignore[valid-type]
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


async def parse(ctx: Serving, body: bytes, path: Mapping[str, str]) -> tuple[Call, Renderer]:
    req = validate(InferRequest, body)
    if (req.inputs is None) == (req.input_id is None):
        raise APIError(422, "exactly one of inputs (text) and input_id (token ids) is required" if req.inputs is None
                       else "Input conflict: inputs and input_id cannot be used together", "inputs")
    media = None
    if req.input_id is not None:
        ids, text = ctx.check_token_ids(list(req.input_id), "input_id"), None
    elif (parts := await render_parts(ctx, req.inputs, "inputs", limit=MAX_INFER_IMAGES)) is not None:
        text, ids, media = parts
    else:
        text = join_parts(req.inputs, "inputs")  # type: ignore[arg-type]
        ids = ctx.encode(text, "inputs")
    p = req.parameters
    request = EngineRequest(UNNAMED, ids, sampling_params(p, p.max_new_tokens), priority=p.priority,
                            prompt_text=text, media=media)
    return Call([request], stream=req.stream, timeout_s=p.timeout), NativeRenderer(p.details, ctx.settings.full_text)


class NativeRenderer(Renderer):
    def __init__(self, details: bool, full_text: bool) -> None:
        self.details = details
        self.full_text = full_text

    def whole(self, results: list[Result]) -> Any:
        result = results[0]
        out: dict[str, Any] = {"generated_text": result.samples[0].text}
        if self.details:
            out["details"] = _details(result, full=True)
        return out

    def event(self, k: int, item: StreamItem, results: list[Result]) -> list[bytes]:
        result, out = results[0], item.output
        event: dict[str, Any] = {
            "prefill_time": round(item.prefill_ms, 2) if item.prefill_ms is not None else None,
            "decode_time": round(item.decode_ms, 2) if item.decode_ms is not None else None,
        }
        # Seed 000: token.id is the event's one token as an integer (an event per step, one
        # token each; None on an end without a token, such as an abort).
        token_id = out.new_token_ids[-1] if out.new_token_ids else None
        if out.finish_reason is None:
            event["token"] = {"id": token_id, "text": result.stream_text(out, self.full_text)}
        else:
            event["generated_text"] = result.samples[0].text
            event["details"] = _details(result, full=False) if self.details else None
            event["token"] = {"id": token_id, "text": None}
        return [sse(event)]


def _details(result: Result, full: bool) -> dict[str, Any]:
    s = result.samples[0]
    d: dict[str, Any] = {"finish_reason": MINDIE_REASONS[s.finish_reason], "generated_tokens": len(s.token_ids)}
    if full:
        d["generated_token_ids"] = s.token_ids
    d["seed"] = result.seed
    return d


class TokenizerRequest(Body):
    inputs: str
    do_decode: bool = True


async def tokenizer(ctx: Serving, request: Request, body: bytes) -> Response:
    req = validate(TokenizerRequest, body)
    if not req.inputs:
        raise APIError(422, "inputs must be a non-empty string", "inputs")
    ctx.check_text(req.inputs, "inputs")
    ids = ctx.tokenizer.encode(req.inputs)
    tokens: list[Any] = [ctx.tokenizer.decode([t], skip_special_tokens=False) for t in ids] if req.do_decode else ids
    return json_response({"token_number": len(ids), "tokens": tokens})


FAMILY = Family(
    "native", ErrorStyle.MINDIE, sse,
    lambda body: plain_prompt(body["inputs"] if "inputs" in body else body.get("input_id")),
    routes=(
        Route("POST", "/infer", Kind.GENERATE, parse, stream=None, body_model=InferRequest,
              summary="MindIE native text generation"),
        Route("POST", "/infer_token", Kind.GENERATE, parse, stream=None, body_model=InferRequest,
              summary="MindIE native, token ids in"),
        Route("POST", "/v1/tokenizer", Kind.INFO, handler=tokenizer, body_model=TokenizerRequest,
              summary="MindIE tokenizer"),
    ))
