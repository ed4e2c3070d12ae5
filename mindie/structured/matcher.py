"""One request's position in its compiled grammar, and the budget rule that lets a JSON value
finish within max_tokens: a greedy search for a short completion from the current state, built
from per-tokenizer "closer" tokens, whose next token replaces the sampled one once only that
completion still fits.
"""

from __future__ import annotations

from dataclasses import dataclass

import llguidance
import numpy as np
import torch

from mindie.tokenizer import Tokenizer


@dataclass(frozen=True)
class Closers:
    """What a shortest completion is built from, per tokenizer: tokens that end things, best
    first, then the shortest values, and every token's length to pick the longest allowed one
    where none of those fits (an enum value, a required key, a string's minimum length).

    The order is what keeps the greedy search finite: a closing quote first (inside a string it
    ends the string; where a value is due it opens the shortest one), then the characters that
    close containers or separate items, which are never content outside a string, and only then
    values. A digit before a separator would extend a number forever ("3" -> "30" -> "300").
    """

    preferred: tuple[int, ...]
    lengths: np.ndarray  # int32 [vocab]: characters of each token's text; -1 for special tokens

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, vocab_size: int) -> Closers:
        preferred = []
        for piece in ('"', '"}', '"]', "}", "]", "}]", "}}", ", ", ",", "0", "null", "true", "false", ": ", ":"):
            ids = tokenizer.encode(piece, add_special_tokens=False)
            if len(ids) == 1 and ids[0] not in preferred:
                preferred.append(ids[0])
        lengths = np.array([len(tokenizer.decode([t], skip_special_tokens=True)) or -1 for t in range(vocab_size)],
                           dtype=np.int32)
        return cls(tuple(preferred), lengths)


def _shortest_path(matcher: llguidance.LLMatcher, closers: Closers, limit: int) -> list[int] | None:
    """A short token path from `matcher`'s state (not changed) to a complete value, found greedily:
    forced tokens, else the first allowed closer, else the longest allowed token; None if there is
    none within `limit` tokens. Each step of the path leads to the rest of it, so following it
    one token at a time takes exactly its length."""
    m = matcher.deep_copy()
    path: list[int] = []
    while not m.is_accepting():
        if len(path) >= limit or m.is_error():
            return None
        forced = m.compute_ff_tokens()[: limit - len(path)]
        if forced:
            if m.try_consume_tokens(forced) != len(forced):
                return None
            path += forced
            continue
        # A single-token check per closer: far cheaper than the whole vocabulary's mask.
        token = next((t for t in closers.preferred if m.validate_tokens([t]) == 1), -1)
        if token < 0:
            allowed = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")
            scores = np.where(allowed[: len(closers.lengths)].astype(bool), closers.lengths, -2)
            token = int(scores.argmax())
            if scores[token] < 0:
                return None  # only special tokens (EOS) left, yet not accepting
        if not m.consume_token(token):
            return None
        path.append(token)
    return path


class GrammarMatcher:
    """One request's position in its grammar. Not thread-safe; owned by the engine thread."""

    def __init__(self, matcher: llguidance.LLMatcher, bitmask_words: int, closers: Closers | None = None) -> None:
        self._matcher = matcher
        self._words = bitmask_words
        self._closers = closers
        # A completion that fits the budget from the current state: a model that follows it needs
        # no search. None when not known.
        self._path: list[int] | None = None
        self._next: tuple[int, list[int]] | None = None  # fit_budget's token and the path after it
        # No completion fits what is left: the rule cannot help any more, and searching again
        # each step would only cost time (max_tokens cuts the value as it would a free one).
        self._hopeless = False

    @property
    def constrains_next(self) -> bool:
        """Whether the sampler masks the next token: always (a gated grammar may not; reasoning_gate.py)."""
        return True

    def fit_budget(self, token: int, budget: int, ends_sample: bool = False) -> int:
        """The token to take now with `budget` tokens left (this one included): `token`, unless
        the value could then no longer be completed within the budget, in which case the next
        token of a shortest completion from here. So a value always finishes, closing what is open
        and filling the required fields, when the budget comes down to what that needs.
        (`ends_sample` is for a gated grammar: here the mask keeps EOS out until the value is whole.)"""
        if self._closers is None or self._hopeless:
            return token
        if self._path and self._path[0] == token:  # the known completion goes on fitting
            self._next = (token, self._path[1:])
            return token
        after = self._matcher.deep_copy()
        if after.consume_token(token):
            rest = _shortest_path(after, self._closers, budget - 1)
            if rest is not None:
                self._next = (token, rest)
                return token
        forced = self.shortest_start(budget)
        return token if forced is None else forced

    def shortest_start(self, budget: int) -> int | None:
        """The next token of a shortest completion from here that fits `budget` tokens, to be taken
        now; None where there is none (or the value is already complete, or no completion is known)."""
        if self._closers is None or self._hopeless:
            return None
        path = self._path if self._path else _shortest_path(self._matcher, self._closers, budget)
        if not path:  # None: nothing fits any more; []: the value is already complete (EOS is allowed)
            self._hopeless = path is None
            return None
        self._next = (path[0], path[1:])
        return path[0]

    def min_tokens(self, limit: int = 4096) -> int | None:
        """Tokens the shortest completion from here needs (greedy, an upper bound); None if not known."""
        if self._closers is None:
            return None
        path = _shortest_path(self._matcher, self._closers, limit)
        return None if path is None else len(path)

    @property
    def bitmask_words(self) -> int:
        return self._words

    def fill_bitmask(self, out_row: torch.Tensor) -> None:
        """Write the allowed next tokens into ``out_row`` (int32 [bitmask_words], contiguous):
        bit ``j`` of word ``w`` set = token ``32 * w + j`` allowed. Once the value is complete only
        the EOS tokens are allowed; after an error, only EOS too."""
        # Written through a raw pointer: a wrong buffer must be an exception, not a crash.
        if out_row.dtype != torch.int32 or out_row.device.type != "cpu" or out_row.shape != (self._words,):
            got = f"{out_row.dtype} {list(out_row.shape)} on {out_row.device}"
            raise ValueError(f"out_row: expected int32 [{self._words}] on the CPU, got {got}")
        if not out_row.is_contiguous():
            raise ValueError("out_row: must be contiguous")
        self._matcher.unsafe_compute_mask_ptr(out_row.data_ptr(), 4 * self._words)

    def advance(self, token_id: int) -> bool:
        """Consume the sampled token. False if the grammar forbids it: the matcher is then in its
        error state for good (see :attr:`error`) and the request should finish."""
        known, self._next = self._next, None
        self._path = known[1] if known is not None and known[0] == token_id else None
        return self._matcher.consume_token(token_id)

    def accepts_eos(self) -> bool:
        """The text so far is a complete value: EOS is allowed now."""
        return self._matcher.is_accepting()

    def is_finished(self) -> bool:
        """Nothing but EOS can follow (the value is closed, or the matcher failed)."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() if self._matcher.is_error() else None
