"""A model's reasoning kept out of its answer, as vLLM's `qwen3` reasoning parser splits it: the text
between `<think>` and `</think>` is reasoning (OpenAI chat's `reasoning_content`), the rest content.

Which tags a served model uses is decided once at start-up (`reasoning_tags`): `--reasoning-parser
qwen3` names them, and by default (`auto`) a Qwen3 model whose tokenizer holds both tags as tokens
gets them. A sample starts inside its reasoning when the prompt itself opened a think block that it
did not close (templates that end the generation prompt with `<think>`); otherwise text is content
until the model writes `<think>`, so output without tags is unchanged. Only the first block counts:
after `</think>` every character is content. The tags themselves are dropped. Streaming and whole
output split alike: a tag cut across deltas is held back until it is complete or cannot be one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from mindie.config_keys import ConfigError

if TYPE_CHECKING:
    from mindie.tokenizer import Tokenizer

REASONING_PARSERS = ("auto", "none", "qwen3")  # --reasoning-parser (vLLM's name for Qwen3's)


@dataclass(frozen=True)
class ThinkTags:
    start: str = "<think>"
    end: str = "</think>"

    def opened_by(self, prompt: str) -> bool:
        """Whether the prompt ends inside a think block: its last start tag comes after its last end tag."""
        return prompt.rfind(self.start) > prompt.rfind(self.end)


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
        return tags
    return None


@dataclass(frozen=True)
class Piece:
    text: str
    reasoning: bool  # else content


class ReasoningSplitter:
    """One sample's output, fed as it streams: `feed` returns the pieces that are certain so far,
    `finish` the rest."""

    def __init__(self, tags: ThinkTags, in_reasoning: bool) -> None:
        self.tags = tags
        # before the block (looking for its start), inside it (looking for its end), or after it
        self._state = "inside" if in_reasoning else "before"
        self.entered = in_reasoning  # whether the output is (or was) inside a think block
        self._held = ""  # the end of the text so far that may be the start of a tag

    def feed(self, text: str) -> list[Piece]:
        text, self._held = self._held + text, ""
        out: list[Piece] = []
        while text and self._state != "after":
            tag = self.tags.start if self._state == "before" else self.tags.end
            at = text.find(tag)
            if at < 0:
                keep = _partial_tag(text, tag)
                text, self._held = text[: len(text) - keep], text[len(text) - keep:]
                break
            out.append(Piece(text[:at], self._state == "inside"))
            text = text[at + len(tag):]
            self._state = "inside" if self._state == "before" else "after"
            self.entered = True
        out.append(Piece(text, self._state == "inside"))
        return [p for p in out if p.text]

    def finish(self) -> list[Piece]:
        held, self._held = self._held, ""
        return [Piece(held, self._state == "inside")] if held else []


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (at most len(tag) - 1)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def split_reasoning(tags: ThinkTags, text: str, in_reasoning: bool) -> tuple[str | None, str | None]:
    """A finished sample's (reasoning, content). Without a think block: (None, the text unchanged);
    with one, as vLLM: an empty part is None."""
    splitter = ReasoningSplitter(tags, in_reasoning)
    pieces = splitter.feed(text) + splitter.finish()
    content = "".join(p.text for p in pieces if not p.reasoning)
    if not splitter.entered:
        return None, content
    return "".join(p.text for p in pieces if p.reasoning) or None, content or None
