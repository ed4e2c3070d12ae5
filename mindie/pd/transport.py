"""Moving a handed-off request's KV blocks from P to D: D pulls by block table (MindIE's model).

P `publish`es the blocks of a request under its req-id and `release`s them when D says it is done
(or the lease expires, which P's server enforces); D `pull`s them into its own reserved blocks
with a deadline and polls the job. Two backends share the interface: `FakeTransport`, in-process
for unit tests, and the default TCP one.

TCP wire (nothing pickled): D connects to P's transfer listener and sends one frame, a 4-byte
big-endian length and a JSON object {"token", "reqId", "runs": [[src_first, count], ...],
"layout": {...}}. P answers one frame {"ok": true} or {"ok": false, "error": "<why>"} (a wrong
token, an unknown req-id, a layout that differs, naming the field). Then, for each run and each
layer, the K and then the V bytes of blocks src_first..src_first+count-1, each preceded by a
12-byte header (8-byte big-endian length, 4-byte crc32). Runs are maximal stretches where both
the source and the destination ids are consecutive, so one `sendall` from P's arena lands in one
`recv_into` of D's. Both sides stop at the deadline.
"""

from __future__ import annotations

import enum
import hmac
import json
import socket
import struct
import threading
import time
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields

import numpy as np

_FRAME = struct.Struct(">I")
_CHUNK = struct.Struct(">QI")  # length, crc32
MAX_FRAME = 16 * 2**20


@dataclass(frozen=True)
class KVLayout:
    """What must agree for one instance's KV bytes to mean the same in another's blocks."""

    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    weight_format: str

    def mismatch(self, other: KVLayout) -> str | None:
        """None if compatible, else the first field that differs, named with both values."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine != theirs:
                return f"KV layout mismatch: {f.name} is {mine!r} here but {theirs!r} on the peer"
        return None

    @classmethod
    def from_json(cls, raw: object) -> KVLayout:
        if not isinstance(raw, dict) or set(raw) != {f.name for f in fields(cls)}:
            raise ValueError(f"layout must be an object with exactly {sorted(f.name for f in fields(cls))}")
        return cls(**raw)


class KVArena:
    """An instance's KV pool as byte arrays: per layer, K and V of shape [num_blocks, block bytes].
    Block ranges are views (no copies): a run of consecutive blocks is one contiguous buffer."""

    def __init__(self, layers: list[tuple[np.ndarray, np.ndarray]]) -> None:
        self.layers = [(k.reshape(k.shape[0], -1), v.reshape(v.shape[0], -1)) for k, v in layers]
        for k, v in self.layers:
            if k.dtype != np.uint8 or not k.flags.c_contiguous or not v.flags.c_contiguous:
                raise ValueError("a KV arena needs contiguous uint8 views of the cache")

    @property
    def num_blocks(self) -> int:
        return self.layers[0][0].shape[0]

    def buffers(self, first: int, count: int) -> list[memoryview]:
        """K then V of each layer for blocks [first, first + count), in wire order."""
        return [t[first:first + count].data.cast("B") for kv in self.layers for t in kv]


class PullStatus(enum.Enum):
    PENDING = "pending"
    SUCCESS = "success"
    FAIL_REVERSIBLE = "fail_reversible"  # P unreachable, deadline passed: the request may be retried
    FAIL_IRREVERSIBLE = "fail_irreversible"  # refused (token, layout, unknown req-id) or corrupted


@dataclass(frozen=True)
class KVHandle:
    """Where D finds a published request's KV."""

    req_id: str
    addr: str  # "ip:port" of P's transfer listener
    block_ids: list[int]

    def to_json(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: object) -> KVHandle:
        if not isinstance(raw, dict):
            raise ValueError("kvHandle must be an object")
        ids = raw.get("block_ids")
        if not isinstance(raw.get("req_id"), str) or not isinstance(raw.get("addr"), str) or not (
                isinstance(ids, list) and ids and all(isinstance(b, int) and b >= 0 for b in ids)):
            raise ValueError("kvHandle needs req_id, addr and a non-empty list of block_ids")
        return cls(raw["req_id"], raw["addr"], ids)


