"""What renderers consume: the engine's outputs with the server's timings (`StreamItem`), and all of
a request's outputs folded into one `Result`. Plain data, without torch or the engine, so that any
process that renders a family's bytes can load it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from mindie.engine.request import FinishReason, RequestOutput, SamplingParams, TokenLogprob


@dataclass
class StreamItem:
    output: RequestOutput
    prefill_ms: float | None  # on a sample's first output: arrival to first token
    decode_ms: float | None  # on later outputs: time since the sample's previous output


@dataclass
class SampleResult:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: FinishReason | None = None
    batch_sizes: list[int] = field(default_factory=list)  # per token: the size of the step that computed it
    queue_wait_us: list[int] = field(default_factory=list)  # per token: its own queue wait


@dataclass
class Result:
    """Every output of a request folded together: what non-streaming responses render, and the
    running state stream events are rendered from."""

    request_id: str
    samples: list[SampleResult]
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    seed: int = 0
    prefill_ms: float | None = None
    decode_ms: list[float] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @classmethod
    def empty(cls, request_id: str, params: SamplingParams) -> Result:
        """Room for every sample the request produces: best_of (or n) samples, or the n
        hypotheses a beam search returns."""
        return cls(request_id, [SampleResult(i) for i in range(params.num_outputs)])

    def add(self, item: StreamItem) -> None:
        out = item.output
        s = self.samples[out.index]
        s.text += out.new_text
        s.token_ids += out.new_token_ids
        s.logprobs += out.new_logprobs
        s.cumulative_logprob = out.cumulative_logprob
        if out.finish_reason is not None:
            s.finish_reason = out.finish_reason
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_cached_tokens = out.num_cached_prompt_tokens
        if out.index == 0:
            self.seed = out.seed
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        s.batch_sizes += out.batch_sizes
        s.queue_wait_us += [round(w * 1e6) for w in out.queue_waits_s]
        if item.prefill_ms is not None and self.prefill_ms is None:
            self.prefill_ms = item.prefill_ms
        elif item.decode_ms is not None and out.index == 0 and out.new_token_ids:
            self.decode_ms.append(item.decode_ms)

    def stream_text(self, out: RequestOutput, full_text: bool) -> str:
        """A stream event's text: the delta, or with fullTextEnabled the sample's text so far."""
        return self.samples[out.index].text if full_text else out.new_text

    def best(self, n: int) -> list[SampleResult]:
        """The n samples to return: all of them, or with best_of the n with the highest
        cumulative log-probability, re-indexed."""
        if len(self.samples) == n:
            return self.samples
        return [dataclasses.replace(s, index=i) for i, s in enumerate(self.ranked()[:n])]

    def ranked(self) -> list[SampleResult]:
        """The samples, highest cumulative log-probability first (best_of's order)."""
        return sorted(self.samples, key=lambda s: s.cumulative_logprob, reverse=True)

    @property
    def _longest(self) -> SampleResult:
        return max(self.samples, key=lambda s: len(s.token_ids))

    @property
    def batch_sizes(self) -> list[int]:
        """MindIE's usage.batch_size: per generated token of the longest sample."""
        return self._longest.batch_sizes

    @property
    def queue_wait_us(self) -> list[int]:
        """MindIE's usage.queue_wait_time: per generated token of the longest sample, in us."""
        return self._longest.queue_wait_us

    @property
    def num_output_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.samples)
