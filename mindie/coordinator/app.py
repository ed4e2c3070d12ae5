"""The coordinator's four listeners (Coordinator.cpp): predict (the inference routes, the tokenizer
and stopInfer), manage (instances online/offline/refresh, query_tasks, coordinator_info), status
(startup, health and readiness probes) and external (`/metrics`)."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable

import httpx
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mindie.coordinator.config import Role
from mindie.coordinator.families import INFERENCE_ROUTES, NATIVE, Family, family_of, triton_id
from mindie.coordinator.metrics import MetricsAggregator
from mindie.coordinator.relay import Relay, error_response
from mindie.coordinator.requests import DuplicateRequestId
from mindie.coordinator.service import Coordinator

log = logging.getLogger("mindie.coordinator")

Endpoint = Callable[[Request], Awaitable[Response]]


class _TooLarge(Exception):
    pass


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _TooLarge()
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _TooLarge()
        chunks.append(chunk)
    return b"".join(chunks)


async def _client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)  # it went away while sending its body: nobody reads this


def _app(routes: list[Route]) -> Starlette:
    return Starlette(routes=routes, exception_handlers={ClientDisconnect: _client_gone})


def _too_large(family: Family, limit: int) -> Response:
    return error_response(family, 413, f"Request body too large. Maximum allowed size is {limit // 2**20}MB.")


def _inference(coord: Coordinator, route_family: Family | None) -> Endpoint:
    async def endpoint(request: Request) -> Response:
        limit = coord.config.body_limit_bytes
        try:
            body = await _read_body(request, limit)
        except _TooLarge:
            return _too_large(route_family or NATIVE, limit)
        family = family_of(route_family, body)
        if not coord.registry.ready:
            return error_response(family, 503, "MindIE-MS Coordinator is not ready")
        if len(coord.table) >= coord.config.max_requests:
            return error_response(family, 429, "Too many requests")
        try:
            tracked = coord.table.add(alias=triton_id(family, body))
        except DuplicateRequestId as exc:
            return error_response(family, 400, f"Duplicate request id {exc}")
        return await Relay(coord, tracked, family, request, body).run()

    return endpoint


def _tokenizer(coord: Coordinator) -> Endpoint:
    """Not a PD request: any instance that holds its role tokenizes it."""
    turn = 0

    async def endpoint(request: Request) -> Response:
        nonlocal turn
        limit = coord.config.body_limit_bytes
        try:
            body = await _read_body(request, limit)
        except _TooLarge:
            return _too_large(NATIVE, limit)
        ready = [i for i in coord.registry.instances.values() if i.schedulable]
        if not ready:
            return error_response(NATIVE, 503, "MindIE-MS Coordinator is not ready")
        inst = ready[turn % len(ready)]
        turn += 1
        timeout = coord.config.tokenizer_timeout_s or None
        try:
            reply = await coord.client.post(f"{inst.business_url}/v1/tokenizer", content=body, timeout=timeout,
                                            headers={"content-type": request.headers.get("content-type", "")})
        except httpx.TimeoutException:
            return error_response(NATIVE, 408, "Request tokenizer timeout")
        except httpx.HTTPError:
            return error_response(NATIVE, 500, "Send messges to tokenizer instance failed")
        return Response(reply.content, status_code=reply.status_code, media_type=reply.headers.get("content-type"))

    return endpoint


def _stop_infer(coord: Coordinator) -> Endpoint:
    """A client cancels its own request by the id it knows (a Triton `id`, or the req-id)."""

    async def endpoint(request: Request) -> Response:
        try:
            body = json.loads(await _read_body(request, coord.config.body_limit_bytes))
        except (_TooLarge, ValueError, UnicodeDecodeError):
            return error_response(NATIVE, 422, "Req body converts to json fail.")
        rid = body.get("id") if isinstance(body, dict) else None
        if not isinstance(rid, str) or not rid:
            return error_response(NATIVE, 422, "id must be a non-empty string")
        tracked = coord.table.get(rid)
        if tracked is None:
            return error_response(NATIVE, 404, f"RequestId is {rid} not found.")
        coord.stop_infer(tracked)
        return JSONResponse({"id": rid})

    return endpoint


def _ids(body: bytes) -> list[int]:
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise ValueError("the body must be JSON: {\"ids\": [instance ids]}") from None
    ids = parsed.get("ids") if isinstance(parsed, dict) else None
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError("ids must be a list of instance ids (integers)")
    return ids


def _bad(message: str, field: str | None = None) -> Response:
    return JSONResponse({"error": message, "error_type": "Bad Request", **({"field": field} if field else {})},
                        status_code=400)


def predict_app(coord: Coordinator) -> Starlette:
    routes = [Route(path, _inference(coord, family), methods=["POST"]) for path, family in INFERENCE_ROUTES]
    routes.append(Route("/v1/tokenizer", _tokenizer(coord), methods=["POST"]))
    routes.append(Route("/v2/models/{model}/stopInfer", _stop_infer(coord), methods=["POST"]))
    return _app(routes)


def manage_app(coord: Coordinator) -> Starlette:
    registry = coord.registry

    def switch(online: bool) -> Endpoint:
        async def endpoint(request: Request) -> Response:
            try:
                ids = _ids(await request.body())
            except ValueError as exc:
                return _bad(str(exc), "ids")
            unknown = [i for i in ids if i not in registry.instances]
            if unknown:
                return _bad(f"no instance has id {unknown[0]}", "ids")
            for i in ids:
                registry.instances[i].online = online
                log.info("%s is %s", registry.instances[i].spec.name, "online" if online else "offline")
            registry.changed()
            return Response(status_code=200)

        return endpoint

    async def refresh(request: Request) -> Response:
        """MindIE's controller pushes its instance list; ours is static, so the body must name
        the same instances. Their `dynamic_info` free slots and blocks are taken in."""
        try:
            parsed = json.loads(await request.body())
            ids = parsed["ids"]
            instances = parsed["instances"]
        except (ValueError, UnicodeDecodeError, KeyError, TypeError):
            return _bad("the body must be JSON with `ids` and `instances`", "ids")
        if not isinstance(ids, list) or set(ids) != set(registry.instances):
            return _bad("this coordinator's instances are the static `instances` of its ms_coordinator.json: "
                        f"`ids` must be {sorted(registry.instances)}", "ids")
        if not isinstance(instances, list):
            return _bad("instances must be a list", "instances")
        updates = []
        for k, entry in enumerate(instances):
            entry_id = entry.get("id") if isinstance(entry, dict) else None
            inst = registry.instances.get(entry_id) if isinstance(entry_id, int) else None
            if inst is None:
                return _bad(f"instances[{k}].id must be one of {sorted(registry.instances)}", f"instances[{k}].id")
            dynamic = entry.get("dynamic_info", {})
            slots, blocks = (dynamic.get("avail_slots_num"), dynamic.get("avail_block_num")) if isinstance(
                dynamic, dict) else (None, None)
            if "dynamic_info" in entry and not (isinstance(slots, int) and isinstance(blocks, int)):
                return _bad(f"instances[{k}].dynamic_info needs integer avail_slots_num and avail_block_num",
                            f"instances[{k}].dynamic_info")
            if "dynamic_info" in entry:
                updates.append((inst, slots, blocks))
        for inst, slots, blocks in updates:
            inst.avail_slots, inst.avail_blocks, inst.assigned_since_poll = slots, blocks, 0
        return Response(status_code=200)

    async def info(request: Request) -> Response:
        return JSONResponse({
            "schedule_info": [i.describe() for i in registry.instances.values()],
            "request_num": len(coord.table), "request_arrived_total": coord.table.arrived_total,
            "ready": registry.ready, "algorithm_type": coord.config.algorithm,
        })

    async def query_tasks(request: Request) -> Response:
        try:
            parsed = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError):
            return _bad("the body must be JSON: {\"p_id\", \"d_id\"}")
        for key, role in (("p_id", Role.PREFILL), ("d_id", Role.DECODE)):
            value = parsed.get(key) if isinstance(parsed, dict) else None
            inst = registry.instances.get(value) if isinstance(value, int) else None
            if inst is None or inst.role is not role:
                return _bad(f"{key} must be the id of a {role.value} instance, got {value!r}", key)
        p, d = registry.instances[parsed["p_id"]], registry.instances[parsed["d_id"]]
        busy = any(t.p is p and t.d is d for t in coord.table)
        return JSONResponse({"is_end": not busy})

    return _app([
        Route("/v1/instances/refresh", refresh, methods=["POST"]),
        Route("/v1/instances/online", switch(True), methods=["POST"]),
        Route("/v1/instances/offline", switch(False), methods=["POST"]),
        Route("/v1/coordinator_info", info, methods=["GET"]),
        Route("/v1/instances/query_tasks", query_tasks, methods=["POST"]),
    ])


def status_app(coord: Coordinator) -> Starlette:
    """MindIE's probes answer with a status and no body."""

    async def alive(request: Request) -> Response:
        return Response(status_code=200)

    async def ready(request: Request) -> Response:
        return Response(status_code=200 if coord.registry.ready else 503)

    return _app([
        Route("/v1/startup", alive, methods=["GET"]),
        Route("/v1/health", alive, methods=["GET"]),
        Route("/v1/readiness", ready, methods=["GET"]),
        Route("/v2/health/live", alive, methods=["GET"]),
        Route("/v2/health/ready", ready, methods=["GET"]),
        Route("/v2/models/{model}/ready", ready, methods=["GET"]),
    ])


def external_app(coord: Coordinator) -> Starlette:
    aggregator = MetricsAggregator(coord.client, list(coord.registry.instances.values()),
                                   coord.config.metrics_reuse_s)

    async def metrics(request: Request) -> Response:
        return Response(await aggregator.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return _app([Route("/metrics", metrics, methods=["GET"])])


def build_apps(coord: Coordinator) -> dict[tuple[str, int], Starlette]:
    c = coord.config
    return {(c.predict_ip, c.predict_port): predict_app(coord), (c.manage_ip, c.manage_port): manage_app(coord),
            (c.manage_ip, c.status_port): status_app(coord), (c.manage_ip, c.external_port): external_app(coord)}
