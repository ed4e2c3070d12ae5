"""D's `GET /dresult`: the one long-lived stream that carries every handed-off request's later
events to the coordinator, as `mindie.pd.records` records.

One stream at a time: a new GET sends the old one a `close:` record and ends it. Records pushed
while no stream is connected wait and go out on the next one. Each write is whole records (one
HTTP chunk per write, possibly several records), never part of one, since the coordinator parses
each chunk on its own. After `heartbeat_s` with nothing written the stream sends `ka:heartbeat\\0`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from mindie.pd.records import HEARTBEAT, close_record


class _Stream:
    def __init__(self) -> None:
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()  # None: superseded, end now


class DResultDispatcher:
    def __init__(self, heartbeat_s: float) -> None:
        self.heartbeat_s = heartbeat_s
        self._pending: list[bytes] = []  # records for the next stream to connect
        self._current: _Stream | None = None

    @property
    def connected(self) -> bool:
        return self._current is not None

    def push(self, records: bytes) -> None:
        """Queues whole records (one `mindie.pd.records.encode` result, or several joined)."""
        if self._current is not None:
            self._current.queue.put_nowait(records)
        else:
            self._pending.append(records)

    def connect(self) -> AsyncIterator[bytes]:
        """A new stream, superseding the current one if any."""
        old, stream = self._current, _Stream()
        if old is not None:
            old.queue.put_nowait(close_record())
            old.queue.put_nowait(None)
        self._current = stream
        for records in self._pending:
            stream.queue.put_nowait(records)
        self._pending.clear()
        return self._run(stream)

    async def _run(self, stream: _Stream) -> AsyncIterator[bytes]:
        try:
            while True:
                try:
                    first = await asyncio.wait_for(stream.queue.get(), self.heartbeat_s)
                except TimeoutError:
                    yield HEARTBEAT
                    continue
                chunk, end = [first], first is None
                while not end and not stream.queue.empty():  # what is queued goes out in one write
                    item = stream.queue.get_nowait()
                    end = item is None
                    chunk.append(item)
                data = b"".join(c for c in chunk if c is not None)
                if data:
                    yield data
                if end:
                    return
        finally:
            if self._current is stream:  # the coordinator went away: keep what it did not get
                self._current = None
                while not stream.queue.empty():
                    item = stream.queue.get_nowait()
                    if item is not None:
                        self._pending.append(item)