class PullJob:
    """A pull running in its own thread: `poll()` says where it stands, `wait()` blocks until
    it ends; `error` says why it failed."""

    def __init__(self, work: Callable[[], None]) -> None:
        self.status = PullStatus.PENDING
        self.error = ""
        self._done = threading.Event()
        threading.Thread(target=self._run, args=(work,), name="kv-pull", daemon=True).start()

    def _run(self, work: Callable[[], None]) -> None:
        try:
            work()
            self.status = PullStatus.SUCCESS
        except PullRefused as exc:
            self.error, self.status = str(exc), PullStatus.FAIL_IRREVERSIBLE
        except TimeoutError:  # a socket's own timeout is the deadline too
            self.error, self.status = "KV transfer deadline passed", PullStatus.FAIL_REVERSIBLE
        except (OSError, ConnectionError, ValueError) as exc:
            self.error, self.status = f"{type(exc).__name__}: {exc}", PullStatus.FAIL_REVERSIBLE
        finally:
            self._done.set()

    def poll(self) -> PullStatus:
        return self.status

    def wait(self, timeout: float | None = None) -> PullStatus:
        self._done.wait(timeout)
        return self.status


class PullRefused(Exception):
    """P refused the pull, or the bytes arrived corrupted: retrying the same pull cannot help."""


class KVTransport(ABC):
    """P side: publish / release. D side: pull."""

    @abstractmethod
    def publish(self, req_id: str, block_ids: list[int]) -> KVHandle:
        """Makes the blocks pullable under req_id until `release`."""

    @abstractmethod
    def release(self, req_id: str) -> bool:
        """Stops serving req_id; False if it was not published (already released)."""

    @abstractmethod
    def pull(self, handle: KVHandle, dst_block_ids: list[int], deadline: float) -> PullJob:
        """Copies the handle's blocks into dst_block_ids (same count) of this instance's arena,
        by `deadline` (time.monotonic())."""

    @abstractmethod
    def close(self) -> None:
        """Stops serving."""


def runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src_first, dst_first, count): maximal stretches consecutive on both sides."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source blocks but {len(dst)} destination blocks")
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, d, 1))
    return out


class FakeTransport(KVTransport):
    """In-process: instances built with the same `registry` dict (its address space) pull from
    one another by plain array copies. `fail` makes every pull end in that status."""

    def __init__(self, arena: KVArena, addr: str, registry: dict[str, FakeTransport],
                 fail: PullStatus | None = None) -> None:
        self.arena, self.addr, self.registry, self.fail = arena, addr, registry, fail
        self.published: dict[str, list[int]] = {}
        registry[addr] = self

    def close(self) -> None:
        self.registry.pop(self.addr, None)

    def publish(self, req_id: str, block_ids: list[int]) -> KVHandle:
        self.published[req_id] = list(block_ids)
        return KVHandle(req_id, self.addr, list(block_ids))

    def release(self, req_id: str) -> bool:
        return self.published.pop(req_id, None) is not None

    def pull(self, handle: KVHandle, dst_block_ids: list[int], deadline: float) -> PullJob:
        def work() -> None:
            if self.fail is PullStatus.FAIL_IRREVERSIBLE:
                raise PullRefused("injected irreversible failure")
            if self.fail is PullStatus.FAIL_REVERSIBLE or time.monotonic() > deadline:
                raise TimeoutError("deadline passed")
            source = self.registry.get(handle.addr)
            if source is None or handle.req_id not in source.published:
                raise PullRefused(f"request {handle.req_id} is not published at {handle.addr}")
            for s, d, n in runs(handle.block_ids, dst_block_ids):
                for src_buf, dst_buf in zip(source.arena.buffers(s, n), self.arena.buffers(d, n)):
                    dst_buf[:] = src_buf

        return PullJob(work)


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
