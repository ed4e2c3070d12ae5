"""A request's runtime state inside the engine: one sequence per sample, or per live beam."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from mindie.engine.request import EngineRequest, FinishReason, RequestOutput, TokenLogprob


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds KV blocks; prefilling or decoding
    FINISHED = "finished"


class StepInfo(NamedTuple):
    """What every token computed in one step reports: the step's size and when it started."""

    batch_size: int
    started: float  # time.monotonic() at the start of the step

    def wait_s(self, ready_time: float) -> float:
        return max(0.0, self.started - ready_time)


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
    def cache_keys(self) -> list[int]:
        """What the prefix cache hashes for this sequence: its token ids, except that each media
        placeholder token becomes a negative key made of its item's content hash. The same image
        at the same place then hits the cache, another image behind the same placeholder tokens
        never does (vLLM keys such blocks by extra hashes; a key in the token stream does the
        same with the block manager unchanged)."""
        media = self.request.media
        if media is None:
            return self.token_ids
        keys = list(self.token_ids)
        for item in media.items:
            key = -1 - int.from_bytes(item.content_hash[:7], "little")  # never a token id
            keys[item.offset : item.offset + item.num_tokens] = [key] * item.num_tokens
        return keys

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

    def output(self, tokens: list[int], lps: list[TokenLogprob], text: str, reason: FinishReason | None,
               timing: tuple[int, float] | None, request_done: bool = False) -> RequestOutput:
        """This sample's output for the tokens it just appended. `timing`: (batch size, queue wait)
        of the one new token; None when there is none."""
        first = self.first_token_time is not None and self.num_output_tokens == len(tokens) and tokens
        return RequestOutput(
            request_id=self.request.request_id,
            index=self.index,
            new_token_ids=tokens,
            new_text=text,
            new_logprobs=lps,
            finish_reason=reason,
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=self.num_output_tokens,
            cumulative_logprob=self.cumulative_logprob,
            seed=self.seed,
            batch_sizes=[timing[0]] if timing else [],
            queue_waits_s=[timing[1]] if timing else [],
            first_token_latency_s=(self.first_token_time - self.request.arrival_time) if first else None,
            num_cached_prompt_tokens=self.num_cached_prompt_tokens,
            request_done=request_done,
            prompt_logprobs=self.prompt_logprobs if first and self.index == 0 else None,
        )
