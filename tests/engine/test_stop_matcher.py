"""The stop-string automaton: the same first match as a plain search over every string, and a cost
per character that does not grow with the number of strings."""

from __future__ import annotations

import random
import time

from mindie.engine.stop_matcher import StopMatcher


def reference(text: str, stops: list[str]) -> tuple[int, int] | None:
    """(end, length) of the occurrence that ends first, the longest of those: one find per string."""
    best = None
    for s in stops:
        start = text.find(s)
        if start >= 0 and (best is None or (start + len(s), -len(s)) < (best[0], -best[1])):
            best = (start + len(s), len(s))
    return best


def feed_in_pieces(stops: list[str], text: str, rng: random.Random) -> tuple[tuple[int, int] | None, int]:
    """Feeds `text` in random pieces; returns the match as (end in text, length) and what is held."""
    matcher, pos = StopMatcher(stops), 0
    while pos < len(text):
        piece = text[pos: pos + rng.randint(1, 5)]
        found = matcher.feed(piece)
        if found is not None:
            return (pos + found[0], found[1]), 0
        pos += len(piece)
    return None, matcher.held


def test_first_match_equals_a_search_over_every_string():
    rng = random.Random(7)
    alphabet = "abc d"
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 40))]
        found, held = feed_in_pieces(stops, text, rng)
        assert found == reference(text, stops), (text, stops)
        if found is None:  # what is held is the longest suffix that begins a stop string
            assert held == max((k for k in range(len(text) + 1) if any(s.startswith(text[len(text) - k:])
                                                                        for s in stops)), default=0)


def test_cost_per_character_does_not_grow_with_the_number_of_strings():
    rng = random.Random(3)
    text = "".join(rng.choice("abcdefgh ") for _ in range(200_000))
    many = ["".join(rng.choice("abcdefgh") for _ in range(32)) + "!" for _ in range(1024)]  # 1024 x 33 chars

    def seconds(stops: list[str]) -> float:
        StopMatcher(stops)  # built (and cached) outside the timing
        best = float("inf")
        for _ in range(3):
            matcher = StopMatcher(stops)
            t0 = time.perf_counter()
            assert matcher.feed(text) is None
            best = min(best, time.perf_counter() - t0)
        return best

    # a search per string would be ~1000x slower; the automaton is within a small factor
    assert seconds(many) < 5 * seconds(many[:1])
