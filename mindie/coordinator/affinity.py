"""`cache_affinity`'s prefix index: which prompt prefixes each P has been sent, so that a request
goes to the P whose prefix cache most likely holds the longest start of it.

How the coordinator knows what a P holds. A P's prefix cache is keyed by chained hashes of token
blocks (`mindie.engine.block_manager`), and the coordinator has neither tokenizer nor model. So it
keys its own index on the prompt as the client sent it, the way SGLang's router (a radix tree of
request text per worker) and llm-d's approximate prefix scorer (hashes of fixed-size text chunks
per pod) route:

* a chat: one hash per message, chained (each hash covers the messages before it), after a root
  that covers what renders ahead of the messages (tools, a template of the request's own). Turn
  k + 1 of a conversation repeats turn k's messages, so it matches every message turn k sent;
* a text prompt: one chained hash per `CHUNK_CHARS` characters (a partial last chunk is left out:
  P caches whole blocks only, and a longer prompt would not share it);
* token ids (`input_id`, Triton's tensor, OpenAI's token prompts): one per `CHUNK_TOKENS` ids.

A P's hashes are recorded when a request is sent to it, in a per-P LRU bounded to
`ENTRIES_PER_INSTANCE`; a P's match is the deepest of the request's hashes it holds, and
`Prefixes.share` says how much of the prompt that covers.

The alternative, instances reporting their block hashes while the coordinator tokenizes every
request, would need the model's tokenizer and chat template in the coordinator, make every request
pay a tokenization, and track P's evictions through a report stream; routing on the text needs no
call to anyone, so a pick never adds a round trip.

What this approximates: the index cannot see P evict (it assumes a P keeps what it was sent, up
to the bound), nor a chat template that renders an earlier message differently once later ones
follow. Either costs a cache miss, never a wrong answer. It forgets a P when the P leaves the
schedule (unreachable, offline, restarted: a restart is seen as the status poll failing), since
its cache may be gone; a restart between two polls (1 s) goes unnoticed.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from mindie.server.protocols.family import ChatPrompt, Prompt, TextPrompt

# About 16 tokens each, at the ~4 characters per token MindIE's own `string_token_rate` assumes:
# finer than P's blocks (128 tokens by default), so two P's matches still tell apart.
CHUNK_CHARS = 64
CHUNK_TOKENS = 16
# Per P: 16 Ki entries stand for ~256 Ki tokens of text, more than the default 2 GiB KV pool holds for the
# embedded model, in about 2 MiB.
ENTRIES_PER_INSTANCE = 16384

_KEY_BYTES = 8  # a 64-bit hash: a collision only misroutes, and small keys keep the LRU small


@dataclass(frozen=True)
class Prefixes:
    """A prompt's chained hashes: hash i stands for segments 0..i, which end at `ends[i]` of the
    prompt's `size` (characters, or token ids)."""

    hashes: list[int]
    ends: list[int]
    size: int

    def share(self, n: int) -> float:
        """The part of the prompt its first n segments cover."""
        return self.ends[n - 1] / self.size if n else 0.0


def prefixes(prompt: Prompt | None) -> Prefixes:
    if prompt is None:
        return Prefixes([], [], 0)
    hashes, ends, end = [], [], 0
    parent = _hash(b"", _root(prompt))
    for segment, length in _segments(prompt):
        parent = _hash(parent, segment)
        end += length
        hashes.append(int.from_bytes(parent, "little"))
        ends.append(end)
    return Prefixes(hashes, ends, _size(prompt))


def _root(prompt: Prompt) -> bytes:
    """Prompts of different kinds never share a cached prefix: a chat renders through its template."""
    if isinstance(prompt, ChatPrompt):
        return b"chat\0" + prompt.head.encode()
    return b"text" if isinstance(prompt, TextPrompt) else b"tokens"


def _segments(prompt: Prompt) -> Iterator[tuple[bytes, int]]:
    """Each segment, with its size in the prompt."""
    if isinstance(prompt, ChatPrompt):
        yield from ((m.encode(), len(m)) for m in prompt.messages)
    elif isinstance(prompt, TextPrompt):
        text = prompt.text
        for i in range(0, len(text) - CHUNK_CHARS + 1, CHUNK_CHARS):
            yield text[i : i + CHUNK_CHARS].encode(), CHUNK_CHARS
    else:
        ids = prompt.ids
        for i in range(0, len(ids) - CHUNK_TOKENS + 1, CHUNK_TOKENS):
            yield struct.pack(f"<{CHUNK_TOKENS}q", *ids[i : i + CHUNK_TOKENS]), CHUNK_TOKENS


def _size(prompt: Prompt) -> int:
    if isinstance(prompt, ChatPrompt):
        return sum(map(len, prompt.messages))
    return len(prompt.text) if isinstance(prompt, TextPrompt) else len(prompt.ids)


def _hash(parent: bytes, segment: bytes) -> bytes:
    # the segment's length first: ("ab", "c") and ("a", "bc") chain differently
    return hashlib.blake2b(parent + len(segment).to_bytes(8, "little") + segment, digest_size=_KEY_BYTES).digest()


class PrefixIndex:
    """Per instance id, the prefix hashes recently sent there, least recently sent first."""

    def __init__(self, capacity: int = ENTRIES_PER_INSTANCE) -> None:
        self.capacity = capacity
        self._held: dict[int, OrderedDict[int, None]] = {}

    def longest(self, inst_id: int, hashes: Sequence[int]) -> int:
        """How many leading segments of the request the instance was sent: a hash is chained, so
        holding hash i means having been sent segments 0..i, whichever older entries were evicted."""
        held = self._held.get(inst_id)
        if held:
            for n in range(len(hashes), 0, -1):
                if hashes[n - 1] in held:
                    return n
        return 0

    def record(self, inst_id: int, hashes: Sequence[int]) -> None:
        held = self._held.setdefault(inst_id, OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.capacity:
            held.popitem(last=False)

    def forget(self, inst_id: int) -> None:
        self._held.pop(inst_id, None)

    def size(self, inst_id: int) -> int:
        return len(self._held.get(inst_id, ()))

    @property
    def instance_ids(self) -> list[int]:
        return list(self._held)
