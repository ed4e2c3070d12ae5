"""The requests in flight, by req-id: each one's state and the queue its D records wait in.

A request is in the table before it is sent to P, so the records D streams before P has answered
the coordinator (P tells D first, then answers) queue up in order and are relayed after P's output.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum

from mindie.coordinator.instances import Instance
from mindie.pd.records import Record, RecordKind

_UINT64 = 2**64 - 1


class State(Enum):
    ARRIVE = "arrive"
    SCHEDULED = "scheduled"
    REPEATED = "repeated"  # sent to P
    FIRST_TOKEN_FINISH = "first_token_finish"  # P answered
    RETRY = "retry"  # D sent it back for recompute: on its way to a prefill node again
    FINISH = "finish"
    EXCEPTION = "exception"
    TIMEOUT = "timeout"


class DuplicateRequestId(Exception):
    pass


@dataclass(eq=False)
class Tracked:
    req_id: str
    alias: str | None  # a Triton client's own `id`: MindIE's D names Triton records by it
    arrived: float = field(default_factory=time.monotonic)
    state: State = State.ARRIVE
    p: Instance | None = None
    d: Instance | None = None
    records: asyncio.Queue[Record] = field(default_factory=asyncio.Queue)
    d_lost: bool = False  # its D went away (the error record is the coordinator's own, not D's)


class RequestTable:
    def __init__(self) -> None:
        self._by_id: dict[str, Tracked] = {}
        self._by_alias: dict[str, Tracked] = {}
        self._counter = itertools.count()
        self.arrived_total = 0

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[Tracked]:
        return iter(list(self._by_id.values()))  # a copy: callers may remove while iterating

    def new_id(self) -> str:
        """A decimal uint64, as MindIE's `hash_combine(uuid, counter)`; unique among those in flight."""
        while True:
            req_id = str((uuid.uuid4().int ^ next(self._counter)) & _UINT64)
            if req_id not in self._by_id and req_id not in self._by_alias:
                return req_id

    def add(self, alias: str | None = None) -> Tracked:
        if alias is not None and (alias in self._by_alias or alias in self._by_id):
            raise DuplicateRequestId(alias)
        tracked = Tracked(self.new_id(), alias)
        self._by_id[tracked.req_id] = tracked
        if alias is not None:
            self._by_alias[alias] = tracked
        self.arrived_total += 1
        return tracked

    def get(self, req_id: str) -> Tracked | None:
        return self._by_id.get(req_id) or self._by_alias.get(req_id)

    def unanswered(self, p: Instance) -> int:
        """Requests scheduled on P that P has not answered yet: its prefill queue as seen from here,
        exact at once, where P's polled figures lag by up to a poll."""
        waiting = (State.SCHEDULED, State.REPEATED)
        return sum(1 for rid in p.in_flight if (t := self._by_id.get(rid)) is not None and t.state in waiting)

    def remove(self, tracked: Tracked) -> None:
        self._by_id.pop(tracked.req_id, None)
        if tracked.alias is not None:
            self._by_alias.pop(tracked.alias, None)
        for inst in (tracked.p, tracked.d):
            if inst is not None:
                inst.in_flight.discard(tracked.req_id)

    def deliver(self, record: Record) -> bool:
        """Queues a D record for its request; False when no request in flight has its id (it
        finished, timed out or was cancelled: the record is dropped)."""
        tracked = self.get(record.req_id or "")
        if tracked is None:
            return False
        tracked.records.put_nowait(record)
        return True

    def fail_decode(self, d: Instance, text: str) -> int:
        """Ends every request on D with an error record, as if D had sent it (D is gone); how many."""
        failed = 0
        for tracked in self:
            if tracked.d is d and not tracked.d_lost:
                tracked.d_lost = True
                tracked.records.put_nowait(Record(RecordKind.ERROR, tracked.req_id, text.encode()))
                failed += 1
        return failed

    def rename(self, tracked: Tracked) -> None:
        """A new req-id, and a fresh record queue, for a request that starts over: what is still
        on its way for the old id is dropped."""
        self._by_id.pop(tracked.req_id, None)
        tracked.req_id = self.new_id()
        tracked.records = asyncio.Queue()
        tracked.d_lost = False
        self._by_id[tracked.req_id] = tracked
