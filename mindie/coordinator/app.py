"""The coordinator's four listeners (Coordinator.cpp): predict (every route of an instance's
business plane, from the same family tables: generation through P and D, the rest from an
instance in service, stopInfer and the probes its own), manage (instances online/offline/refresh,
query_tasks, coordinator_info), status (startup, health and readiness probes) and external
(`/metrics`)."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable

import httpx
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mindie.coordinator.config import Role
from mindie.coordinator.metrics import MetricsAggregator
from mindie.coordinator.relay import Relay
from mindie.coordinator.requests import DuplicateRequestId
from mindie.coordinator.service import Coordinator
from mindie.server.errors import APIError, ErrorStyle
from mindie.server.fields import describe, validate
from mindie.server.http import check_json_body, error_response, read_body, unknown_route
from mindie.server.protocols.families import Served
from mindie.server.protocols.families import served as served_routes
from mindie.server.protocols.family import Kind, claimant
from mindie.server.protocols.triton import StopRequest

log = logging.getLogger("mindie.coordinator")

Endpoint = Callable[[Request], Awaitable[Response]]


async def _client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)  # it went away while sending its body: nobody reads this


def _app(routes: list[Route]) -> Starlette:
    return Starlette(routes=[*routes, unknown_route(routes)], exception_handlers={ClientDisconnect: _client_gone})


async def _post_body(coord: Coordinator, request: Request) -> bytes:
    check_json_body(request)
    return await read_body(request, coord.config.body_limit_bytes)


def _inference(coord: Coordinator, served: Served) -> Endpoint:
    """Through a prefill and a decode instance (relay.py)."""

    async def endpoint(request: Request) -> Response:
        try:
            body = await _post_body(coord, request)
            family, _ = claimant(list(served.candidates), body) if len(served.candidates) > 1 else served.candidates[0]
        except APIError as exc:
            return error_response(exc, served.style)
        if not coord.registry.ready:
            return error_response(APIError(503, "MindIE-MS Coordinator is not ready"), family.style)
        if len(coord.table) >= coord.config.max_requests:
            return error_response(APIError(429, "Too many requests"), family.style)
        try:
            tracked = coord.table.add(alias=family.named_by_client(body))
        except DuplicateRequestId as exc:
            return error_response(APIError(400, f"Duplicate request id {exc}"), family.style)
        return await Relay(coord, tracked, family, request, body).run()

    return endpoint


# What the coordinator passes on to an instance, both ways.
_REQUEST_HEADERS = ("content-type", "accept", "authorization")
_REPLY_HEADERS = ("content-type", "www-authenticate")


def _forward(coord: Coordinator, style: ErrorStyle) -> Endpoint:
    """Answered by any instance in service, in turn: model, server and tokenizer facts are the
    same on each, and what one process keeps (a stored response) is kept by none in a cluster."""
    turn = 0

    async def endpoint(request: Request) -> Response:
        nonlocal turn
        try:
            body = await _post_body(coord, request) if request.method == "POST" else b""
            ready = [i for i in coord.registry.instances.values() if i.schedulable]
            if not ready:
                raise APIError(503, "MindIE-MS Coordinator is not ready")
            inst = ready[turn % len(ready)]
            turn += 1
            url = f"{inst.business_url}{request.url.path}"
            headers = {k: v for k in _REQUEST_HEADERS if (v := request.headers.get(k)) is not None}
            try:
                reply = await coord.client.request(request.method, url, params=request.query_params, content=body,
                                                   headers=headers, timeout=coord.config.tokenizer_timeout_s or None)
            except httpx.TimeoutException:
                raise APIError(408, f"{inst.spec.name} did not answer {request.method} {request.url.path} in time"
                               ) from None
            except httpx.HTTPError as exc:
                raise APIError(502, f"{inst.spec.name} could not be reached: {type(exc).__name__}") from None
        except APIError as exc:
            return error_response(exc, style)
        return Response(reply.content, status_code=reply.status_code,
                        headers={k: v for k in _REPLY_HEADERS if (v := reply.headers.get(k)) is not None})

    return endpoint


def _stop_infer(coord: Coordinator) -> Endpoint:
    """A client cancels its own request by the id it knows (a Triton `id`, or the req-id): the
    coordinator holds the requests, so it answers itself."""

    async def endpoint(request: Request) -> Response:
        try:
            rid = validate(StopRequest, await _post_body(coord, request)).id
            tracked = coord.table.get(rid)
            if tracked is None:
                raise APIError(404, f"RequestId is {rid} not found.", "id")
        except APIError as exc:
            return error_response(exc, ErrorStyle.MINDIE)
        except ValidationError as exc:
            return error_response(APIError(422, *describe(exc)), ErrorStyle.MINDIE)
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


def predict_app(coord: Coordinator, metrics: Endpoint) -> Starlette:
    """Every route an instance's business plane answers, from the same family tables; health and
    metrics from the coordinator's own view."""
    routes = []
    for served in served_routes():
        if served.kind is Kind.GENERATE and all(r.disaggregated for _, r in served.candidates):
            endpoint = _inference(coord, served)
        elif served.path == "/v2/models/{model}/stopInfer":
            endpoint = _stop_infer(coord)
        else:
            endpoint = _forward(coord, served.style)
        routes.append(Route(served.path, endpoint, methods=[served.method]))
    alive, ready = _probes(coord)
    ready_forwarded = _forward(coord, ErrorStyle.MINDIE)

    async def model_ready(request: Request) -> Response:
        """Ready, and the model is the one the instances serve (they know its name)."""
        return await ready_forwarded(request) if coord.registry.ready else await ready(request)

    return _app([*routes,
                 Route("/health", ready, methods=["GET"]), Route("/v2/health/live", alive, methods=["GET"]),
                 Route("/v2/health/ready", ready, methods=["GET"]),
                 Route("/v2/models/{model}/ready", model_ready, methods=["GET"]),
                 Route("/metrics", metrics, methods=["GET"]),
                 Route("/openapi.json", _forward(coord, ErrorStyle.MINDIE), methods=["GET"])])


