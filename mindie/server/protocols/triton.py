"""The Triton-compatible API: /v2/models/{m}/generate, /generate_stream (text) and /infer
(token tensors), /v2/models/{m}/stopInfer, and the model-metadata routes."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response

from mindie import __version__
from mindie.engine.request import EngineRequest
from mindie.server.errors import APIError, ErrorStyle
from mindie.server.fields import INT32_MAX, Body, Seed, number, validate
from mindie.server.http import json_response
from mindie.server.protocols.base import MINDIE_REASONS, UNNAMED, Call, Renderer, sse
from mindie.server.protocols.family import Family, Kind, Prompt, Route, plain_prompt
from mindie.server.protocols.messages import render_parts
from mindie.server.protocols.params import (
    ContentPart,
    MaxNewTokens,
    Penalty,
    Priority,
    Temperature,
    Timeout,
    TokenId,
    TypicalP,
    join_parts,
    sampling_params,
)
from mindie.server.results import Result, StreamItem

if TYPE_CHECKING:
    from mindie.server.serving import Serving

RequestId = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,256}$")]


class TritonParameters(Body):
    details: bool = False
    do_sample: bool | None = None
    max_new_tokens: MaxNewTokens = 20
    repetition_penalty: Penalty = 1.0
    seed: Seed | None = None
    temperature: Temperature | None = None
    top_k: number(0, INT32_MAX, integer=True) | None = None  # type: ignore[valid-type]
    top_p: number(1e-6, 1, lo_open=True) | None = None  # type: ignore[valid-type]
    batch_size: number(0, INT32_MAX, lo_open=True, integer=True) | None = None  # type: ignore[valid-type]
    typical_p: TypicalP | None = None  # accepted, not applied
    watermark: bool = False  # accepted, not applied
    perf_stat: bool = False  # accepted, removed in MindIE's code
    priority: Priority = 5
    timeout: Timeout = 600


class TritonTextRequest(Body):
    id: RequestId | None = None
    text_input: str | list[ContentPart]
    parameters: TritonParameters = TritonParameters()


class TensorIn(Body):
    name: Annotated[str, Field(max_length=256)]
    shape: Annotated[list[number(1, 4 * 2**20, integer=True)], Field(min_length=1, max_length=2)]  # type: ignore[valid-type]
    datatype: Literal["UINT32"]
    data: Annotated[list[TokenId], Field(max_length=4 * 2**20)]


class TensorOut(Body):
    name: Annotated[str, Field(max_length=256)] = "output0"


class TritonTokenRequest(Body):
    id: RequestId | None = None
    inputs: Annotated[list[TensorIn], Field(min_length=1, max_length=1)]
    outputs: Annotated[list[TensorOut], Field(max_length=1)] = [TensorOut()]
    parameters: TritonParameters = TritonParameters()


class StopRequest(Body):
    id: RequestId


def check_model(ctx: Serving, model: str) -> None:
    if model != ctx.settings.model_name:
        raise APIError(404, f"Model {model} not found.", "model")


async def parse_generate(ctx: Serving, body: bytes, path: Mapping[str, str]) -> tuple[Call, Renderer]:
    return await _parse_text(ctx, body, path["model"], stream=False)


async def parse_generate_stream(ctx: Serving, body: bytes, path: Mapping[str, str]) -> tuple[Call, Renderer]:
    return await _parse_text(ctx, body, path["model"], stream=True)


async def _parse_text(ctx: Serving, body: bytes, model: str, stream: bool) -> tuple[Call, Renderer]:
    check_model(ctx, model)
    req = validate(TritonTextRequest, body)
    p = req.parameters
    media = None
    if (parts := await render_parts(ctx, req.text_input, "text_input")) is not None:
        text, ids, media = parts
    else:
        text = join_parts(req.text_input, "text_input")
        ids = ctx.encode(text, "text_input")
    request = EngineRequest(UNNAMED, ids, sampling_params(p, p.max_new_tokens), priority=p.priority,
                            prompt_text=text, media=media)
    renderer = TritonTextRenderer(req.id, model, p.details, ctx.settings.full_text)
    return Call([request], stream=stream, timeout_s=p.timeout, user_id=req.id), renderer


class TritonTextRenderer(Renderer):
    def __init__(self, user_id: str | None, model: str, details: bool, full_text: bool) -> None:
        self.user_id = user_id
        self.model = model
        self.details = details
        self.full_text = full_text

    def _head(self, result: Result) -> dict[str, Any]:
        return {"id": self.user_id or result.request_id, "model_name": self.model, "model_version": None}

    def whole(self, results: list[Result]) -> Any:
        result = results[0]
        body = {**self._head(result), "text_output": result.samples[0].text}
        if self.details:
            s = result.samples[0]
            body["details"] = {"finish_reason": MINDIE_REASONS[s.finish_reason], "generated_tokens": len(s.token_ids),
                               "first_token_cost": round(result.prefill_ms, 2) if result.prefill_ms is not None
                               else None,
                               "decode_cost": [round(d, 2) for d in result.decode_ms],
                               "batch_size": result.batch_sizes, "queue_wait_time": result.queue_wait_us}
        return body

    def event(self, k: int, item: StreamItem, results: list[Result]) -> list[bytes]:
        result, out = results[0], item.output
        event: dict[str, Any] = {**self._head(result), "text_output": result.stream_text(out, self.full_text)}
        if self.details:
            # Seed 003's event: details with the running token count and this step's batch size
            # and queue wait (us), then prefillTime on the first event, decodeTime on later ones.
            details: dict[str, Any] = {"generated_tokens": out.num_output_tokens, "first_token_cost": None,
                                       "decode_cost": None, "batch_size": _last(out.batch_sizes),
                                       "queue_wait_time": _last([round(w * 1e6) for w in out.queue_waits_s])}
            if out.finish_reason is not None:
                details = {"finish_reason": MINDIE_REASONS[out.finish_reason], **details}
            event["details"] = details
            event["prefillTime"] = round(item.prefill_ms, 2) if item.prefill_ms is not None else None
            event["decodeTime"] = round(item.decode_ms, 2) if item.decode_ms is not None else None
        elif out.finish_reason is not None:
            event["details"] = {"finish_reason": MINDIE_REASONS[out.finish_reason],
                                "generated_tokens": out.num_output_tokens}
        return [sse(event, space=False)]

    def error(self, err: APIError) -> bytes:
        return sse(err.body(self.style), space=False)


def _last(values: list[int]) -> int | None:
    """A stream event's per-step value: that of its one token (None for an event without one)."""
    return values[-1] if values else None


