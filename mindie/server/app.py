"""The HTTP applications: one route table over the three planes (business, management,
metrics), the wrapper every route shares (body limit, validation and error shapes, API key),
and the OpenAPI document generated from the same request models that validate."""

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
from mindie.server.fields import Body, describe, validate
from mindie.server.handler import generation
from mindie.server.protocols import native, openai, openai_chat, openai_completions, openai_responses, tgi, triton, vllm
from mindie.server.protocols.base import Call, Renderer
from mindie.server.responses import error_response, json_response
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
    handler: Handler
    style: ErrorStyle = ErrorStyle.MINDIE
    body_model: type[Body] | None = None  # documents the body in /openapi.json
    summary: str = ""
    public: bool = False  # answered without the API key (a liveness probe)


class _GenerateProbe(Body):
    model_config = Body.model_config | {"strict": False}
    prompt: Any = None
    inputs: Any = None


async def parse_generate(ctx: Serving, body: bytes, path: Mapping[str, str]) -> tuple[Call, Renderer]:
    """POST /generate is vLLM's when the body has `prompt`, TGI's when it has `inputs`."""
    probe = validate(_GenerateProbe, body)
    if probe.prompt is not None:
        return await vllm.parse(ctx, body, path)
    if probe.inputs is not None:
        return await tgi.parse_generate(ctx, body, path)
    raise APIError(422, "`inputs` (TGI) or `prompt` (vLLM) is required and must be a string", "inputs")


class TokenizerRequest(Body):
    inputs: str
    do_decode: bool = True


async def mindie_tokenizer(ctx: Serving, request: Request, body: bytes) -> Response:
    req = validate(TokenizerRequest, body)
    if not req.inputs:
        raise APIError(422, "inputs must be a non-empty string", "inputs")
    ctx.check_text(req.inputs, "inputs")
    ids = ctx.tokenizer.encode(req.inputs)
    tokens: list[Any] = [ctx.tokenizer.decode([t], skip_special_tokens=False) for t in ids] if req.do_decode else ids
    return json_response({"token_number": len(ids), "tokens": tokens})


