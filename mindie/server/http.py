"""The HTTP plumbing the instance and the coordinator share: their listeners (uvicorn with a bound
on the request head, signals left to the launcher), the body limit, the JSON-only rule for POST
bodies, compact JSON and error responses in a family's shape, and the answer to a route nobody
serves."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import uvicorn
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from mindie.server.errors import APIError, ErrorStyle
from mindie.server.protocols.base import dumps

MAX_HEAD_BYTES = 64 * 1024  # request line + headers


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(dumps(obj).encode(), status_code=status, media_type="application/json")


def error_response(err: APIError, style: ErrorStyle) -> Response:
    err = err.for_style(style)
    return JSONResponse(err.body(style), status_code=err.status, headers=err.headers)


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


def unknown_route(known: Sequence[BaseRoute]) -> Route:
    """Last in a route list: what no route above matched in full gets a JSON 404 (or 405 where the
    path is served with another method), in OpenAI's shape under /v1/ (OpenAI clients read
    `error.message` of any failure there) and MindIE's elsewhere."""

    async def endpoint(request: Request) -> Response:
        path = request.url.path
        style = ErrorStyle.OPENAI if path.startswith("/v1/") else ErrorStyle.MINDIE
        if any(isinstance(r, Route) and r.path_regex.match(path) for r in known):
            return error_response(APIError(405, f"{request.method} is not allowed on {path}"), style)
        return error_response(APIError(404, f"no route {request.method} {path}; see /openapi.json for the routes"),
                              style)

    return Route("/{rest:path}", endpoint, methods=["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE"])


class Listener(uvicorn.Server):
    """A uvicorn server that leaves signals to the launcher (several listen in one process)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def listener(app: Any, host: str, port: int, **options: Any) -> Listener:
    return Listener(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                   http=LimitedHttpTools, lifespan="off", **options))


async def start(listeners: list[Listener]) -> tuple[list[asyncio.Future[None]], bool]:
    """Starts every listener; False when one could not (its port in use), the others then told to stop."""
    tasks = [asyncio.ensure_future(one.serve()) for one in listeners]
    await asyncio.sleep(0)
    while not all(one.started for one in listeners):
        if any(t.done() for t in tasks):
            for one in listeners:
                one.should_exit = True
            return tasks, False
        await asyncio.sleep(0.02)
    return tasks, True


class _HeadTooLarge(Exception):
    pass


class LimitedHttpTools(HttpToolsProtocol):
    """httptools with a bound on the request head: past MAX_HEAD_BYTES the client gets 431 and the
    connection closes (httptools itself buffers any size). A single header can still be buffered
    whole before it is counted, up to the coarse HEAD_GUARD_BYTES limit on bytes fed before the
    head completes."""

    HEAD_GUARD_BYTES = 8 * 2**20

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_bytes = 0  # exact: request line and headers of the current request
        self._head_fed = 0  # coarse: bytes received while its head is incomplete
        self._head_done = False
        self._too_large = False

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = 0

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._head_done = False

    def _count(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > MAX_HEAD_BYTES:
            self._too_large = True
            raise _HeadTooLarge()  # httptools turns it into a parser error: send_400_response

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._head_done, self._head_fed = True, 0
        super().on_headers_complete()

    def data_received(self, data: bytes) -> None:
        if not self._head_done:
            self._head_fed += len(data)
        if self._head_fed > self.HEAD_GUARD_BYTES:
            self._too_large = True
            self.send_400_response("")
            return
        super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        if not self._too_large:
            super().send_400_response(msg)
            return
        body = b'{"error": "request headers too large (limit 65536 bytes)", "error_type": "Bad Request"}'
        self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
                             b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)
        self.transport.close()