def _probes(coord: Coordinator) -> tuple[Endpoint, Endpoint]:
    """MindIE's probes answer with a status and no body: alive while the process runs, ready while
    one prefill and one decode instance are in service."""

    async def alive(request: Request) -> Response:
        return Response(status_code=200)

    async def ready(request: Request) -> Response:
        if coord.registry.ready:
            return Response(status_code=200)
        return error_response(APIError(503, "MindIE-MS Coordinator is not ready"), ErrorStyle.MINDIE)

    return alive, ready


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
    alive, ready = _probes(coord)
    return _app([
        Route("/v1/startup", alive, methods=["GET"]),
        Route("/v1/health", alive, methods=["GET"]),
        Route("/v1/readiness", ready, methods=["GET"]),
        Route("/v2/health/live", alive, methods=["GET"]),
        Route("/v2/health/ready", ready, methods=["GET"]),
        Route("/v2/models/{model}/ready", ready, methods=["GET"]),
    ])


def _metrics(coord: Coordinator) -> Endpoint:
    aggregator = MetricsAggregator(coord.client, list(coord.registry.instances.values()),
                                   coord.config.metrics_reuse_s)

    async def metrics(request: Request) -> Response:
        return Response(await aggregator.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return metrics


def build_apps(coord: Coordinator) -> dict[tuple[str, int], Starlette]:
    c = coord.config
    metrics = _metrics(coord)
    return {(c.predict_ip, c.predict_port): predict_app(coord, metrics),
            (c.manage_ip, c.manage_port): manage_app(coord), (c.manage_ip, c.status_port): status_app(coord),
            (c.manage_ip, c.external_port): _app([Route("/metrics", metrics, methods=["GET"])])}
