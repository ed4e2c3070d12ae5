"""A model's reasoning kept out of its answer, as vLLM's `qwen3` reasoning parser splits it: the text
between `<think>` and `</think>` is reasoning (OpenAI chat's `reasoning_content`), the rest content.

Which tags a served model uses is decided once at start-up (`reasoning_tags`): `--reasoning-parser
qwen3` names them, and by default (`auto`) a Qwen3 model whose tokenizer holds both tags as tokens
gets them. A sample starts inside its reasoning when the prompt itself opened a think block that it
did not close (templates that end the generation prompt with `<think>`); otherwise text is content
until the model writes `<think>`, so output without tags is unchanged. Only the first block counts:
after `</think>` every character is content. The tags themselves are dropped. Streaming and whole
output split alike: a tag cut across deltas is held back until it is complete or cannot be one.

A constrained reply (a grammar: structured output, a required tool call) is split as the engine
gated its grammar (mindie/structured/reasoning_gate.py): a think block opens only at the reply's
first token, and a prompt that closed the block leaves the whole reply to content. Otherwise a
`<think>` in the grammar's own output (a JSON string holding the text) would be cut out of it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mindie.config_keys import ConfigError

if TYPE_CHECKING:
    from mindie.tokenizer import Tokenizer

REASONING_PARSERS = ("auto", "none", "qwen3")  # --reasoning-parser (vLLM's name for Qwen3's)


class Phase(enum.Enum):
    """Where a reply is relative to its think block."""

    BEFORE = "before"  # no block yet: one may open
    INSIDE = "inside"  # reasoning, until the end tag
    AFTER = "after"  # content to the end


@dataclass(frozen=True)
class ThinkTags:
    start: str = "<think>"
    end: str = "</think>"
    # The tags' token ids, where the tokenizer has them as single tokens (reasoning_tags fills them):
    # the engine gates a grammar on these (reasoning_gate.py), never on text.
    start_id: int | None = None
    end_id: int | None = None

    def opened_by(self, prompt: str) -> bool:
        """Whether the prompt ends inside a think block: its last start tag comes after its last end tag."""
        return prompt.rfind(self.start) > prompt.rfind(self.end)

    def reply_phase(self, prompt: str) -> Phase:
        """Where the reply to `prompt` starts: inside a block the prompt opened; after one the prompt
        closed at its very end (Qwen3's `enable_thinking: false` writes `<think>\n\n</think>\n\n`);
        else before any block. Only a block closed at the end counts: an earlier turn's closed block
        (tool-call rounds keep them) does not stop this reply from thinking."""
        if self.opened_by(prompt):
            return Phase.INSIDE
        return Phase.AFTER if prompt.rstrip().endswith(self.end) else Phase.BEFORE


def reasoning_tags(parser: str, architecture: str, tokenizer: Tokenizer) -> ThinkTags | None:
    """The tags to split on for `--reasoning-parser parser`, None where output is not split (a
    ConfigError for a parser the model cannot have, known once it is loaded)."""
    if parser not in REASONING_PARSERS:
        raise ConfigError(f"reasoning parser must be one of {list(REASONING_PARSERS)}, got {parser!r}")
    tags = ThinkTags()
    has_tokens = all(tokenizer.backend.token_to_id(t) is not None for t in (tags.start, tags.end))
    if parser == "qwen3" and not has_tokens:
        raise ConfigError(f"--reasoning-parser qwen3: the tokenizer has no {tags.start} / {tags.end} tokens")
    if parser == "qwen3" or (parser == "auto" and architecture == "qwen3" and has_tokens):
        return ThinkTags(tags.start, tags.end, tokenizer.backend.token_to_id(tags.start),
                         tokenizer.backend.token_to_id(tags.end))
    return None


@dataclass(frozen=True)
class Piece:
    text: str
    reasoning: bool  # else content


class ReasoningSplitter:
    """One sample's output, fed as it streams: `feed` returns the pieces that are certain so far,
    `finish` the rest. `phase`: where the reply starts; `opens_late`: whether a block may open after
    content has begun (free replies), or only at the reply's start (constrained ones)."""

    def __init__(self, tags: ThinkTags, phase: Phase, opens_late: bool = True) -> None:
        self.tags = tags
        self._phase = phase
        self._opens_late = opens_late
        self.entered = phase is Phase.INSIDE  # whether the output is (or was) inside a think block
        self._held = ""  # the end of the text so far that may be the start of a tag

    def feed(self, text: str) -> list[Piece]:
        text, self._held = self._held + text, ""
        out: list[Piece] = []
        while text and self._phase is not Phase.AFTER:
            if self._phase is Phase.BEFORE and not self._opens_late:
                if not text.startswith(self.tags.start):
                    if self.tags.start.startswith(text):  # may still become the start tag
                        self._held, text = text, ""
                    else:
                        self._phase = Phase.AFTER
                    break
            tag = self.tags.start if self._phase is Phase.BEFORE else self.tags.end
            at = text.find(tag)
            if at < 0:
                keep = _partial_tag(text, tag)
                text, self._held = text[: len(text) - keep], text[len(text) - keep:]
                break
            out.append(Piece(text[:at], self._phase is Phase.INSIDE))
            text = text[at + len(tag):]
            self._phase = Phase.INSIDE if self._phase is Phase.BEFORE else Phase.AFTER
            self.entered = True
        out.append(Piece(text, self._phase is Phase.INSIDE))
        return [p for p in out if p.text]

    def finish(self) -> list[Piece]:
        held, self._held = self._held, ""
        return [Piece(held, self._phase is Phase.INSIDE)] if held else []


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (at most len(tag) - 1)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def split_reasoning(tags: ThinkTags, text: str, phase: Phase,
                    opens_late: bool = True) -> tuple[str | None, str | None]:
    """A finished sample's (reasoning, content). Without a think block: (None, the text unchanged);
    with one, as vLLM: an empty part is None."""
    splitter = ReasoningSplitter(tags, phase, opens_late)
    pieces = splitter.feed(text) + splitter.finish()
    content = "".join(p.text for p in pieces if not p.reasoning)
    if not splitter.entered:
        return None, content
    return "".join(p.text for p in pieces if p.reasoning) or None, content or None
