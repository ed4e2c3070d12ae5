"""The HTTP applications: one route table over the three planes (business, management,
metrics), the wrapper every route shares (body limit, validation and error shapes, API key),
and the OpenAPI document generated from the same request models that validate. The business
plane's API routes come from the families' own tables (protocols/families.py), as the
coordinator's predict plane does."""

from __future__ import annotations

import hmac
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mindie import __version__
from mindie.server import decode, dmi, management
from mindie.server.errors import APIError, ErrorStyle
from mindie.server.fields import Body, describe
from mindie.server.handler import generation
from mindie.server.http import check_json_body, error_response, json_response, read_body, unknown_route
from mindie.server.prefill import prefill
from mindie.server.protocols.base import Call, Renderer
from mindie.server.protocols.families import Served, served
from mindie.server.protocols.family import Kind, Parse, claimant
from mindie.server.serving import Serving
from mindie.server.streams import ClientGone, GenerationTimeout

log = logging.getLogger("mindie.server")

BUSINESS, MANAGEMENT, METRICS = "business", "management", "metrics"
INTERCOMM = "intercomm"  # P <-> D control calls on interCommPort, in inferMode dmi only
Handler = Callable[..., Awaitable[Response]]


@dataclass(frozen=True)
class RouteSpec:
    plane: str
    method: str
    path: str
    handler: Handler | None  # None for a generation route: its parse runs in the handler of the node's mode
    style: ErrorStyle = ErrorStyle.MINDIE
    body_model: type[Body] | None = None  # documents the body in /openapi.json
    summary: str = ""
    public: bool = False  # answered without the API key (a liveness probe)
    parse: Parse | None = None  # a generation route's family parse
    wrap: Callable[[Handler], Handler] | None = None  # what the family puts around the generation handler
    disaggregated: bool = True  # a generation route a prefill/decode pair can serve


def _parse(served: Served) -> Parse:
    """The family's parse; where families share the path, the one whose body this is."""
    if len(served.candidates) == 1:
        parse = served.candidates[0][1].parse
        assert parse is not None
        return parse

    async def parse_claimed(ctx: Serving, body: bytes, path: Mapping[str, str]) -> tuple[Call, Renderer]:
        _, route = claimant(list(served.candidates), body)
        assert route.parse is not None
        return await route.parse(ctx, body, path)

    return parse_claimed


def _family_route(served: Served) -> RouteSpec:
    routes = [route for _, route in served.candidates]
    generates = served.kind is Kind.GENERATE
    return RouteSpec(BUSINESS, served.method, served.path, None if generates else routes[0].handler, served.style,
                     routes[0].body_model, " / ".join(r.summary for r in routes if r.summary),
                     parse=_parse(served) if generates else None, wrap=routes[0].wrap,
                     disaggregated=all(r.disaggregated for r in routes))


def _handler(ctx: Serving, spec: RouteSpec) -> Handler:
    """A generation route runs the one generation handler, or on a prefill node P's flow (same
    parse, same renderer); the family's wrapper goes around either."""
    if spec.parse is None:
        assert spec.handler is not None
        return spec.handler
    parse = spec.parse
    if ctx.pd is not None:
        async def run(ctx: Serving, request: Request, body: bytes) -> Response:
            return await prefill(ctx, request, body, parse)
    else:
        run = generation(parse)
    return spec.wrap(run) if spec.wrap is not None else run


# Load testers (guidellm) and proxies probe /health on the URL they are given, as vLLM and TGI
# answer it on their API port; scrapers and load tools (aiperf) read /metrics, and KServe clients
# probe health there too: the business plane answers them, without the API key.
PROBES: list[RouteSpec] = [
    RouteSpec(BUSINESS, "GET", "/health", management.health, public=True),
    RouteSpec(BUSINESS, "GET", "/metrics", management.metrics, public=True),
    RouteSpec(BUSINESS, "GET", "/v2/health/live", management.live, public=True),
    RouteSpec(BUSINESS, "GET", "/v2/health/ready", management.ready, public=True),
    RouteSpec(BUSINESS, "GET", "/v2/models/{model}/ready", management.model_ready, public=True),
]
ROUTES: list[RouteSpec] = [_family_route(s) for s in served()] + PROBES + [
    RouteSpec(MANAGEMENT, "GET", "/health", management.health),
    RouteSpec(MANAGEMENT, "GET", "/health/timed", management.health_timed),
    RouteSpec(MANAGEMENT, "GET", "/health/timed-{seconds}", management.health_timed),
    RouteSpec(MANAGEMENT, "GET", "/v2/health/live", management.live),
    RouteSpec(MANAGEMENT, "GET", "/v2/health/ready", management.ready),
    RouteSpec(MANAGEMENT, "GET", "/v2/models/{model}/ready", management.model_ready),
    RouteSpec(MANAGEMENT, "GET", "/info", management.info),
    RouteSpec(MANAGEMENT, "GET", "/v2/models/{model}/getSlotCount", management.slot_count),
    RouteSpec(MANAGEMENT, "GET", "/metrics-json", management.metrics_json),
    RouteSpec(MANAGEMENT, "GET", "/v1/config", management.config),
    RouteSpec(MANAGEMENT, "GET", "/v1/status", management.status),
    RouteSpec(MANAGEMENT, "GET", "/v2/status", management.status_v2),
    RouteSpec(MANAGEMENT, "GET", "/stopService", management.stop_service),
    RouteSpec(METRICS, "GET", "/metrics", management.metrics),
    RouteSpec(BUSINESS, "GET", "/dresult", decode.dresult, summary="PD decode node: the record stream"),
    RouteSpec(MANAGEMENT, "POST", "/v1/role/{role}", dmi.set_role),
    RouteSpec(MANAGEMENT, "POST", "/v2/role/{role}", dmi.set_role),
]
DMI_ROUTES: list[RouteSpec] = [
    RouteSpec(INTERCOMM, "POST", "/pd/v1/decode", decode.decode),
    RouteSpec(INTERCOMM, "POST", "/pd/v1/release", dmi.release),
    RouteSpec(INTERCOMM, "POST", "/pd/v1/finished", dmi.finished),
]


