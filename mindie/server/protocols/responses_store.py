"""The Responses API's store: finished responses kept in memory so that `previous_response_id` can
continue a conversation and GET /v1/responses/{id} can return one.

Bounded twice, least recently used first out: by count, and by the characters the entries hold
(each request may carry megabytes of input, and a conversation's entries repeat its history), so
a client storing responses cannot grow the server's memory without limit. One store per server.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from weakref import WeakKeyDictionary

if TYPE_CHECKING:
    from mindie.server.serving import Serving

MAX_ENTRIES = 1024
MAX_CHARS = 2**27


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the response object as it was returned
    # The conversation as chat messages, without the request's instructions (a continuation does
    # not inherit them), ending with this response's output.
    history: list[dict[str, Any]]
    size: int  # characters of body and history, for the store's budget


def stored_response(body: dict[str, Any], history: list[dict[str, Any]]) -> StoredResponse:
    size = len(json.dumps(body, ensure_ascii=False)) + len(json.dumps(history, ensure_ascii=False))
    return StoredResponse(body, history, size)


class ResponseStore:
    """An LRU of stored responses by id; touched by the event loop only."""

    def __init__(self, max_entries: int = MAX_ENTRIES, max_chars: int = MAX_CHARS) -> None:
        self.max_entries = max_entries
        self.max_chars = max_chars
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._chars = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        """Keeps `entry` unless it alone exceeds the character budget; evicts the least recently
        used entries until both bounds hold."""
        self.delete(response_id)
        if entry.size > self.max_chars:
            return
        self._entries[response_id] = entry
        self._chars += entry.size
        while len(self._entries) > self.max_entries or self._chars > self.max_chars:
            _, old = self._entries.popitem(last=False)
            self._chars -= old.size

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._chars -= entry.size
        return True


_STORES: WeakKeyDictionary[Serving, ResponseStore] = WeakKeyDictionary()


def store_of(ctx: Serving) -> ResponseStore:
    """The server's store, made on first use (and gone with the server)."""
    store = _STORES.get(ctx)
    if store is None:
        store = _STORES[ctx] = ResponseStore()
    return store
