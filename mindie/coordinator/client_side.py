"""The client's end of a relayed request: noticing that the client went away (while the relay waits
on P, or on D's next record, not only when a write to it fails), and the streamed response."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

log = logging.getLogger("mindie.coordinator")

T = TypeVar("T")


class ClientGone(Exception):
    pass


async def watching_client(receive: Receive, work: Awaitable[T]) -> T:
    """`work`, unless the client disconnects first (ClientGone)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class RelayStream(Response):
    """A streamed response that notices a client going away while it waits for the next record
    (not only when a write fails) and stops writing; `on_end(gone)` runs once however it ends."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], on_end: Callable[[bool], None]) -> None:
        self.events = events
        self.on_end = on_end
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        writer = asyncio.ensure_future(self._write(send))
        watcher = asyncio.ensure_future(_disconnected(receive))
        await asyncio.wait({writer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        gone = watcher.done() and not writer.done()
        writer.cancel()
        watcher.cancel()
        results = await asyncio.gather(writer, watcher, return_exceptions=True)
        if isinstance(results[0], Exception) and not isinstance(results[0], OSError):
            log.error("relaying a stream failed", exc_info=results[0])
        await _close(self.events)
        self.on_end(gone or isinstance(results[0], OSError))

    async def _write(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.events:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _close(events: AsyncIterator[Any]) -> None:
    aclose = getattr(events, "aclose", None)
    if aclose is not None:
        await aclose()