async def parse_infer(ctx: Serving, body: bytes, path: Mapping[str, str]) -> tuple[Call, Renderer]:
    check_model(ctx, path["model"])
    req = validate(TritonTokenRequest, body)
    tensor = req.inputs[0]
    count = 1
    for dim in tensor.shape:
        count *= dim
    if (len(tensor.shape) == 2 and tensor.shape[0] != 1) or count != len(tensor.data):
        raise APIError(422, f"inputs[0].shape {tensor.shape} must be [n] or [1, n] with n = len(inputs[0].data) = "
                            f"{len(tensor.data)}", "inputs[0].shape")
    p = req.parameters
    ids = ctx.check_token_ids(list(tensor.data), "inputs[0].data")
    request = EngineRequest(UNNAMED, ids, sampling_params(p, p.max_new_tokens), priority=p.priority)
    renderer = TritonTokenRenderer(req.id, req.outputs[0].name if req.outputs else "output0")
    return Call([request], timeout_s=p.timeout, user_id=req.id), renderer


class TritonTokenRenderer(Renderer):
    """/infer answers whole: its output tensor is every generated token id."""

    def __init__(self, user_id: str | None, output_name: str) -> None:
        self.user_id = user_id
        self.output_name = output_name

    def whole(self, results: list[Result]) -> Any:
        data = results[0].samples[0].token_ids
        return {"id": self.user_id or results[0].request_id,
                "outputs": [{"name": self.output_name, "shape": [1, len(data)], "datatype": "UINT32", "data": data}]}


async def stop_infer(ctx: Serving, request: Request, body: bytes) -> Response:
    check_model(ctx, request.path_params["model"])
    req = validate(StopRequest, body)
    if not ctx.stop(req.id):
        raise APIError(404, f"RequestId is {req.id} not found.", "id")
    return json_response({"id": req.id})


async def server_metadata(ctx: Serving, request: Request) -> Response:
    e = ctx.settings.engine
    return json_response({"name": "MindIE Server", "version": __version__, "extensions": {
        "max_iter_times": e.max_iter_times, "prefill_policy_type": 0, "decode_policy_type": 0,
        "max_prefill_batch_size": e.max_prefill_batch_size or e.max_batch_size,
        "max_prefill_tokens": e.max_prefill_tokens}})


async def model_metadata(ctx: Serving, request: Request) -> Response:
    model = request.path_params["model"]
    check_model(ctx, model)
    return json_response({"name": model, "platform": "MindIE Server",
                          "inputs": [{"name": "input0", "shape": [-1], "datatype": "UINT32"}],
                          "outputs": [{"name": "output0", "shape": [-1], "datatype": "UINT32"}]})


async def model_config(ctx: Serving, request: Request) -> Response:
    model = request.path_params["model"]
    check_model(ctx, model)
    return json_response({
        "model_name": model, "input_datatype": "UINT32", "output_datatype": "UINT32",
        "max_seq_len": ctx.settings.engine.max_seq_len, "npu_mem_size": -1, "cpu_mem_size": 0, "world_size": 1,
        "model_weight_path": os.path.basename(ctx.settings.model_path or "SmolLM2-135M-Instruct.Q4_1.gguf"),
        "model_instance_type": "Standard"})


def _prompt(body: dict[str, Any]) -> Prompt | None:
    if "text_input" in body:
        return plain_prompt(body["text_input"])
    inputs = body.get("inputs")
    tensor = inputs[0] if isinstance(inputs, list) and inputs else None
    return plain_prompt(tensor.get("data")) if isinstance(tensor, dict) else None


# Triton's stream events are `data:` without the space.
FAMILY = Family("triton", ErrorStyle.MINDIE, lambda body: sse(body, space=False), _prompt, client_id="id", routes=(
    Route("POST", "/v2/models/{model}/generate", Kind.GENERATE, parse_generate, body_model=TritonTextRequest,
          summary="Triton text generation"),
    Route("POST", "/v2/models/{model}/generate_stream", Kind.GENERATE, parse_generate_stream, stream=True,
          body_model=TritonTextRequest, summary="Triton streaming text generation"),
    Route("POST", "/v2/models/{model}/infer", Kind.GENERATE, parse_infer, body_model=TritonTokenRequest,
          summary="Triton token tensors"),
    Route("POST", "/v2/models/{model}/stopInfer", Kind.CONTROL, handler=stop_infer, body_model=StopRequest,
          summary="Cancel a request by id"),
    Route("GET", "/v2", Kind.INFO, handler=server_metadata),
    Route("GET", "/v2/models/{model}", Kind.INFO, handler=model_metadata),
    Route("GET", "/v2/models/{model}/config", Kind.INFO, handler=model_config),
))
