"""Keeping media bytes on P: the body a decode node gets names each medium by a reference, and P
holds the client's body until the request ends, for a recompute to read the media again.

D never reads a medium (P hands over the prompt with the media expanded, and their spans, cache
keys and rotary delta), so the copy of the body that goes to D (`POST /pd/v1/decode`) has every
media part's data: URI, URL or path (input_audio's base64 data) replaced by
`mindie-media:<kind>:<sha256 hex of the reference as the client sent it>`; every other field, the
ones D renders the response from, stays. A request D sends back for recompute carries that body,
so P restores the client's from what it holds under the req-id (`HeldBodies`), which it drops when
D says the request ended (`POST /pd/v1/finished`), on stopInfer, or past a size cap or an age.
Nothing here loads torch.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from mindie.pd.recompute import CONTINUATION_KEY
from mindie.server.protocols.media import MEDIA_PARTS

REFERENCE_SCHEME = "mindie-media"
HOLD_MAX_BYTES = 256 * 2**20  # bodies P holds for recomputes, all requests together
HOLD_TTL_S = 3600.0  # a body D never reported finished (D died) is dropped after this long


def reference(kind: str, ref: str) -> str:
    return f"{REFERENCE_SCHEME}:{kind}:{hashlib.sha256(ref.encode()).hexdigest()}"


def _map_refs(node: Any, fn: Callable[[str, str], str]) -> list[str]:
    """Replaces the reference `ref` of each media content part under `node` by fn(kind, ref), in
    place, and returns the references it found. Wherever a family keeps content parts (chat
    messages, /infer and TGI `inputs`, vLLM `prompt`, Triton `text_input`), a media part is an
    object whose `type` names a media part type and whose field of that name holds the reference:
    a string, or an object with `url` (input_audio: `data`). A malformed one is left alone: the
    family's parse refused it on P before anything went to D."""
    found: list[str] = []
    if isinstance(node, list):
        for value in node:
            found += _map_refs(value, fn)
    if not isinstance(node, dict):
        return found
    kind = MEDIA_PARTS.get(node.get("type")) if isinstance(node.get("type"), str) else None
    if kind is not None:
        name = node["type"]
        value, key = node.get(name), "data" if name == "input_audio" else "url"
        if isinstance(value, str):
            found.append(value)
            node[name] = fn(kind, value)
        elif isinstance(value, dict) and isinstance(value.get(key), str):
            found.append(value[key])
            node[name] = {**value, key: fn(kind, value[key])}
    for value in node.values():
        found += _map_refs(value, fn)
    return found


def redact(body: bytes) -> tuple[str, bool]:
    """(the body for D, whether it held media). A body that held none goes as it came, byte for
    byte; one that did is written again as compact JSON (D parses it, nothing compares bytes)."""
    text = body.decode()
    try:
        parsed = json.loads(text)
    except ValueError:  # the family's parse accepted it, so it is JSON; nothing to redact otherwise
        return text, False
    if not _map_refs(parsed, reference):
        return text, False
    return json.dumps(parsed, ensure_ascii=False, separators=(",", ":")), True


def names_held_media(body: bytes) -> bool:
    """Whether a body's media parts are references (it is a redacted one)."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return False
    return any(ref.startswith(f"{REFERENCE_SCHEME}:") for ref in _map_refs(parsed, lambda _, ref: ref))


def retry_names_held_media(retry: bytes) -> bool:
    """Whether a decode node's `retry:` body stands for a client body whose media P holds: the
    client body it carries (mindieContinuation.body) names them by reference."""
    try:
        cont = json.loads(retry).get(CONTINUATION_KEY)
    except (ValueError, AttributeError):
        return False
    return isinstance(cont, dict) and isinstance(cont.get("body"), str) and names_held_media(cont["body"].encode())


class MediaGone(Exception):
    """A recompute's body names media this prefill node no longer holds (or never held)."""


class HeldBodies:
    """P's copies of the bodies it redacted, by req-id: oldest dropped first past `max_bytes`,
    each dropped `ttl_s` after it was last held."""

    def __init__(self, max_bytes: int = HOLD_MAX_BYTES, ttl_s: float = HOLD_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_bytes, self.ttl_s, self._clock = max_bytes, ttl_s, clock
        self._bodies: OrderedDict[str, tuple[float, bytes]] = OrderedDict()  # req-id -> (expiry, body)
        self.size = 0

    def __len__(self) -> int:
        return len(self._bodies)

    def hold(self, req_id: str, body: bytes) -> None:
        self.drop(req_id)
        if len(body) > self.max_bytes:
            return  # cannot be held: a recompute of it fails with MediaGone
        self._bodies[req_id] = (self._clock() + self.ttl_s, body)
        self.size += len(body)
        self._evict()

    def drop(self, req_id: str) -> None:
        held = self._bodies.pop(req_id, None)
        if held is not None:
            self.size -= len(held[1])

    def restore(self, req_id: str, redacted: bytes) -> bytes:
        """The client's body behind `redacted` (what D got for req_id). A body without media
        references is its own; MediaGone if P does not hold the one it came from."""
        if not names_held_media(redacted):
            return redacted
        self._evict()
        held = self._bodies.get(req_id)
        if held is None:
            raise MediaGone(f"this prefill node no longer holds the media of request {req_id} (the request "
                            "ended, was evicted past the hold's size or age limit, or was prefilled elsewhere)")
        if redact(held[1])[0] != redacted.decode():
            raise MediaGone(f"the media references of request {req_id} are not those of the body this prefill "
                            "node handed over")
        return held[1]

    def _evict(self) -> None:
        now = self._clock()
        while self._bodies:
            req_id, (expiry, _) = next(iter(self._bodies.items()))
            if expiry > now and self.size <= self.max_bytes:
                return
            self.drop(req_id)
