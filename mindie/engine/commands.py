"""What the event loop asks of the engine thread. Every request reaches the engine as one of these
typed commands through `AsyncEngine.submit`, the one way in; the thread applies them in order
between steps, so the engine itself is only ever touched by its own thread.

Transferring a request's KV cache (prefill/decode disaggregation) will add commands here; none
exist yet, because nothing in the engine can yet export or import a sequence's blocks."""

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


EngineCommand = AddRequest | AbortRequest
