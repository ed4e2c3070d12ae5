"""The default KV transport: D pulls a published request's blocks from P over TCP.

Wire (nothing pickled): D connects to P's transfer listener and sends one frame, a 4-byte
big-endian length and a JSON object {"token", "reqId", "runs": [[src_first, count], ...],
"layout": {...}}. P answers one frame {"ok": true} or {"ok": false, "error": "<why>"} (a wrong
token, an unknown req-id, a layout that differs, naming the field). Then, for each run and each
layer, the K and then the V bytes of blocks src_first..src_first+count-1, each preceded by a
12-byte header (8-byte big-endian length, 4-byte crc32). Runs are maximal stretches where both
the source and the destination ids are consecutive, so one `sendall` from P's arena lands in one
`recv_into` of D's. Both sides stop at the deadline.
"""

from __future__ import annotations

import hmac
import json
import socket
import struct
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict

from mindie.pd.transport import KVArena, KVHandle, KVLayout, KVTransport, PullJob, PullRefused, runs

_FRAME = struct.Struct(">I")
_CHUNK = struct.Struct(">QI")  # length, crc32
MAX_FRAME = 16 * 2**20


def _send_frame(sock: socket.socket, obj: dict[str, object]) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    sock.sendall(_FRAME.pack(len(data)) + data)


def _recv_frame(sock: socket.socket, deadline: float) -> dict[str, object]:
    head = bytearray(_FRAME.size)
    _recv_parts(sock, [memoryview(head)], deadline)
    (size,) = _FRAME.unpack(head)
    if size > MAX_FRAME:
        raise ValueError(f"frame of {size} bytes is over the {MAX_FRAME} limit")
    body = bytearray(size)
    _recv_parts(sock, [memoryview(body)], deadline)
    obj = json.loads(body)
    if not isinstance(obj, dict):
        raise ValueError("a frame must hold a JSON object")
    return obj


def _batches(bufs: list[memoryview], limit: int = 4 * 2**20) -> list[list[memoryview]]:
    """Consecutive buffers grouped up to `limit` bytes: the unit of checksum work handed to the
    helper thread, large enough that handing it over costs little."""
    out: list[list[memoryview]] = []
    size = limit
    for buf in bufs:
        if size + len(buf) > limit:
            out.append([])
            size = 0
        out[-1].append(buf)
        size += len(buf)
    return out


def _crcs(bufs: list[memoryview]) -> list[int]:
    return [zlib.crc32(buf) for buf in bufs]


def _remaining(deadline: float) -> float:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("KV transfer deadline passed")
    return remaining


def _send_parts(sock: socket.socket, parts: list[memoryview], deadline: float) -> None:
    """sendall of several buffers with one gathered write per syscall, no joining copy."""
    parts = [p for p in parts if len(p)]
    while parts:
        sock.settimeout(_remaining(deadline))
        sent = sock.sendmsg(parts)
        while parts and sent >= len(parts[0]):
            sent -= len(parts[0])
            parts = parts[1:]
        if parts and sent:
            parts = [parts[0][sent:], *parts[1:]]


def _recv_parts(sock: socket.socket, parts: list[memoryview], deadline: float) -> None:
    """Fills each buffer in order, scattering each read across them."""
    parts = [p for p in parts if len(p)]
    while parts:
        sock.settimeout(_remaining(deadline))
        got = sock.recvmsg_into(parts)[0]
        if got == 0:
            raise ConnectionError("peer closed the KV transfer connection")
        while parts and got >= len(parts[0]):
            got -= len(parts[0])
            parts = parts[1:]
        if parts and got:
            parts = [parts[0][got:], *parts[1:]]