OAI, NAT = ErrorStyle.OPENAI, ErrorStyle.MINDIE
ROUTES: list[RouteSpec] = [
    RouteSpec(BUSINESS, "POST", "/infer", generation(native.parse), NAT, native.InferRequest,
              "MindIE native text generation"),
    RouteSpec(BUSINESS, "POST", "/infer_token", generation(native.parse), NAT, native.InferRequest,
              "MindIE native, token ids in"),
    RouteSpec(BUSINESS, "POST", "/generate", generation(parse_generate), NAT, tgi.TGIRequest,
              "TGI (inputs) or vLLM (prompt)"),
    RouteSpec(BUSINESS, "POST", "/generate_stream", generation(tgi.parse_generate_stream), NAT, tgi.TGIRequest,
              "TGI streaming"),
    RouteSpec(BUSINESS, "POST", "/", generation(tgi.parse_root), NAT, tgi.TGIRequest, "TGI root"),
    RouteSpec(BUSINESS, "POST", "/v1/chat/completions", generation(openai_chat.parse), OAI, openai_chat.ChatRequest,
              "OpenAI chat"),
    RouteSpec(BUSINESS, "POST", "/v1/completions", generation(openai_completions.parse), OAI,
              openai_completions.CompletionRequest, "OpenAI completions"),
    RouteSpec(BUSINESS, "POST", "/v1/responses", openai_responses.create_route(generation(openai_responses.parse)),
              OAI, openai_responses.ResponsesRequest, "OpenAI Responses"),
    RouteSpec(BUSINESS, "GET", "/v1/responses/{response_id}", openai_responses.get_response, OAI),
    RouteSpec(BUSINESS, "DELETE", "/v1/responses/{response_id}", openai_responses.delete_response, OAI),
    RouteSpec(BUSINESS, "POST", "/v2/models/{model}/generate", generation(triton.parse_generate), NAT,
              triton.TritonTextRequest, "Triton text generation"),
    RouteSpec(BUSINESS, "POST", "/v2/models/{model}/generate_stream", generation(triton.parse_generate_stream), NAT,
              triton.TritonTextRequest, "Triton streaming text generation"),
    RouteSpec(BUSINESS, "POST", "/v2/models/{model}/infer", generation(triton.parse_infer), NAT,
              triton.TritonTokenRequest, "Triton token tensors"),
    RouteSpec(BUSINESS, "POST", "/v2/models/{model}/stopInfer", triton.stop_infer, NAT, triton.StopRequest,
              "Cancel a request by id"),
    RouteSpec(BUSINESS, "POST", "/v1/tokenizer", mindie_tokenizer, NAT, TokenizerRequest, "MindIE tokenizer"),
    RouteSpec(BUSINESS, "POST", "/tokenize", vllm.tokenize, OAI, vllm.TokenizeRequest, "vLLM tokenize"),
    RouteSpec(BUSINESS, "POST", "/detokenize", vllm.detokenize, OAI, vllm.DetokenizeRequest, "vLLM detokenize"),
    RouteSpec(BUSINESS, "GET", "/tokenizer_info", vllm.tokenizer_info, OAI),
    RouteSpec(BUSINESS, "GET", "/v1/models", openai.list_models, OAI),
    RouteSpec(BUSINESS, "GET", "/v1/models/{model}", openai.get_model, OAI),
    RouteSpec(BUSINESS, "GET", "/v2", triton.server_metadata),
    RouteSpec(BUSINESS, "GET", "/v2/models/{model}", triton.model_metadata),
    RouteSpec(BUSINESS, "GET", "/v2/models/{model}/config", triton.model_config),
    # Load testers (guidellm) and proxies probe /health on the URL they are given, as vLLM and TGI
    # answer it on their API port: the business plane answers it too.
    RouteSpec(BUSINESS, "GET", "/health", management.health, public=True),
    # Scrapers and load tools (aiperf) read /metrics, and KServe clients probe health, on the URL
    # they are given.
    RouteSpec(BUSINESS, "GET", "/metrics", management.metrics, public=True),
    RouteSpec(BUSINESS, "GET", "/v2/health/live", management.live, public=True),
    RouteSpec(BUSINESS, "GET", "/v2/health/ready", management.ready, public=True),
    RouteSpec(BUSINESS, "GET", "/v2/models/{model}/ready", management.model_ready, public=True),
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
]


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed the limit (from
    Content-Length, or while it arrives), never buffered whole first."""
    too_big = APIError(413, f"Request body too large. Maximum allowed size is {limit // 2**20}MB.")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


def check_json_body(request: Request) -> None:
    """A POST body must be JSON, or say nothing of its type. The types a browser may send
    cross-site without a CORS preflight (form data, text/plain) are refused, so a page the user
    visits cannot drive the server."""
    if request.headers.get("inference-header-content-length") is not None:
        raise APIError(400, "the binary tensor extension is not supported: send the tensors as JSON "
                            "(tritonclient: binary_data=False on each InferInput and InferRequestedOutput)")
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media and media != "application/json" and not media.endswith("+json"):
        raise APIError(415, f"Content-Type must be application/json, got {media!r}", "Content-Type")


def _endpoint(ctx: Serving, spec: RouteSpec) -> Callable[[Request], Awaitable[Response]]:
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
                return await spec.handler(ctx, request, body)
            return await spec.handler(ctx, request)
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
        ctx.pd.routes = [dmi.GenerationRoute(spec.path, spec.handler.parse) for spec in ROUTES
                         if hasattr(spec.handler, "parse")]
    for spec in ROUTES + (DMI_ROUTES if ctx.pd is not None else []):
        routes.setdefault(address[spec.plane], []).append(Route(spec.path, _endpoint(ctx, spec), methods=[spec.method]))
    doc = openapi_document(ctx)

    async def openapi(request: Request) -> Response:
        return json_response(doc)

    routes[address[BUSINESS]].append(Route("/openapi.json", openapi, methods=["GET"]))
    known = list(routes[address[BUSINESS]])

    async def unknown_v1(request: Request) -> Response:
        """OpenAI clients read `error.message` of any failure under /v1/: no bare 404 there."""
        path = request.url.path
        if any(r.path_regex.match(path) for r in known):
            err = APIError(405, f"{request.method} is not allowed on {path}")
        else:
            err = APIError(404, f"no route {request.method} {path}; see /openapi.json for the routes")
        return error_response(err, ErrorStyle.OPENAI)

    # last: only what no route above matched in full
    routes[address[BUSINESS]].append(Route("/v1/{rest:path}", unknown_v1,
                                           methods=["GET", "POST", "PUT", "PATCH", "DELETE"]))
    middleware = [Middleware(RequestIdMiddleware),
                  Middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"])]
    return {addr: Starlette(routes=r, middleware=middleware) for addr, r in routes.items()}
