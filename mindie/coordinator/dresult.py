"""One `GET /dresult` stream per D: the records it carries go to the request table.

D sends `ka:heartbeat` after 5 s without a record, so a stream silent for three of those (our
choice) is taken as dead: D is marked unlinked (out of the schedule) and the coordinator re-links.
A stream that fails, ends, or is superseded (`close:`, another GET took it over) is re-linked with
exponential backoff; after `max_retry` consecutive failures D is marked faulty and its requests in
flight end with an error at once (MindIE leaves them to `infer_timeout`). Re-linking goes on at the
slowest backoff (at once when D takes its role again: a restarted D refuses `/dresult` until then),
and D comes back into the schedule when a link succeeds.

However the re-linking goes, the requests on D end with an error once D has sent nothing for 2 x its
kv_trans_timeout (a D that hangs rather than dies answers nothing, so every re-link waits out its
own timeout); and a re-link that finds another D process (its epoch header differs: it
restarted) ends them at once, since that process never heard of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import httpx

from mindie.coordinator.instances import Instance, Registry
from mindie.coordinator.requests import RequestTable
from mindie.pd.records import EPOCH_HEADER, KV_TIMEOUT_HEADER, RecordDecoder, RecordError, RecordKind

log = logging.getLogger("mindie.coordinator")

SILENCE_LIMIT_S = 15.0  # three missed 5 s heartbeats
BACKOFF_FIRST_S = 0.1
BACKOFF_MAX_S = 5.0
DEFAULT_KV_TIMEOUT_S = 10.0  # an instance's kv_trans_timeout when its /dresult does not say


class _LinkLost(Exception):
    pass


class DResultLink:
    def __init__(self, d: Instance, registry: Registry, table: RequestTable, max_retry: int,
                 silence_limit_s: float = SILENCE_LIMIT_S) -> None:
        self.d = d
        self.registry = registry
        self.table = table
        self.max_retry = max_retry
        self.silence_limit_s = silence_limit_s
        self.failures = 0
        self.links = 0  # streams opened so far (a re-link counts)
        self.epoch: str | None = None  # the D process the last link reached
        self.last_heard = time.monotonic()  # when D last sent anything (a record or a heartbeat)
        self.grace_s = 2 * DEFAULT_KV_TIMEOUT_S
        self._grace: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None
        self._relink = asyncio.Event()  # cuts a backoff short

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._grace is not None:
            self._grace.cancel()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            try:
                await self._stream()
            except (httpx.HTTPError, _LinkLost, RecordError) as exc:
                reason = "silent for too long" if isinstance(exc, httpx.ReadTimeout) else str(exc) or type(
                    exc).__name__
                self._lost(reason)
            backoff = min(BACKOFF_FIRST_S * 2 ** max(self.failures - 1, 0), BACKOFF_MAX_S)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._relink.wait(), backoff)
            self._relink.clear()

    def relink_now(self) -> None:
        """D has just taken its role again (it restarted): its /dresult, which a roleless D refuses,
        answers now, sooner than the backoff would try it."""
        if not self.d.linked:
            self._relink.set()

    async def _stream(self) -> None:
        url = f"{self.d.business_url}/dresult"
        timeout = httpx.Timeout(self.silence_limit_s, connect=min(30.0, self.silence_limit_s))
        async with self.registry.client.stream("GET", url, timeout=timeout) as reply:
            if reply.status_code != 200:
                raise _LinkLost(f"GET /dresult answered {reply.status_code}: {(await reply.aread())[:200]!r}")
            self._linked(reply.headers)
            if not self.d.linked or self.d.faulty:
                self.d.linked, self.d.faulty = True, False
                log.info("linked to %s's /dresult", self.d.spec.name)
                self.registry.changed()
            decoder = RecordDecoder()
            async for chunk in reply.aiter_raw():
                self.last_heard = time.monotonic()
                for record in decoder.feed(chunk):
                    if record.kind is RecordKind.CLOSE:
                        raise _LinkLost("superseded by a newer GET /dresult")
                    if record.kind is not RecordKind.KEEP_ALIVE and not self.table.deliver(record):
                        log.debug("dropped a %s record for request %s, no longer in flight", record.kind.value,
                                  record.req_id)
            raise _LinkLost("the stream ended")

    def _linked(self, headers: httpx.Headers) -> None:
        self.last_heard = time.monotonic()
        self.links += 1
        self.failures = 0
        if self._grace is not None:
            self._grace.cancel()
            self._grace = None
        epoch = headers.get(EPOCH_HEADER)
        if self.epoch is not None and epoch != self.epoch:
            log.warning("%s is another process than before (it restarted): its requests in flight are lost",
                        self.d.spec.name)
            self._fail_requests("restarted; the request was lost")
        self.epoch = epoch
        try:
            self.grace_s = 2 * float(headers.get(KV_TIMEOUT_HEADER, DEFAULT_KV_TIMEOUT_S))
        except ValueError:
            self.grace_s = 2 * DEFAULT_KV_TIMEOUT_S

    def _fail_requests(self, why: str) -> int:
        failed = self.table.fail_decode(self.d, f"D instance {self.d.spec.ip}:{self.d.spec.port} {why}")
        if failed:
            self.registry.changed()  # wakes a relay waiting to know whether its request survived
        return failed

    def _grace_over(self) -> None:
        self._grace = None
        if not self.d.linked and (failed := self._fail_requests("is unreachable")):
            log.error("%s's /dresult has been down for %g s: failed its %d request(s)", self.d.spec.name,
                      self.grace_s, failed)

    def _lost(self, reason: str) -> None:
        self.failures += 1
        if self.d.linked:
            self.d.linked = False
            self.registry.changed()
        log.warning("/dresult of %s lost (%s), attempt %d of %d to re-link", self.d.spec.name, reason,
                    self.failures, self.max_retry)
        if self._grace is None:  # counted from the last byte D sent: a silent link was lost then
            loop = asyncio.get_running_loop()
            self._grace = loop.call_at(loop.time() - (time.monotonic() - self.last_heard) + self.grace_s,
                                       self._grace_over)
        if self.failures > self.max_retry and not self.d.faulty:
            self.d.faulty = True
            log.error("%s is faulty: /dresult could not be re-linked %d times", self.d.spec.name, self.max_retry)
            self._fail_requests("is unreachable")