class TCPTransport(KVTransport):
    """The default backend. P's listener serves each pull on its own thread; `timeout_s`
    (kv_trans_timeout) bounds each pull on P's side as the deadline does on D's."""

    def __init__(self, arena: KVArena, layout: KVLayout, token: str, host: str, port: int,
                 timeout_s: float) -> None:
        self.arena, self.layout, self.timeout_s = arena, layout, timeout_s
        self._token = token.encode()
        self._published: dict[str, list[int]] = {}
        self._lock = threading.Lock()
        self._listener = socket.create_server((host, port), reuse_port=False)
        self.addr = f"{host}:{self._listener.getsockname()[1]}"
        self._closed = False
        threading.Thread(target=self._accept, name="kv-serve", daemon=True).start()

    # --- P ---------------------------------------------------------------------------------

    def publish(self, req_id: str, block_ids: list[int]) -> KVHandle:
        with self._lock:
            self._published[req_id] = list(block_ids)
        return KVHandle(req_id, self.addr, list(block_ids))

    def release(self, req_id: str) -> bool:
        with self._lock:
            return self._published.pop(req_id, None) is not None

    def close(self) -> None:
        self._closed = True
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="kv-send", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        deadline = time.monotonic() + self.timeout_s
        with conn:
            try:
                ask = _recv_frame(conn, deadline)
                refusal, plan = self._check(ask)
                if refusal is not None:
                    _send_frame(conn, {"ok": False, "error": refusal})
                    return
                _send_frame(conn, {"ok": True})
                batches = _batches([buf for first, count in plan for buf in self.arena.buffers(first, count)])
                # zlib.crc32 releases the GIL: checksums are computed a batch ahead on a helper
                # thread while this one sends.
                with ThreadPoolExecutor(1) as pool:
                    for bufs, crcs in zip(batches, pool.map(_crcs, batches)):
                        for buf, crc in zip(bufs, crcs):
                            _send_parts(conn, [memoryview(_CHUNK.pack(len(buf), crc)), buf], deadline)
            except (OSError, ValueError):
                return  # D gave up or sent garbage: D reports the failure, nothing to keep here

    def _check(self, ask: dict[str, object]) -> tuple[str | None, list[tuple[int, int]]]:
        token = ask.get("token")
        if not isinstance(token, str) or not hmac.compare_digest(token.encode(), self._token):
            return "the inter-instance token is missing or wrong", []
        try:
            mismatch = self.layout.mismatch(KVLayout.from_json(ask.get("layout")))
        except (TypeError, ValueError) as exc:
            return f"bad layout: {exc}", []
        if mismatch is not None:
            return mismatch, []
        with self._lock:
            published = self._published.get(str(ask.get("reqId")))
        if published is None:
            return f"request {ask.get('reqId')} is not published here (released or expired)", []
        plan = ask.get("runs")
        if not isinstance(plan, list) or not all(
                isinstance(r, list) and len(r) == 2 and all(isinstance(x, int) for x in r) for r in plan):
            return "runs must be a list of [first block, count]", []
        wanted = [b for first, count in plan for b in range(first, first + count)]
        if wanted != published:
            return f"runs ask for blocks other than the {len(published)} published for {ask.get('reqId')}", []
        return None, [(first, count) for first, count in plan]

    # --- D ---------------------------------------------------------------------------------

    def pull(self, handle: KVHandle, dst_block_ids: list[int], deadline: float) -> PullJob:
        plan = runs(handle.block_ids, dst_block_ids)

        def work() -> None:
            host, _, port = handle.addr.rpartition(":")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("KV transfer deadline passed before the pull started")
            with socket.create_connection((host, int(port)), timeout=remaining) as sock:
                _send_frame(sock, {"token": self._token.decode(), "reqId": handle.req_id,
                                   "runs": [[s, n] for s, _, n in plan], "layout": asdict(self.layout)})
                answer = _recv_frame(sock, deadline)
                if answer.get("ok") is not True:
                    raise PullRefused(f"P refused the pull: {answer.get('error')}")
                head = memoryview(bytearray(_CHUNK.size))
                checks: list[tuple[list[int], Future[list[int]]]] = []
                batches = _batches([buf for _, d, n in plan for buf in self.arena.buffers(d, n)])
                with ThreadPoolExecutor(1) as pool:  # verify batch i while batch i + 1 arrives
                    for bufs in batches:
                        expected = []
                        for buf in bufs:
                            # Sizes agree by the layout check; a header that says otherwise
                            # means the stream is out of step, and the pull fails.
                            _recv_parts(sock, [head, buf], deadline)
                            size, crc = _CHUNK.unpack(head)
                            if size != len(buf):
                                raise PullRefused(f"P sent {size} bytes for a buffer of {len(buf)}")
                            expected.append(crc)
                        checks.append((expected, pool.submit(_crcs, bufs)))
                if any(expected != check.result() for expected, check in checks):
                    raise PullRefused("KV bytes arrived corrupted (crc32 mismatch)")

        return PullJob(work)
