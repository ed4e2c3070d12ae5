"""Moving a handed-off request's KV blocks from P to D: D pulls by block table (MindIE's model).

P `publish`es the blocks of a request under its req-id and `release`s them when D says it is done
(or the lease expires, which P's server enforces); D `pull`s them into its own reserved blocks
with a deadline and polls the job. Two backends share the interface: `FakeTransport` (here),
in-process for unit tests, and the default TCP one (pd/tcp_transport.py, with its wire format).
Runs (`runs`) are maximal stretches where both the source and the destination block ids are
consecutive, so each is one contiguous buffer on both sides.
"""

from __future__ import annotations

import enum
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields

import numpy as np


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
