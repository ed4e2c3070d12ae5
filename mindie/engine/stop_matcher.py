"""Stop strings found in one pass over the text, whatever their number (Aho-Corasick).

A request may carry up to 1024 stop strings (32768 characters in all). Searching for each of them
in every step's text costs their number per token; the automaton instead reads each generated
character once, in amortized constant time, and its state is exactly what the detokenizer must
hold back: the longest suffix of the text that is a prefix of some stop string.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class _Automaton:
    goto: tuple[dict[str, int], ...]  # per node: character -> child
    fail: tuple[int, ...]  # per node: the node of its longest proper suffix in the trie
    depth: tuple[int, ...]  # per node: length of the prefix it stands for
    # per node: length of the longest stop string that is a suffix of the node's prefix (0: none);
    # at a given end the longest match is the one that starts first
    match: tuple[int, ...]


@functools.lru_cache(maxsize=64)  # the samples of one request, and clients that repeat their list
def _build(stops: tuple[str, ...]) -> _Automaton:
    goto: list[dict[str, int]] = [{}]
    depth, terminal = [0], [0]
    for s in stops:
        node = 0
        for ch in s:
            nxt = goto[node].get(ch)
            if nxt is None:
                nxt = len(goto)
                goto[node][ch] = nxt
                goto.append({})
                depth.append(depth[node] + 1)
                terminal.append(0)
            node = nxt
        terminal[node] = len(s)
    fail, match = [0] * len(goto), list(terminal)
    queue = deque(goto[0].values())
    while queue:  # breadth first: a node's suffix link is final before its children need it
        node = queue.popleft()
        match[node] = terminal[node] or match[fail[node]]
        for ch, child in goto[node].items():
            if node:  # the root's children fall back to the root
                f = fail[node]
                while f and ch not in goto[f]:
                    f = fail[f]
                fail[child] = goto[f].get(ch, 0)
            queue.append(child)
    return _Automaton(tuple(goto), tuple(fail), tuple(depth), tuple(match))


class StopMatcher:
    """Feeds text and reports the first stop string it completes: among all occurrences the one
    that ends first, and of those the longest (the one that starts first)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._auto = _build(tuple(dict.fromkeys(s for s in stops if s)))  # empty strings never match
        self._node = 0

    def feed(self, text: str) -> tuple[int, int] | None:
        """Reads `text`; on the first completed stop string returns (end index in `text`, the
        string's length) and stops reading. The state is then undefined: nothing may follow."""
        goto, fail, match = self._auto.goto, self._auto.fail, self._auto.match
        node = self._node
        for i, ch in enumerate(text):
            while node and ch not in goto[node]:
                node = fail[node]
            node = goto[node].get(ch, 0)
            if match[node]:
                self._node = node
                return i + 1, match[node]
        self._node = node
        return None

    @property
    def held(self) -> int:
        """Characters at the end of the text read so far that may still begin a stop string."""
        return self._auto.depth[self._node]
