"""The seam every API family implements between HTTP and the engine.

A family's parse turns a body into a `Call` (the engine requests it needs) and a `Renderer`, which
turns the engine's results back into the family's bytes: a whole response body, stream events, an
error event. The server's one generic handler (server/handler.py) runs parse -> start -> whole or
stream for every family, so a family's bytes are written in exactly one place; prefill/decode
disaggregation is to call the same renderers for P's reply and D's /dresult records.

Nothing here or in any family module imports torch, `mindie._C` or the engine (a test checks), so
a process that only routes requests can load them.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from mindie.engine.request import EngineRequest, FinishReason
from mindie.server.errors import APIError, ErrorStyle
from mindie.server.results import Result, StreamItem

# A parsed request has no id yet: the server names it when it admits it (`Serving.start`).
UNNAMED = ""

# MindIE's native names (eos_token / stop_sequence / length), used by the native, TGI and Triton
# routes; a cancelled request ends as stop_sequence there.
MINDIE_REASONS = {FinishReason.EOS: "eos_token", FinishReason.STOP: "stop_sequence",
                  FinishReason.LENGTH: "length", FinishReason.ABORT: "stop_sequence"}
OPENAI_REASONS = {FinishReason.EOS: "stop", FinishReason.STOP: "stop", FinishReason.LENGTH: "length",
                  FinishReason.ABORT: "stop"}


@dataclass(frozen=True)
class Call:
    """One HTTP request in engine terms, whatever the family: its engine requests (several for a
    list of completions prompts, each with UNNAMED as its id) and how the server runs them."""

    requests: list[EngineRequest]
    stream: bool = False
    timeout_s: float | None = None  # the client's own limit from arrival, applied by the server
    user_id: str | None = None  # a Triton client's own id for its request, usable by stopInfer


class Renderer(ABC):
    """Engine results -> one family's bytes, for one Call. `results[k]` is request k's outputs
    folded so far (the caller folds each item before `event` sees it); a renderer keeps only what
    its family needs across events (a tool-call parser, text offsets)."""

    style: ClassVar[ErrorStyle] = ErrorStyle.MINDIE
    media_type: ClassVar[str] = "text/event-stream"

    @abstractmethod
    def whole(self, results: list[Result]) -> Any:
        """The non-streaming response body (JSON-serializable)."""

    def begin(self, results: list[Result]) -> list[bytes]:
        """Stream events due before any output."""
        return []

    def event(self, k: int, item: StreamItem, results: list[Result]) -> list[bytes]:
        """Stream events for one output of request k."""
        raise NotImplementedError(f"{type(self).__name__} renders whole responses only")

    def end(self, results: list[Result]) -> list[bytes]:
        """Stream events after every request's last output."""
        return []

    def error(self, err: APIError) -> bytes:
        """An error after the stream started, as one last event."""
        return sse(err.body(self.style))

    def replay(self, carried: dict[str, Any], results: list[Result], items: list[StreamItem], stream: bool) -> None:
        """Brings this renderer, and `results`, to where another renderer stood after `items` of
        the call's one request (PD: a decode node going on from P's first token, P going on from
        what a decode node sent back); the bytes are dropped, they went out there."""
        self.restore(carried)
        if stream:
            self.begin(results)
        for item in items:
            results[0].add(item)
            if stream:
                self.event(0, item, results)

    def carried(self) -> dict[str, Any]:
        """Fields this renderer makes up itself (not from the request or the results) that a PD
        decode node must reuse to continue the same response: an OpenAI `created`."""
        return {}

    def restore(self, carried: dict[str, Any]) -> None:
        """Takes over what `carried` returned on the prefill node."""
        if carried:
            raise APIError(400, f"{type(self).__name__} carries no state, got {sorted(carried)}")


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def sse(obj: Any, space: bool = True) -> bytes:
    return (("data: " if space else "data:") + dumps(obj) + "\n\n").encode()
