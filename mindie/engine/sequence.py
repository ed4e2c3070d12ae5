"""A request's runtime state inside the engine: one sequence per sample, or per live beam."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from mindie.engine.request import EngineRequest, FinishReason


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds KV blocks; prefilling or decoding
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request: EngineRequest
    index: int  # sample number within the request (n / best_of)
    seed: int
    max_total_tokens: int  # prompt + the most new tokens this request may produce
    detokenizer: Any  # IncrementalDetokenizer; owned by the engine's output side
    # Sibling samples wait until sample 0 has computed the prompt, then share its full prompt
    # blocks through the prefix cache instead of prefilling the same tokens again.
    admit_after: Sequence | None = None
    # The live beams of a beam-search request, this one included: one list shared by all of them,
    # kept in the search's row order by the engine. The scheduler admits, schedules and preempts
    # them as one unit, and a beam step waits until every one of them is fully computed.
    lockstep: list[Sequence] | None = None
    matcher: Any = None  # this sample's GrammarMatcher when its request has a grammar
    # Prompt log-probabilities by position (position 0 has none), filled while sample 0 prefills
    # when the request asks for them; a recomputed position overwrites its entry.
    prompt_logprobs: list[Any] | None = None
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    status: SequenceStatus = SequenceStatus.WAITING
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0  # prefix-cache hit at first admission
    cumulative_logprob: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # Since when the sequence waits for its next token: arrival, then the end of the step that
    # gave it its last token. A token's queue wait runs from here to the start of its step.
    ready_time: float = 0.0
    finish_reason: FinishReason | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.request.prompt_token_ids)
        if not self.ready_time:
            self.ready_time = self.request.arrival_time

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Sample 0 of a request that asks for prompt log-probabilities, until it has them all."""
        if (self.index != 0 or self.request.params.prompt_logprobs is None or self.num_prompt_tokens < 2
                or self.request.continuation is not None):  # a continued request had them where it began
            return False
        # positions are recorded in order, so the last one comes last
        return self.prompt_logprobs is None or self.prompt_logprobs[-1] is None

    @property
    def seq_id(self) -> str:
        return f"{self.request.request_id}#{self.index}"

    @property
    def admissible(self) -> bool:
        lead = self.admit_after
        if lead is None or lead.status is SequenceStatus.FINISHED:
            return True
        return lead.num_computed_tokens >= lead.num_prompt_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_pending_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def sort_key(self) -> tuple[int, float]:
        """Priority first (1 before 5), then arrival: the order of admission and of survival."""
        return (self.request.priority, self.request.arrival_time)
