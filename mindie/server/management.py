"""The management plane (health, status, info, config, stopService) and the metrics plane."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from mindie import __version__
from mindie.engine.request import EngineRequest, SamplingParams
from mindie.server.errors import APIError
from mindie.server.http import json_response
from mindie.server.protocols.base import UNNAMED, Call
from mindie.server.serving import Serving
from mindie.server.streams import GenerationTimeout

MAX_PROBE_WAIT_S = 600


def _check_running(ctx: Serving) -> None:
    if ctx.draining:
        raise APIError(503, "The service has been stopped.")
    if not ctx.engine.healthy:
        raise APIError(503, "the engine failed its last step; requests in flight were failed")


async def health(ctx: Serving, request: Request) -> Response:
    _check_running(ctx)
    return Response(status_code=200)


async def live(ctx: Serving, request: Request) -> Response:
    _check_running(ctx)
    return Response(status_code=200)


async def ready(ctx: Serving, request: Request) -> Response:
    _check_running(ctx)
    return Response(status_code=200)


async def model_ready(ctx: Serving, request: Request) -> Response:
    _check_running(ctx)
    if request.path_params["model"] != ctx.settings.model_name:
        raise APIError(404, f"Model {request.path_params['model']} not found.", "model")
    return Response(status_code=200)


async def health_timed(ctx: Serving, request: Request) -> Response:
    """Proves the engine works: one single-token generation within N seconds (default 10)."""
    raw = request.path_params.get("seconds")
    wait = 10
    if raw is not None:
        if not raw.isdigit() or len(raw) > 3 or not 1 <= int(raw) <= MAX_PROBE_WAIT_S:
            raise APIError(404, f"Wait time should be in range of [1, {MAX_PROBE_WAIT_S}], input is not valid")
        wait = int(raw)
    if ctx.draining:
        return json_response({"status": "healthy"})
    probe = EngineRequest(UNNAMED, [ctx.tokenizer.bos_token_id or 0], SamplingParams(max_tokens=1, temperature=0),
                          priority=1)
    [stream] = await ctx.start(Call([probe], timeout_s=wait))
    try:
        async for _ in stream:
            pass
    except GenerationTimeout:
        raise APIError(500, f"the engine did not answer a probe within {wait} s") from None
    finally:
        await stream.aclose()
    return json_response({"status": "healthy"})


async def info(ctx: Serving, request: Request) -> Response:
    e = ctx.settings.engine
    return json_response({
        "docker_label": None, "max_batch_total_tokens": e.max_prefill_tokens, "max_best_of": ctx.max_n,
        "max_concurrent_requests": e.max_batch_size, "max_stop_sequences": 1024, "max_waiting_tokens": None,
        "sha": None, "validation_workers": None, "version": __version__, "waiting_served_ratio": None,
        "models": [{"model_device_type": "cpu", "model_dtype": ctx.settings.dtype, "model_id": ctx.settings.model_name,
                    "model_pipeline_tag": "text-generation", "model_sha": None, "max_total_tokens": e.max_seq_len}],
        "max_input_length": ctx.max_input_tokens,
        # TGI clients read these top-level names
        "model_id": ctx.settings.model_name, "model_dtype": ctx.settings.dtype, "model_device_type": "cpu",
        "max_total_tokens": e.max_seq_len,
    })


def _resources(ctx: Serving) -> dict[str, Any]:
    stats = ctx.engine.stats
    return {"availSlotsNum": max(0, ctx.settings.engine.max_batch_size - stats.running),
            "availBlockNum": stats.free_blocks, "waitingRequestNum": stats.waiting,
            "runningRequestNum": stats.running, "swappedRequestNum": 0, "freeNpuBlockNums": stats.free_blocks,
            "freeCpuBlockNums": 0, "totalNpuBlockNums": stats.total_blocks, "totalCpuBlockNums": 0}


def _role(ctx: Serving) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(service, linkStatus.peers): PD-mixed is always ready with role none."""
    if ctx.pd is None:
        return {"roleStatus": "RoleReady", "currentRole": "none"}, []
    state = ctx.pd.status()
    return state["service"], state["peers"]


async def status(ctx: Serving, request: Request) -> Response:
    service, peers = _role(ctx)
    return json_response({"service": service, "resource": _resources(ctx), "linkStatus": {"peers": peers}})


async def status_v2(ctx: Serving, request: Request) -> Response:
    r = _resources(ctx)
    r.update(totalAvailNpuSlotsNum=r["availSlotsNum"], totalAvailNpuBlockNum=r["availBlockNum"],
             maxAvailNpuBlockNum=r["availBlockNum"], dpInstMap={"0": r["availBlockNum"]})
    service, peers = _role(ctx)
    return json_response({"service": service, "resource": r, "linkStatus": {"peers": peers}})


async def slot_count(ctx: Serving, request: Request) -> Response:
    if request.path_params["model"] != ctx.settings.model_name:
        raise APIError(404, f"Model {request.path_params['model']} not found.", "model")
    r = _resources(ctx)
    return json_response({"total_slots": ctx.settings.engine.max_batch_size, "free_slots": r["availSlotsNum"],
                          "available_tokens_length": r["availBlockNum"] * ctx.settings.engine.block_size})


async def config(ctx: Serving, request: Request) -> Response:
    e = ctx.settings.engine
    return json_response({"modelName": ctx.settings.model_name, "maxSeqLen": e.max_seq_len, "npuMemSize": -1,
                          "cpuMemSize": 0, "worldSize": 1, "maxOutputLen": e.max_iter_times,
                          "cacheBlockSize": e.block_size})


async def metrics_json(ctx: Serving, request: Request) -> Response:
    instance = f"{ctx.settings.management_host}:{ctx.settings.management_port}"
    return json_response({"resultType": "vector", "result": [
        {"metric": [{"__name__": name, "job": "node", "instance": instance}], "value": str(value)}
        for name, value in ctx.metrics.summary(ctx.engine.stats).items()]})


async def metrics(ctx: Serving, request: Request) -> Response:
    return Response(ctx.metrics.prometheus_text(ctx.engine.stats),
                    media_type="text/plain; version=0.0.4; charset=utf-8")


async def stop_service(ctx: Serving, request: Request) -> Response:
    """Stops admitting, waits for every request in flight, answers 200, then the process stops
    itself (SIGTERM). `?mode=Force` kills it 5 s later whatever is running."""
    if ctx.draining:
        return Response(status_code=500)
    ctx.draining = True
    loop = asyncio.get_running_loop()
    if request.query_params.get("mode") == "Force":
        loop.call_later(5, os.kill, os.getpid(), signal.SIGKILL)
    while ctx.in_flight:
        await asyncio.sleep(0.1)
    loop.call_later(0.2, os.kill, os.getpid(), signal.SIGTERM)
    return Response(status_code=200)
