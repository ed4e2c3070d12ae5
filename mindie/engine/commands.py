"""What the event loop asks of the engine thread. Every request reaches the engine as one of these
typed commands through `AsyncEngine.submit`, the one way in; the thread applies them in order
between steps, so the engine itself is only ever touched by its own thread.

Prefill/decode disaggregation: on P, an `AddRequest` whose request has `handoff` set exports its
KV by itself (its last output carries the pinned blocks) and `ReleaseKV` unpins them; on D,
`ReserveKV` takes the blocks the pulled KV is written into, then `ResumeRequest` runs the request
from there, or `DropReserved` gives the blocks back."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from mindie.engine.request import EngineRequest, RequestOutput


@dataclass(frozen=True)
class OutputSink:
    """Where a request's outputs go: a queue on the event loop that added it, and a future settled
    once the engine has accepted the request (or refused it, with the engine's ValueError)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]
    accepted: asyncio.Future[None]


@dataclass(frozen=True)
class AddRequest:
    request: EngineRequest
    sink: OutputSink


@dataclass(frozen=True)
class AbortRequest:
    """Stops every sample of a request in any phase and frees its blocks; its last outputs still
    reach its sink. Unknown or finished ids are ignored."""

    request_id: str


@dataclass(frozen=True)
class ReleaseKV:
    """Frees the blocks P pinned for a handed-off request (`KVExport.lease_id`); idempotent."""

    lease_id: str


@dataclass(frozen=True)
class ReserveKV:
    """Takes fresh blocks for positions [0, num_tokens); `reply` gets their ids in order, None if
    the pool is short now, or the engine's ValueError."""

    request_id: str
    token_ids: list[int]
    num_tokens: int
    loop: asyncio.AbstractEventLoop
    reply: asyncio.Future[list[int] | None]


@dataclass(frozen=True)
class DropReserved:
    request_id: str


@dataclass(frozen=True)
class ResumeRequest:
    """Runs a request whose reserved blocks now hold its KV, continuing after the outputs of its
    `continuation`; outputs go to `sink` as for AddRequest."""

    request: EngineRequest
    num_cached_prompt_tokens: int
    sink: OutputSink


EngineCommand = AddRequest | AbortRequest | ReleaseKV | ReserveKV | DropReserved | ResumeRequest
