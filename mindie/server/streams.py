"""A request's engine outputs as the server reads them: the client's and the server's deadlines
applied, the request aborted when its reader stops early, several requests merged into one
sequence, and a client that disconnects noticed while a whole response is being folded."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from typing import TYPE_CHECKING, Any, TypeVar

from starlette.requests import Request

from mindie.engine.request import EngineRequest, RequestOutput
from mindie.server.errors import APIError
from mindie.server.protocols.base import Call
from mindie.server.results import StreamItem

if TYPE_CHECKING:
    from mindie.server.serving import Serving

T = TypeVar("T")


class GenerationTimeout(Exception):
    """The spec's "Engine callback timeout: <who>" (500 before a response started)."""

    def __init__(self, who: str) -> None:
        super().__init__(f"Engine callback timeout: {who}")


class ClientGone(Exception):
    pass


class OutputStream:
    """The engine's outputs for one admitted request with the server's deadlines applied: the
    call's `timeout` and `e2eTimeout` from arrival, `tokenTimeout` per output when streaming (for
    the whole wait otherwise, as MindIE). Closing it early aborts the request in the engine;
    however it ends, the server forgets the request."""

    def __init__(self, serving: Serving, request: EngineRequest, call: Call,
                 outputs: AsyncIterator[RequestOutput], continued: bool = False) -> None:
        """`continued`: the request's first output was produced elsewhere (a PD prefill node),
        so the first one here is timed as a decode step."""
        self.serving = serving
        self.request = request
        self.call = call
        self._outputs = outputs
        self._start = time.monotonic()
        self._last: dict[int, float] = {0: self._start} if continued else {}
        self._first_token_s: float | None = None
        self._num_tokens = 0
        self.done = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def __aiter__(self) -> OutputStream:
        return self

    def _deadline(self, now: float) -> tuple[float, str]:
        s = self.serving.settings
        token_from = now if self.call.stream else self._start
        limits = [(token_from + s.token_timeout_s, "server tokenTimeout"), (self._start + s.e2e_timeout_s,
                                                                               "server e2eTimeout")]
        if self.call.timeout_s is not None:
            limits.append((self._start + self.call.timeout_s, "client timeout"))
        return min(limits)

    async def __anext__(self) -> StreamItem:
        try:
            return await self._next()
        except BaseException:
            self.serving.forget(self.request_id)
            raise

    async def _next(self) -> StreamItem:
        if self.done:
            raise StopAsyncIteration
        now = time.monotonic()
        deadline, who = self._deadline(now)
        try:
            async with asyncio.timeout_at(asyncio.get_running_loop().time() + max(0.0, deadline - now)):
                out = await anext(self._outputs)  # a timeout context, unlike wait_for, costs no task
        except TimeoutError:
            self.done = True
            self.serving.metrics.failed()
            raise GenerationTimeout(who) from None
        except RuntimeError as exc:  # the engine failed the step: this request is lost, say so
            self.done = True
            self.serving.metrics.failed()
            raise APIError(500, f"the engine failed while generating: {type(exc).__name__}") from None
        except StopAsyncIteration:
            self.done = True
            raise
        now = time.monotonic()
        prev = self._last.get(out.index)
        self._last[out.index] = now
        self._num_tokens += len(out.new_token_ids)
        if self._first_token_s is None and out.new_token_ids:
            self._first_token_s = now - self._start
        if out.request_done:
            self.done = True
            self.serving.metrics.finished(out, self._num_tokens, self._first_token_s, now - self._start)
        if prev is None:
            return StreamItem(out, (now - self._start) * 1e3 if out.new_token_ids else None, None)
        return StreamItem(out, None, (now - prev) * 1e3)

    async def aclose(self) -> None:
        try:
            if not self.done:
                self.done = True
                self.serving.metrics.failed()
                await self._outputs.aclose()  # type: ignore[attr-defined]
        finally:
            self.serving.forget(self.request_id)


async def merge(streams: list[OutputStream]) -> AsyncIterator[tuple[int, StreamItem]]:
    """Items of several requests as they come, tagged with the request's position."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, StreamItem | BaseException | None]] = asyncio.Queue()

    async def pump(k: int, s: OutputStream) -> None:
        try:
            async for item in s:
                queue.put_nowait((k, item))
            queue.put_nowait((k, None))
        except BaseException as exc:  # handed to the consumer, which re-raises it
            queue.put_nowait((k, exc))

    tasks = [asyncio.ensure_future(pump(k, s)) for k, s in enumerate(streams)]
    try:
        live = len(streams)
        while live:
            k, item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield k, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            await s.aclose()


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Awaits `work`, unless the client disconnects first: then the work is cancelled and
    ClientGone raised. Cancelled, the work aborts the engine requests it started or was still
    waiting for the engine to take (`Serving.start`, `AsyncEngine.add_request`)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _disconnected(request: Request) -> None:
    while True:
        message: Any = await request.receive()
        if message["type"] == "http.disconnect":
            return
