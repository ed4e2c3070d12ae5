"""The inference routes the coordinator serves, and what it needs to know of each API family to
answer for it: its error body (MindIE's `{"error","error_type"}` or OpenAI's), and how an error is
framed as the last event of a stream, as the single instance's renderers frame it (SSE `data: `,
Triton's `data:` without the space, vLLM's JSON ended by a NUL). The coordinator reads a body only
to tell vLLM's `/generate` (`prompt`) from TGI's (`inputs`) and to find a Triton client's `id`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mindie.server.errors import APIError, ErrorStyle
from mindie.server.protocols.base import dumps, sse


@dataclass(frozen=True)
class Family:
    name: str
    style: ErrorStyle
    frame: Callable[[dict[str, Any]], bytes]  # one stream event carrying an error body

    def error_body(self, err: APIError) -> dict[str, Any]:
        return err.for_style(self.style).body(self.style)

    def error_event(self, err: APIError) -> bytes:
        return self.frame(self.error_body(err))


NATIVE = Family("native", ErrorStyle.MINDIE, sse)
TGI = Family("tgi", ErrorStyle.MINDIE, sse)
VLLM = Family("vllm", ErrorStyle.MINDIE, lambda body: (dumps(body) + "\0").encode())
OPENAI = Family("openai", ErrorStyle.OPENAI, sse)
TRITON = Family("triton", ErrorStyle.MINDIE, lambda body: sse(body, space=False))

# The 11 inference routes of MindIE's coordinator (Coordinator.cpp, InitRequestListener), in the
# order they are matched; `None` for /generate, whose family the body decides.
INFERENCE_ROUTES: list[tuple[str, Family | None]] = [
    ("/infer", NATIVE), ("/infer_token", NATIVE), ("/generate", None), ("/generate_stream", TGI), ("/", TGI),
    ("/v1/chat/completions", OPENAI), ("/v1/completions", OPENAI), ("/v2/models/{model}/generate", TRITON),
    ("/v2/models/{model}/generate_stream", TRITON), ("/v2/models/{model}/infer", TRITON),
]


def _json_object(body: bytes) -> dict[str, Any] | None:
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return parsed if isinstance(parsed, dict) else None


def family_of(route: Family | None, body: bytes) -> Family:
    if route is not None:
        return route
    parsed = _json_object(body)
    return VLLM if parsed is not None and "prompt" in parsed else TGI


def triton_id(family: Family, body: bytes) -> str | None:
    """A Triton client's own request id: MindIE's D names that request's records by it."""
    if family is not TRITON:
        return None
    parsed = _json_object(body)
    value = parsed.get("id") if parsed is not None else None
    return value if isinstance(value, str) and value else None
