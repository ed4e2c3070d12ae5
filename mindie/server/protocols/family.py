"""What an API family says of itself, once, for every process that serves it.

Each family module (native, tgi, vllm, openai_family, triton) exports a `Family`: its routes, how its
errors look in a body and as a stream's last event, and where its body carries the prompt. The
instance's app (server/app.py) and the coordinator's predict plane (coordinator/app.py) are both
built from `families.FAMILIES`: a route's `kind` says how each of them answers it.

Light on purpose: nothing here imports torch, `mindie._C` or the engine, so the coordinator loads it.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mindie.server.errors import APIError, ErrorStyle

if TYPE_CHECKING:
    from starlette.responses import Response

    from mindie.server.fields import Body
    from mindie.server.protocols.base import Call, Renderer
    from mindie.server.serving import Serving

Parse = Callable[["Serving", bytes, Mapping[str, str]], Awaitable[tuple["Call", "Renderer"]]]
Handler = Callable[..., Awaitable["Response"]]  # (ctx, request) or, for a POST, (ctx, request, body)


class Kind(enum.Enum):
    GENERATE = "generate"  # runs the engine; a cluster runs it through a prefill and a decode instance
    INFO = "info"  # model, server and tokenizer facts: every instance answers alike
    CONTROL = "control"  # acts on what one serving process holds: a request to cancel, a stored response


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    kind: Kind
    parse: Parse | None = None  # GENERATE: body -> the engine requests and their renderer
    handler: Handler | None = None  # INFO and CONTROL: the instance's handler
    stream: bool | None = False  # GENERATE: always a stream (True), never (False), as the body says (None)
    claims: str | None = None  # where families share a path: the body field that makes a body this family's
    body_model: type[Body] | None = None  # documents the body in /openapi.json
    summary: str = ""
    style: ErrorStyle | None = None  # the family's, unless this route answers in another shape
    disaggregated: bool = True  # GENERATE: whether a prefill/decode pair can serve it
    wrap: Callable[[Handler], Handler] | None = None  # GENERATE: what the family puts around the generic handler


@dataclass(frozen=True)
class ChatPrompt:
    head: str  # what the chat template renders before the messages: the request's tools or own template
    messages: tuple[str, ...]  # each message as canonical JSON, in order


@dataclass(frozen=True)
class TextPrompt:
    text: str


@dataclass(frozen=True)
class TokenPrompt:
    ids: tuple[int, ...]


Prompt = ChatPrompt | TextPrompt | TokenPrompt


@dataclass(frozen=True)
class Family:
    name: str
    style: ErrorStyle
    frame: Callable[[dict[str, Any]], bytes]  # one stream event carrying an error body
    read_prompt: Callable[[dict[str, Any]], Prompt | None]  # the prompt in a parsed body, for cache affinity
    routes: tuple[Route, ...]
    client_id: str | None = None  # the body field in which a client names its request (to cancel it by)

    def style_of(self, route: Route) -> ErrorStyle:
        return route.style or self.style

    def prompt(self, body: bytes) -> Prompt | None:
        """The request's prompt as its body carries it (the first prompt of an OpenAI batch); None
        when there is none to read: the instance will refuse such a body anyway."""
        parsed = json_object(body)
        return self.read_prompt(parsed) if parsed is not None else None

    def named_by_client(self, body: bytes) -> str | None:
        parsed = json_object(body) if self.client_id is not None else None
        value = parsed.get(self.client_id) if parsed is not None else None
        return value if isinstance(value, str) and value else None

    def error_body(self, err: APIError) -> dict[str, Any]:
        return err.for_style(self.style).body(self.style)

    def error_event(self, err: APIError) -> bytes:
        return self.frame(self.error_body(err))


def json_object(body: bytes) -> dict[str, Any] | None:
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return parsed if isinstance(parsed, dict) else None


def claimant(candidates: list[tuple[Family, Route]], body: bytes) -> tuple[Family, Route]:
    """The family whose body this is, where several serve one path (TGI's and vLLM's /generate)."""
    parsed = json_object(body)
    for family, route in candidates:
        if parsed is not None and parsed.get(route.claims) is not None:
            return family, route
    fields = " or ".join(f"`{route.claims}` ({family.name})" for family, route in candidates)
    raise APIError(422, f"{fields} is required in a JSON object body", candidates[0][1].claims)


def canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def plain_prompt(value: Any) -> Prompt | None:
    """A text (a string, or text content parts joined as the instance joins them) or token ids."""
    if isinstance(value, str):
        return TextPrompt(value)
    if not isinstance(value, list) or not value:
        return None
    if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return TokenPrompt(tuple(value))
    if all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in value):
        return TextPrompt("".join(p["text"] for p in value))
    return None


def chat_prompt(body: dict[str, Any]) -> Prompt | None:
    messages = body["messages"]
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        return None
    head = {k: body[k] for k in ("tools", "chat_template", "chat_template_kwargs") if body.get(k) is not None}
    return ChatPrompt(canonical(head), tuple(canonical(m) for m in messages))
