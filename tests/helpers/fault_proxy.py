"""A small TCP fault proxy (toxiproxy-like) for the tests: it stands between two roles on a
loopback port and passes bytes through, delays each chunk, stalls (keeps both connections open
and moves no byte: a link that is down but not closed), or cuts every connection. netem and
iptables are not available here; this needs no root and runs the same in CI."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass, field
from enum import Enum


class Mode(Enum):
    PASS = "pass"
    STALL = "stall"  # hold what arrives, forward nothing
    CUT = "cut"  # close every connection, and new ones at once


@dataclass
class FaultProxy:
    target: tuple[str, int]
    host: str = "127.0.0.1"
    mode: Mode = Mode.PASS
    delay_s: float = 0.0  # before each forwarded chunk
    bytes_through: int = 0
    connections: int = 0
    _loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)

    def __post_init__(self) -> None:
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        ready.wait()

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"

    def set(self, mode: Mode) -> None:
        self.mode = mode
        if mode is Mode.CUT:
            self._loop.call_soon_threadsafe(self._cut_all)

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._serve, self.host, 0))
        self.port = server.sockets[0].getsockname()[1]
        ready.set()
        self._loop.run_forever()
        server.close()

    def _cut_all(self) -> None:
        for w in list(self._writers):
            w.transport.abort()
        self._writers.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        if self.mode is Mode.CUT:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_writer}
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True)
        for w in (writer, up_writer):
            self._writers.discard(w)
            with contextlib.suppress(Exception):
                w.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while chunk := await reader.read(65536):
            while self.mode is Mode.STALL:
                await asyncio.sleep(0.01)
            if self.mode is Mode.CUT:
                return
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            self.bytes_through += len(chunk)
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():  # the sender closed its side: so does the proxy
            writer.write_eof()
