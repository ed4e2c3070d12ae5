"""One inference request through the cluster (pd-disaggregation.md C.2): admit it, pick P and D,
send the client's path and body to P with the PD headers, read P's one-JSON reply, then answer
the client with P's output followed by D's `/dresult` records for it.

Limits and timeouts are MindIE's: 503 before the cluster is ready, 429 past `max_requests`, 408
past `schedule_timeout` (no P/D pair has room), `first_token_timeout` (P has not answered) or
`infer_timeout` (the whole request), all counted from arrival. Once a stream has started an error
cannot change its status any more: it becomes one last event in the family's framing. A client
that goes away, and a first-token or inference timeout, cancel the request on P and D. A request
D sends back for recompute (`retry:`) goes to a freshly scheduled pair under the same req-id; the
client sees one unbroken answer.

A request of which nothing has reached the client yet starts over on a freshly scheduled pair, at
most `max_retry` times, stream or not: when P could not hand it to its D (P's 500 `Send D request
failed`: D refused the call, or the connection to it was refused or reset), or its D went away
before P answered, or P answered while D's `/dresult` was down and D turned out gone (a non-stream
request: before D's whole answer). A D that P could not reach leaves the schedule until its status
poll answers again. Once something has reached the client, a D that goes away ends the stream with
an error event.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TypeVar

import httpx
from starlette.requests import Request
from starlette.responses import Response

from mindie.coordinator.client_side import ClientGone, RelayStream, watching_client
from mindie.coordinator.instances import Instance
from mindie.coordinator.requests import State, Tracked
from mindie.coordinator.service import Coordinator
from mindie.pd.media import retry_names_held_media
from mindie.pd.records import Record, RecordKind
from mindie.server.errors import APIError
from mindie.server.http import error_response
from mindie.server.protocols.family import Family

log = logging.getLogger("mindie.coordinator")

T = TypeVar("T")

P_CONNECT_ATTEMPTS = 4  # MindIE's RequestRepeater tries to reach P four times
RECOMPUTE_RETRY_S = 1.0  # MindIE's RetryDuplicateReqIdHandler: a refused recompute goes again after 1 s
JSON = "application/json"
MEDIA_GONE = 410  # P no longer holds a recompute's media (pd/media.py): asking it again cannot help
HAND_OFF_FAILED = b"Send D request failed"  # in P's 500 when it could not hand the request to D (spec A.2)
# Headers of the client's request that P needs to see as the client sent them.
_FORWARDED = ("content-type", "accept", "authorization")


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
        self.started_over_at: float | None = None

    def _deadline(self, seconds: float) -> float | None:
        return self.tracked.arrived + seconds if seconds > 0 else None

    def _remaining(self, deadline: float | None) -> float | None:
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    async def run(self) -> Response:
        try:
            reply = await watching_client(self.request.receive, self._until_first_token())
            if reply.is_stream:
                self._owned = False
                return RelayStream(self._events(reply), self._stream_ended)
            if reply.is_last:
                self.tracked.state = State.FINISH
                return Response(reply.output.encode(), media_type=JSON)
            return await watching_client(self.request.receive, self._whole())
        except Failure as exc:
            self.tracked.state = State.TIMEOUT if exc.status == 408 else State.EXCEPTION
            if exc.stop:
                self.coord.stop_infer(self.tracked)
            return error_response(APIError(exc.status, exc.message), self.family.style)
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

    async def _until_first_token(self) -> PReply:
        """Schedules the request and sends it to P, until P has answered for a pair whose D is
        still there. After a start over only the inference timeout counts (the new pair's prefill
        has not even begun), and the schedule timeout from the start over."""
        while True:
            await self._schedule(since=self.started_over_at)
            ft = self._deadline(self.cfg.first_token_timeout_s) if self.started_over_at is None else None
            inf = self._deadline(self.cfg.infer_timeout_s)
            first = min((d for d in (ft, inf) if d is not None), default=None)
            message = "Request first token timeout" if first == ft else "Request inference timeout"
            try:
                reply = await within(self._call_p(self.body), self._remaining(first))
            except TimeoutError:
                raise Failure(408, message, stop=True) from None
            except _Forward as refused:
                if not refused.hand_off_failed:
                    raise
                self._d_failed()
                self._start_over(f"P could not hand it to D: {refused.text}", refused)
                continue
            if not reply.is_last:
                await self._d_heard_from()
                if self.tracked.d_lost:
                    lost = self.tracked.d.spec if self.tracked.d else None
                    why = f"D instance {lost.ip}:{lost.port} went away" if lost else "its D went away"
                    self._start_over(why, Failure(500, why))
                    continue
            self.tracked.state = State.FIRST_TOKEN_FINISH
            return reply

    async def _schedule(self, since: float | None = None, prefer_p: Instance | None = None) -> None:
        """Picks the request's P and D, waiting up to schedule_timeout (from arrival, or from
        `since` for a recompute or a start over) for a pair with room; `prefer_p` when it has room."""
        start = self.tracked.arrived if since is None else since
        deadline = start + self.cfg.schedule_timeout_s if self.cfg.schedule_timeout_s > 0 else None
        while True:
            pair = self.coord.scheduler.pick(self.family, self.body, prefer_p)
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
        """Off its pair; no longer theirs either while it waits for another (an error for the old D's
        requests must not reach it)."""
        for inst in (self.tracked.p, self.tracked.d):
            if inst is not None:
                inst.in_flight.discard(self.tracked.req_id)
        self.tracked.p = self.tracked.d = None
        self.coord.notify()

    def _start_over(self, why: str, give_up: Exception) -> None:
        """Nothing of the request has reached the client, but its pair cannot answer it: it is
        unscheduled and renamed (a new req-id: P may still hold a KV lease under the old one, and
        what is still on its way for that id is dropped), for `_until_first_token` to send again;
        `give_up` is raised instead past max_retry start overs."""
        self.starts_over += 1
        if self.starts_over > self.cfg.max_retry:
            raise give_up
        log.warning("request %s starts over on another pair (%s)", self.tracked.req_id, why)
        self.coord.stop_infer(self.tracked)  # the old pair may hold it still: its KV is freed now
        self._unschedule()
        self.coord.table.rename(self.tracked)
        self.started_over_at = time.monotonic()

    async def _d_heard_from(self) -> None:
        """P answered, but D's /dresult is down: whether D took the request before it went away,
        or is another process by now that never heard of it, the re-link (or its failure, within
        2 x kv_trans_timeout) says, before anything goes to the client."""
        d = self.tracked.d
        while d is not None and not (d.linked or self.tracked.d_lost):
            try:
                await self.coord.wait_change(self._remaining(self._deadline(self.cfg.infer_timeout_s)))
            except TimeoutError:
                raise Failure(408, "Request inference timeout", stop=True) from None

    def _d_failed(self) -> None:
        """P could not hand the request to D: D is out of the schedule until its status poll,
        asked at once, answers."""
        if self.tracked.d is not None:
            self.coord.registry.suspect(self.tracked.d)

    async def _recompute(self, body: bytes) -> PReply:
        """D preempted the request and sent it back rebuilt (pd-disaggregation.md A.6): the same
        req-id goes to a pair scheduled afresh, P told `is-recompute: true`. A P that refuses it
        (say, the req-id still held there) gets it again a second later, up to max_retry times."""
        self.tracked.state = State.RETRY
        log.info("request %s was sent back by %s for recompute", self.tracked.req_id,
                 self.tracked.d.spec.name if self.tracked.d else "D")
        # Only the P that handed the request over holds its media (a client body naming them by reference).
        holder = self.tracked.p if retry_names_held_media(body) else None
        self._unschedule()
        await self._schedule(since=time.monotonic(), prefer_p=holder)
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
                if refusals > self.cfg.max_retry or refused.response.status_code == MEDIA_GONE:
                    raise Failure(500, f"P instance refused the recompute: {refused.text}") from None
                if refused.hand_off_failed:  # its D is gone: another pair at once
                    self._d_failed()
                    self._unschedule()
                    await self._schedule(since=time.monotonic(), prefer_p=holder)
                else:
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
                self._start_over("its D went away", Failure(500, _terminal_text(record)))
                reply = await self._until_first_token()
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

    @property
    def hand_off_failed(self) -> bool:
        return self.response.status_code == 500 and HAND_OFF_FAILED in bytes(self.response.body)
