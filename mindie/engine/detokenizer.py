"""Incremental detokenization: a request's generated token ids, a few at a time, to text deltas.

Two layers:

1. Token ids to text, with vLLM's prefix_offset/read_offset technique: the tokens since the last
   emission (plus the ones before them as left context) are decoded as one window, and new text is
   taken only once it no longer ends in U+FFFD, so that a character whose UTF-8 bytes are split
   across byte-level tokens is never emitted half-finished. Decoding a window with left context,
   and slicing off the context's text, also keeps tokenizers with leading-space rules (SentencePiece
   "▁") right.
2. Stop strings over that text, through one Aho-Corasick automaton (mindie/engine/stop_matcher.py)
   that reads each new character once, so a step costs its new text whatever the number of stop
   strings. Trailing characters that could still be the start of a stop string (the automaton's
   state) are held back until they cannot; a match can never start in emitted text.

A stop "matches" at the first moment the text contains it: among all occurrences, the one that ends
first wins, and of those ending at the same place the one that starts first (the longest). This
is independent of how the text arrives, so the result equals cutting the complete text at that
occurrence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mindie.engine.stop_matcher import StopMatcher
from mindie.tokenizer import Tokenizer

if TYPE_CHECKING:
    from mindie.engine.request import EngineRequest

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded as left context of the first window (as vLLM's initial offset).
_PROMPT_CONTEXT_TOKENS = 5
# A UTF-8 character has at most 4 bytes, so at most 3 tokens can hold an unfinished one. Text that
# still ends in U+FFFD after this many unemitted tokens is invalid bytes the model really produced;
# emit it rather than let the decode window (and each step's cost) grow without bound.
_MAX_HELD_TOKENS = 8
# Emitted token ids before the window are dropped once there are this many.
_TRIM_IDS_AT = 256


@dataclass
class DetokenizerDelta:
    text: str  # new text to emit now (may be "")
    # The stop string that matched in this append, if any (generation must finish).
    stop_string: str | None


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        if isinstance(stop, str):
            stop = (stop,)
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = StopMatcher(stop) if any(stop) else None
        self._include_stop = include_stop_str_in_output

        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        if context and self._decode(context).endswith(_REPLACEMENT):
            # The prompt ends inside a character: its bytes cannot be told apart from the output's,
            # so decode the output on its own (as `tokenizer.decode(output_ids)` would).
            context = []
        self._ids: list[int] = context  # left context + generated ids not yet trimmed
        self._prefix_offset = 0  # window start: context for the tokens after read_offset
        self._read_offset = len(context)  # first token whose text is not yet taken

        self._pending = ""  # decoded text not yet emitted (held back for stop strings)
        self._chunks: list[str] = []  # emitted deltas
        self._num_tokens = 0
        self._stop_string: str | None = None
        self._finished = False

    @classmethod
    def for_request(cls, tokenizer: Tokenizer, request: EngineRequest) -> IncrementalDetokenizer:
        """One sample's detokenizer, with its request's stop strings and special-token setting."""
        params = request.params
        return cls(tokenizer, request.prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
                   stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output)

    # --- public ----------------------------------------------------------------------------

    @property
    def text(self) -> str:
        """All text emitted so far (the deltas joined)."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def num_tokens(self) -> int:
        """Generated tokens consumed so far. When a stop string matches, the tokens after the one
        that completed it in the same `append` are not consumed and not counted."""
        return self._num_tokens

    @property
    def stop_string(self) -> str | None:
        """The stop string that finished the request, if one did."""
        return self._stop_string

    def append(self, token_ids: Sequence[int]) -> DetokenizerDelta:
        if self._stop_string is not None:
            raise RuntimeError(
                f"a stop string ({self._stop_string!r}) already matched; nothing can follow"
            )
        if self._finished:
            raise RuntimeError("flush() was called; the request is finished")
        out: list[str] = []
        for token_id in token_ids:
            self._ids.append(int(token_id))
            self._num_tokens += 1
            new_text = self._decode_step(final=False)
            if new_text and self._take(new_text, out, final=False):
                return DetokenizerDelta("".join(out), self._stop_string)
        return DetokenizerDelta("".join(out), None)

    def flush(self) -> str:
        """Ends the request (eos, length, abort): releases text held back for an unfinished
        character or an unfinished stop string. Returns "" after a stop match or a second call."""
        if self._stop_string is not None or self._finished:
            return ""
        self._finished = True
        out: list[str] = []
        self._take(self._decode_step(final=True), out, final=True)
        return "".join(out)

    # --- internals -------------------------------------------------------------------------

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_step(self, *, final: bool) -> str:
        """The text of the tokens after read_offset, or "" while it may end in a split character."""
        ids = self._ids
        if self._read_offset == len(ids):
            return ""
        prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text):
            return ""  # e.g. only skipped special tokens so far
        if (
            new_text.endswith(_REPLACEMENT)
            and not final
            and len(ids) - self._read_offset < _MAX_HELD_TOKENS
        ):
            return ""  # a character may still be completed by the next token
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        if self._prefix_offset >= _TRIM_IDS_AT:
            del ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return new_text[len(prefix_text) :]

    def _take(self, new_text: str, out: list[str], *, final: bool) -> bool:
        """Adds decoded text: emits what is safe into `out`; True when a stop string matched."""
        pending = self._pending + new_text
        if self._stop is None:
            self._emit(pending, out)
            self._pending = ""
            return False
        match = self._stop.feed(new_text)  # the held-back text was read already
        if match is not None:
            end = len(self._pending) + match[0]
            start = end - match[1]  # >= 0: a match never starts in emitted text
            self._emit(pending[: end if self._include_stop else start], out)
            self._pending = ""
            self._stop_string = pending[start:end]
            return True
        keep = 0 if final else self._stop.held
        self._emit(pending[: len(pending) - keep], out)
        self._pending = pending[len(pending) - keep :]
        return False

    def _emit(self, text: str, out: list[str]) -> None:
        if text:
            self._chunks.append(text)
            out.append(text)

