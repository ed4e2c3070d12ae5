"""A grammar that starts after the model's reasoning: the policy half of guided decoding with a
reasoning model (the mechanism, one request's position in its grammar, is matcher.py's).

As vLLM does with a reasoning parser, the think block is free text and the grammar governs what
follows `</think>`: no mask while the reply is inside the block, and the grammar's matcher sees
the first token after the end token as its first. Where the reply starts comes from the prompt
(`ThinkTags.reply_phase`):

- inside a block the prompt opened (templates that end with `<think>\\n`): free until `</think>`;
- after a block the prompt closed (Qwen3's `enable_thinking: false`): the grammar from the first token;
- before any block (Qwen3's default, the model writes `<think>` itself): the first token is the
  grammar's or `<think>`, which opens the block. vLLM instead leaves such a reply free until a
  `</think>` that a reply which never thinks does not write; here it then follows the grammar.

Every decision is on token ids, never on text, so the reply splits as the grammar saw it (the
chat renderer lets a constrained reply open a block only at its first token, as here).

Two rules keep a constrained reply's answer whole whatever the model does in its reasoning: a
token that would end the sample inside the block (EOS, a stop token) becomes `</think>`, and so
does any token once what is left of max_tokens is only enough for `</think>` and the shortest
completion of the grammar (JSON grammars, whose shortest completion is known; see matcher.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from mindie.structured.reasoning_parser import Phase, ThinkTags

if TYPE_CHECKING:  # the gate is built where requests are parsed, which never loads torch
    import torch

    from mindie.structured.matcher import GrammarMatcher


@dataclass(frozen=True)
class ReasoningGate:
    """Where a reply's grammar starts: the think tags' token ids and the phase the reply starts in."""

    start_id: int
    end_id: int
    phase: Phase

    @classmethod
    def for_prompt(cls, tags: ThinkTags, prompt: str) -> ReasoningGate:
        if tags.start_id is None or tags.end_id is None:
            raise ValueError("the think tags have no token ids: a grammar cannot be gated on them")
        return cls(tags.start_id, tags.end_id, tags.reply_phase(prompt))


class GatedMatcher:
    """One sample's grammar behind its reasoning: the engine-facing interface of GrammarMatcher
    (mask, budget rule, advance), with the gate's phase deciding whether the grammar sees a token.
    Not thread-safe; owned by the engine thread."""

    def __init__(self, inner: GrammarMatcher, gate: ReasoningGate) -> None:
        self._inner = inner
        self._gate = gate
        self.phase = gate.phase
        # Tokens of the grammar's shortest completion from its start (None: not known), found once,
        # at the first budget check that needs it: the grammar does not move while the reply reasons.
        self._answer_tokens: int | None = None
        self._answer_known = False

    @property
    def bitmask_words(self) -> int:
        return self._inner.bitmask_words

    @property
    def constrains_next(self) -> bool:
        """Whether the next token is masked: not while reasoning."""
        return self.phase is not Phase.INSIDE

    def fill_bitmask(self, out_row: torch.Tensor) -> None:
        """The grammar's allowed tokens, and before any block also `<think>`, which opens one."""
        self._inner.fill_bitmask(out_row)
        if self.phase is Phase.BEFORE:
            word, bit = divmod(self._gate.start_id, 32)
            value = int(out_row[word]) | (1 << bit)
            out_row[word] = value - (1 << 32) if value >= 1 << 31 else value  # the int32 bit pattern

    def fit_budget(self, token: int, budget: int, ends_sample: bool = False) -> int:
        """The token to take now with `budget` tokens left (this one included); `ends_sample`: the
        token would end the sample (EOS, a stop token). See the module docstring for the rules."""
        start, end = self._gate.start_id, self._gate.end_id
        if self.phase is Phase.AFTER:
            return self._inner.fit_budget(token, budget, ends_sample)
        if self.phase is Phase.BEFORE:
            if token != start:
                return self._inner.fit_budget(token, budget, ends_sample)
            needed = self._min_answer()
            if needed is None or budget >= 2 + needed:  # room for <think>, </think> and the answer
                return token
            forced = self._inner.shortest_start(budget)
            return token if forced is None else forced
        if token == end:
            return token
        needed = self._min_answer()
        if ends_sample or (needed is not None and budget <= 1 + needed):
            return end
        return token

    def advance(self, token_id: int) -> bool:
        """Consume the taken token: the gate's phase moves on its tags, the grammar consumes the
        answer's tokens. False if the grammar forbids the token (see GrammarMatcher.advance)."""
        if self.phase is Phase.INSIDE:
            if token_id == self._gate.end_id:
                self.phase = Phase.AFTER
            return True
        if self.phase is Phase.BEFORE:
            if token_id == self._gate.start_id:
                self.phase = Phase.INSIDE
                return True
            self.phase = Phase.AFTER
        return self._inner.advance(token_id)

    def accepts_eos(self) -> bool:
        return self.phase is Phase.AFTER and self._inner.accepts_eos()

    def is_finished(self) -> bool:
        return self.phase is Phase.AFTER and self._inner.is_finished()

    def min_tokens(self, limit: int = 4096) -> int | None:
        """Tokens the shortest whole reply from here needs (greedy, an upper bound): inside the
        block, `</think>` and then the answer; None if not known."""
        if self.phase is not Phase.INSIDE:
            return self._inner.min_tokens(limit)
        needed = self._inner.min_tokens(limit - 1)
        return None if needed is None else 1 + needed

    @property
    def error(self) -> str | None:
        return self._inner.error

    def _min_answer(self) -> int | None:
        if not self._answer_known:
            self._answer_tokens, self._answer_known = self._inner.min_tokens(), True
        return self._answer_tokens
