"""The one handler every generation route runs, whatever its API family: parse the body into a
`Call` and a `Renderer`, start the call's engine requests, then answer one whole body or a stream
of events. A family decides only which parse and which renderer run. A prefill node runs its own
flow (server/prefill.py) with the same parse and renderer instead: server/app.py picks one per mode."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from mindie.server.errors import APIError
from mindie.server.http import json_response
from mindie.server.protocols.base import Renderer
from mindie.server.protocols.family import Parse
from mindie.server.results import Result
from mindie.server.serving import Serving
from mindie.server.streams import GenerationTimeout, OutputStream, merge


def generation(parse: Parse) -> Callable[[Serving, Request, bytes], Awaitable[Response]]:
    async def handle(ctx: Serving, request: Request, body: bytes) -> Response:
        call, renderer = await parse(ctx, body, request.path_params)
        # Both watch the client from the moment its requests are queued: one that gives up while
        # they wait for the engine aborts them before any step runs them.
        if not call.stream:
            return json_response(renderer.whole(await ctx.collect(request, call)))
        streams = await ctx.start_while_connected(request, call)
        return StreamingResponse(_events(streams, renderer), media_type=renderer.media_type,
                                 headers={"Cache-Control": "no-cache"})

    return handle


async def _events(streams: list[OutputStream], renderer: Renderer) -> AsyncIterator[bytes]:
    """An error after the response started (a timeout) cannot change the status any more: it
    becomes one last event in the family's framing. However the stream ends, including a client
    that goes away, the requests are closed, which aborts those unfinished."""
    results = [Result.empty(s.request_id, s.request.params) for s in streams]
    try:
        for chunk in renderer.begin(results):
            yield chunk
        async for k, item in merge(streams):
            results[k].add(item)
            for chunk in renderer.event(k, item, results):
                yield chunk
        for chunk in renderer.end(results):
            yield chunk
    except GenerationTimeout as exc:
        yield renderer.error(APIError(500, str(exc)))
    except APIError as exc:
        yield renderer.error(exc)
    finally:
        for s in streams:
            await s.aclose()