def _endpoint(ctx: Serving, spec: RouteSpec) -> Callable[[Request], Awaitable[Response]]:
    handler = _handler(ctx, spec)
    guarded = spec.plane == BUSINESS and ctx.settings.api_key is not None and not spec.public
    expected = f"Bearer {ctx.settings.api_key}".encode() if guarded else b""

    async def endpoint(request: Request) -> Response:
        try:
            if guarded and not hmac.compare_digest(request.headers.get("authorization", "").encode(), expected):
                raise APIError(401, "a valid API key is required: send the header 'Authorization: Bearer <key>'",
                               headers={"WWW-Authenticate": "Bearer"})
            if spec.method == "POST":
                check_json_body(request)
                body = await read_body(request, ctx.settings.max_request_bytes)
                return await handler(ctx, request, body)
            return await handler(ctx, request)
        except APIError as exc:
            return error_response(exc.for_style(spec.style), spec.style)
        except ValidationError as exc:
            message, param = describe(exc)
            return error_response(APIError(422, message, param).for_style(spec.style), spec.style)
        except GenerationTimeout as exc:
            return error_response(APIError(500, str(exc)), spec.style)
        except (ClientGone, ClientDisconnect):
            return Response(status_code=499)  # nobody is listening any more
        except Exception:
            log.exception("unhandled error in %s %s", spec.method, spec.path)
            return error_response(APIError(500, "Server internal error"), spec.style)

    return endpoint


class RequestIdMiddleware:
    """Echoes X-Request-Id (or makes one) on every response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = next((v for k, v in scope["headers"] if k == b"x-request-id"), None) or uuid.uuid4().hex.encode()
        rid = rid[:128]

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", rid)]
            await send(message)

        await self.app(scope, receive, send_with_id)


def openapi_document(ctx: Serving | None = None) -> dict[str, Any]:
    from pydantic.json_schema import models_json_schema

    models = sorted({s.body_model for s in ROUTES if s.body_model is not None}, key=lambda m: m.__name__)
    refs, schema = models_json_schema([(m, "validation") for m in models], ref_template="#/components/schemas/{model}")
    paths: dict[str, Any] = {}
    for s in ROUTES:
        if s.plane != BUSINESS:
            continue
        op: dict[str, Any] = {"summary": s.summary or s.path, "responses": {"200": {"description": "OK"}}}
        params = [p.strip("{}") for p in s.path.split("/") if p.startswith("{")]
        if params:
            op["parameters"] = [{"name": p, "in": "path", "required": True, "schema": {"type": "string"}}
                                for p in params]
        if s.body_model is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": refs[(s.body_model, "validation")]}}}
        paths.setdefault(s.path, {})[s.method.lower()] = op
    return {"openapi": "3.1.0", "info": {"title": "MindIE-compatible server", "version": __version__},
            "paths": paths, "components": {"schemas": schema.get("$defs", {})}}


def build_apps(ctx: Serving) -> dict[tuple[str, int], Starlette]:
    """One Starlette app per distinct (host, port): the planes share a listener when their
    addresses coincide, as in MindIE."""
    s = ctx.settings
    address = {BUSINESS: (s.host, s.port), MANAGEMENT: (s.management_host, s.management_port),
               METRICS: (s.management_host, s.metrics_port), INTERCOMM: (s.host, s.inter_comm_port)}
    routes: dict[tuple[str, int], list[Route]] = {}
    if ctx.pd is not None:
        ctx.pd.routes = [dmi.GenerationRoute(spec.path, spec.parse) for spec in ROUTES
                         if spec.parse is not None and spec.disaggregated]
    for spec in ROUTES + (DMI_ROUTES if ctx.pd is not None else []):
        routes.setdefault(address[spec.plane], []).append(Route(spec.path, _endpoint(ctx, spec), methods=[spec.method]))
    doc = openapi_document(ctx)

    async def openapi(request: Request) -> Response:
        return json_response(doc)

    routes[address[BUSINESS]].append(Route("/openapi.json", openapi, methods=["GET"]))
    for plane_routes in routes.values():
        plane_routes.append(unknown_route(list(plane_routes)))  # last: only what no route above matched
    middleware = [Middleware(RequestIdMiddleware),
                  Middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"])]
    return {addr: Starlette(routes=r, middleware=middleware) for addr, r in routes.items()}
