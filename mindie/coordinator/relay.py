"""One inference request through the cluster (pd-disaggregation.md C.2): admit it, pick P and D,
send the client's path and body to P with the PD headers, read P's one-JSON reply, then answer
the client with P's output followed by D's `/dresult` records for it.

Limits and timeouts are MindIE's: 503 before the cluster is ready, 429 past `max_requests`, 408
past `schedule_timeout` (no P/D pair has room), `first_token_timeout` (P has not answered) or
`infer_timeout` (the whole request), all counted from arrival. Once a stream has started an error
cannot change its status any more: it becomes one last event in the family's framing. A client
that goes away, and a first-token or inference timeout, cancel the request on P and D. A request
D sends back for recompute (`retry:`) goes to a freshly scheduled pair under the same req-id; the
client sees one unbroken answer. A request whose D went away before anything reached the client
(a non-stream one) starts over on a fresh pair; a stream ends with an error event.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from mindie.coordinator.requests import State, Tracked
from mindie.coordinator.service import Coordinator
from mindie.pd.records import Record, RecordKind
from mindie.server.errors import APIError
from mindie.server.protocols.family import Family

log = logging.getLogger("mindie.coordinator")

T = TypeVar("T")

P_CONNECT_ATTEMPTS = 4  # MindIE's RequestRepeater tries to reach P four times
RECOMPUTE_RETRY_S = 1.0  # MindIE's RetryDuplicateReqIdHandler: a refused recompute goes again after 1 s
JSON = "application/json"
# Headers of the client's request that P needs to see as the client sent them.
_FORWARDED = ("content-type", "accept", "authorization")


class ClientGone(Exception):
    pass


class Failure(Exception):
    """Ends the request before anything was sent to the client: an error response."""

    def __init__(self, status: int, message: str, stop: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.stop = stop  # P or D may hold the request: cancel it there


@dataclass(frozen=True)
class PReply:
    is_stream: bool
    is_last: bool
    output: str


async def within(aw: Awaitable[T], seconds: float | None) -> T:
    """`await aw`, raising TimeoutError after `seconds` (None: no limit). Not asyncio.wait_for: on
    Python 3.11, cancelled just as `aw` completes, it returns the result instead of raising, and a
    relay cancelled because its client left went on streaming D's records to nobody, D running the
    request to its end (about one stream in ten, measured with 300 records a second)."""
    async with asyncio.timeout(seconds):
        return await aw


def error_response(family: Family, status: int, message: str) -> Response:
    return JSONResponse(family.error_body(APIError(status, message)), status_code=status)


class Relay:
    def __init__(self, coord: Coordinator, tracked: Tracked, family: Family, request: Request, body: bytes) -> None:
        self.coord = coord
        self.cfg = coord.config
        self.tracked = tracked
        self.family = family
        self.request = request
        self.body = body
        self._owned = True  # whoever ends the request calls `_end` once; a stream hands it to its response
        self.starts_over = 0

    def _deadline(self, seconds: float) -> float | None:
        return self.tracked.arrived + seconds if seconds > 0 else None

    def _remaining(self, deadline: float | None) -> float | None:
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    async def run(self) -> Response:
        try:
            reply = await self._watching_client(self._until_first_token())
            if reply.is_stream:
                self._owned = False
                return _RelayStream(self._events(reply), self._stream_ended)
            if reply.is_last:
                self.tracked.state = State.FINISH
                return Response(reply.output.encode(), media_type=JSON)
            return await self._watching_client(self._whole())
        except Failure as exc:
            self.tracked.state = State.TIMEOUT if exc.status == 408 else State.EXCEPTION
            if exc.stop:
                self.coord.stop_infer(self.tracked)
            return error_response(self.family, exc.status, exc.message)
        except _Forward as fwd:  # P's own error, passed on unchanged
            self.tracked.state = State.EXCEPTION
            return fwd.response
        except ClientGone:
            self._gone()
            return Response(status_code=499)
        finally:
            if self._owned:
                self.coord.finish(self.tracked)

    def _stream_ended(self, gone: bool) -> None:
        if gone:
            self._gone()
        self.coord.finish(self.tracked)

    def _gone(self) -> None:
        log.info("client of request %s went away: stopping it on P and D", self.tracked.req_id)
        self.tracked.state = State.EXCEPTION
        self.coord.stop_infer(self.tracked)

    async def _watching_client(self, work: Awaitable[T]) -> T:
        """`work`, unless the client disconnects first (ClientGone)."""
        task = asyncio.ensure_future(work)
        watcher = asyncio.ensure_future(_disconnected(self.request.receive))
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

    async def _until_first_token(self, again: bool = False) -> PReply:
        """Schedules the request and sends it to P. `again`: it starts over (its D went away
        before anything reached the client), so only the inference timeout still counts."""
        await self._schedule(since=time.monotonic() if again else None)
        ft, inf = self._deadline(self.cfg.first_token_timeout_s), self._deadline(self.cfg.infer_timeout_s)
        if again:
            ft = None
        first = min((d for d in (ft, inf) if d is not None), default=None)
        message = "Request first token timeout" if first == ft else "Request inference timeout"
        try:
            reply = await within(self._call_p(self.body), self._remaining(first))
        except TimeoutError:
            raise Failure(408, message, stop=True) from None
        self.tracked.state = State.FIRST_TOKEN_FINISH
        return reply

    async def _schedule(self, since: float | None = None) -> None:
        """Picks the request's P and D, waiting up to schedule_timeout (from arrival, or from
        `since` for a recompute) for a pair with room."""
        start = self.tracked.arrived if since is None else since
        deadline = start + self.cfg.schedule_timeout_s if self.cfg.schedule_timeout_s > 0 else None
        while True:
            pair = self.coord.scheduler.pick(self.family, self.body)
            if pair is not None:
                break
            try:
                await self.coord.wait_change(self._remaining(deadline))
            except TimeoutError:
                raise Failure(408, "Request schedule timeout") from None
        p, d = pair
        self.tracked.p, self.tracked.d = p, d
        p.in_flight.add(self.tracked.req_id)
        d.in_flight.add(self.tracked.req_id)
        self.tracked.state = State.SCHEDULED

    async def _call_p(self, body: bytes, recompute: bool = False) -> PReply:
        p, d = self.tracked.p, self.tracked.d
        assert p is not None and d is not None
        headers = {k: v for k in _FORWARDED if (v := self.request.headers.get(k)) is not None}
        headers.update({"req-id": self.tracked.req_id, "req-type": "prefill", "d-target": d.spec.d_target,
                        "d-port": str(d.spec.port)})
        if recompute:
            headers["is-recompute"] = "true"
        url = f"{p.business_url}{self.request.url.path}"
        timeout = httpx.Timeout(None, connect=self.cfg.http_timeout_s or None)  # the reply: first-token deadline
        self.tracked.state = State.REPEATED
        for attempt in range(P_CONNECT_ATTEMPTS):
            try:
                reply = await self.coord.client.post(url, content=body, headers=headers, timeout=timeout)
                break
            except httpx.ConnectError as exc:
                log.warning("cannot reach %s (attempt %d): %s", p.spec.name, attempt + 1, exc)
            except httpx.HTTPError as exc:  # sent, but the reply broke off: P is suspect until a poll answers
                log.warning("%s failed to answer request %s: %r", p.spec.name, self.tracked.req_id, exc)
                p.reachable = False
                self.coord.notify()
                raise Failure(500, "Receive messages from p instance failed", stop=True) from None
        else:
            p.reachable = False  # out of the schedule until its next status poll answers
            self.coord.notify()
            raise Failure(500, "Send messges to p instance failed")  # sic, MindIE's text
        if reply.status_code != 200:
            raise _Forward(Response(reply.content, status_code=reply.status_code,
                                    media_type=reply.headers.get("content-type")))
        return self._envelope(reply.content)

    def _envelope(self, content: bytes) -> PReply:
        """`{"reqId","isStream","isLastResp"?,"output"?}`; anything else is MindIE's "P instance error"."""
        try:
            obj = json.loads(content)
        except (ValueError, UnicodeDecodeError):
            obj = None
        ids = {self.tracked.req_id} | ({self.tracked.alias} if self.tracked.alias is not None else set())
        if (not isinstance(obj, dict) or obj.get("reqId") not in ids or not isinstance(obj.get("isStream"), bool)
                or not isinstance(obj.get("output", ""), str) or not isinstance(obj.get("isLastResp", False), bool)):
            log.error("P answered request %s with %r", self.tracked.req_id, content[:300])
            raise Failure(500, "P instance error", stop=True)
        return PReply(obj["isStream"], obj.get("isLastResp", False), obj.get("output", ""))

    async def _next_record(self) -> Record:
        deadline = self._deadline(self.cfg.infer_timeout_s)
        try:
            return await within(self.tracked.records.get(), self._remaining(deadline))
        except TimeoutError:
            raise Failure(408, "Request inference timeout", stop=True) from None

    def _unschedule(self) -> None:
        for inst in (self.tracked.p, self.tracked.d):
            if inst is not None:
                inst.in_flight.discard(self.tracked.req_id)
        self.coord.notify()

    async def _start_over(self, why: str) -> PReply:
        """The request's D went away before anything reached the client: it starts again on a
        freshly scheduled pair, under a new req-id (P may still hold a KV lease under the old
        one), at most max_retry times."""
        self.starts_over += 1
        if self.starts_over > self.cfg.max_retry:
            raise Failure(500, why)
        log.warning("request %s lost its D (%s): starting it over", self.tracked.req_id, why)
        self._unschedule()
        self.coord.table.rename(self.tracked)
        return await self._until_first_token(again=True)

    async def _recompute(self, body: bytes) -> PReply:
        """D preempted the request and sent it back rebuilt (pd-disaggregation.md A.6): the same
        req-id goes to a pair scheduled afresh, P told `is-recompute: true`. A P that refuses it
        (say, the req-id still held there) gets it again a second later, up to max_retry times."""
        self.tracked.state = State.RETRY
        self._unschedule()
        log.info("request %s was sent back by %s for recompute", self.tracked.req_id,
                 self.tracked.d.spec.name if self.tracked.d else "D")
        await self._schedule(since=time.monotonic())
        deadline = self._deadline(self.cfg.infer_timeout_s)
        refusals = 0
        while True:
            try:
                reply = await within(self._call_p(body, recompute=True), self._remaining(deadline))
                break
            except TimeoutError:
                raise Failure(408, "Request inference timeout", stop=True) from None
            except _Forward as refused:
                refusals += 1
                if refusals > self.cfg.max_retry:
                    raise Failure(500, f"P instance refused the recompute: {refused.text}") from None
                await asyncio.sleep(RECOMPUTE_RETRY_S)
        self.tracked.state = State.FIRST_TOKEN_FINISH
        return reply

    async def _whole(self) -> Response:
        """A non-stream request: D's one `lastData` record is the whole body."""
        while True:
            record = await self._next_record()
            if record.kind is RecordKind.RETRY:
                reply = await self._recompute(record.body)
                if reply.is_last:
                    self.tracked.state = State.FINISH
                    return Response(reply.output.encode(), media_type=JSON)
                continue
            if record.kind is RecordKind.LAST_DATA:
                self.tracked.state = State.FINISH
                return Response(record.body, media_type=JSON)
            if record.kind is RecordKind.DATA:
                log.warning("D sent a data record for non-stream request %s; waiting for lastData",
                            self.tracked.req_id)
                continue
            if record.kind is RecordKind.ERROR and self.tracked.d_lost:
                reply = await self._start_over(_terminal_text(record))
                if reply.is_last:
                    self.tracked.state = State.FINISH
                    return Response(reply.output.encode(), media_type=JSON)
                continue
            raise Failure(500, _terminal_text(record))

    async def _events(self, reply: PReply) -> AsyncIterator[bytes]:
        """The stream: P's output, then D's records in the order D sent them (those that arrived
        before P's reply waited in the request's queue); after a recompute, the new P's output
        (only the events after those already sent) and then its D's records."""
        while True:
            if reply.output:
                yield reply.output.encode()
            if reply.is_last:
                self.tracked.state = State.FINISH
                return
            while True:
                try:
                    record = await self._next_record()
                    if record.kind is RecordKind.RETRY:
                        reply = await self._recompute(record.body)
                        break
                except Failure as exc:
                    self.tracked.state = State.TIMEOUT if exc.status == 408 else State.EXCEPTION
                    if exc.stop:
                        self.coord.stop_infer(self.tracked)
                    yield self.family.error_event(APIError(exc.status, exc.message))
                    return
                if record.kind not in (RecordKind.DATA, RecordKind.LAST_DATA):
                    self.tracked.state = State.EXCEPTION
                    yield self.family.error_event(APIError(500, _terminal_text(record)))
                    return
                yield record.body
                if record.kind is RecordKind.LAST_DATA:
                    self.tracked.state = State.FINISH
                    return


def _terminal_text(record: Record) -> str:
    return record.body.decode("utf-8", "replace")


class _Forward(Exception):
    """P answered with its own error: passed on to the client unchanged."""

    def __init__(self, response: Response) -> None:
        self.response = response
        self.text = bytes(response.body).decode("utf-8", "replace")[:300]


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class _RelayStream(Response):
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
