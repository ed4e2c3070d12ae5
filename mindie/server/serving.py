"""Between the protocol adapters and the engine: admission, ids, prompt limits, timeouts,
cancellation, and the folding of engine outputs into complete results.

An adapter turns its body into a `Generation` and gets back an `OutputStream` of engine outputs;
nothing here knows which API family asked.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from starlette.requests import Request

from mindie.engine.async_engine import AsyncEngine
from mindie.engine.request import MAX_N, EngineRequest, FinishReason, RequestOutput, SamplingParams, TokenLogprob
from mindie.server.config import ServerSettings
from mindie.server.errors import APIError
from mindie.server.metrics import ServerMetrics
from mindie.structured.grammar import Grammar, GrammarCompiler
from mindie.tokenizer import Tokenizer

T = TypeVar("T")

MAX_INPUT_CHARS = 4 * 2**20  # characters of one text input (the spec's 4 MB)
MAX_INPUT_TOKENS = 2**20  # tokens of one prompt, whatever the configuration allows


@dataclass
class Generation:
    """What an adapter asks the engine for, whatever the API family."""

    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 5
    timeout_s: float | None = None  # the request's own limit
    stream: bool = False
    user_id: str | None = None  # a Triton client's own id, usable by stopInfer
    prompt_text: str | None = None
    grammar: Grammar | None = None  # what the output must follow (structured output, required tool calls)


class GenerationTimeout(Exception):
    """The spec's "Engine callback timeout: <who>" (500 before a response started)."""

    def __init__(self, who: str) -> None:
        super().__init__(f"Engine callback timeout: {who}")


class ClientGone(Exception):
    pass


@dataclass
class StreamItem:
    output: RequestOutput
    prefill_ms: float | None  # on a sample's first output: arrival to first token
    decode_ms: float | None  # on later outputs: time since the sample's previous output


class OutputStream:
    """The engine's outputs for one request with the server's deadlines applied: the request's
    `timeout` and `e2eTimeout` from arrival, `tokenTimeout` per output when streaming (for the
    whole wait otherwise, as MindIE). Closing it early aborts the request in the engine."""

    def __init__(self, serving: Serving, request_id: str, gen: Generation, outputs: AsyncIterator[RequestOutput]):
        self.serving = serving
        self.request_id = request_id
        self.gen = gen
        self._outputs = outputs
        self._start = time.monotonic()
        self._last: dict[int, float] = {}
        self._first_token_s: float | None = None
        self._num_tokens = 0
        self.done = False

    def __aiter__(self) -> OutputStream:
        return self

    def _deadline(self, now: float) -> tuple[float, str]:
        s = self.serving.settings
        token_from = now if self.gen.stream else self._start
        limits = [(token_from + s.token_timeout_s, "server tokenTimeout"), (self._start + s.e2e_timeout_s,
                                                                               "server e2eTimeout")]
        if self.gen.timeout_s is not None:
            limits.append((self._start + self.gen.timeout_s, "client timeout"))
        return min(limits)

    async def __anext__(self) -> StreamItem:
        if self.done:
            raise StopAsyncIteration
        now = time.monotonic()
        deadline, who = self._deadline(now)
        try:
            async with asyncio.timeout_at(asyncio.get_running_loop().time() + max(0.0, deadline - now)):
                out = await anext(self._outputs)  # a timeout context, unlike wait_for, costs no task
        except TimeoutError:
            self.done = True
            self.serving.metrics.failed()
            raise GenerationTimeout(who) from None
        except RuntimeError as exc:  # the engine failed the step: this request is lost, say so
            self.done = True
            self.serving.metrics.failed()
            raise APIError(500, f"the engine failed while generating: {type(exc).__name__}") from None
        except StopAsyncIteration:
            self.done = True
            raise
        now = time.monotonic()
        prev = self._last.get(out.index)
        self._last[out.index] = now
        self._num_tokens += len(out.new_token_ids)
        if self._first_token_s is None and out.new_token_ids:
            self._first_token_s = now - self._start
        if out.request_done:
            self.done = True
            self.serving.metrics.finished(out, self._num_tokens, self._first_token_s, now - self._start)
        if prev is None:
            return StreamItem(out, (now - self._start) * 1e3 if out.new_token_ids else None, None)
        return StreamItem(out, None, (now - prev) * 1e3)

    async def aclose(self) -> None:
        if not self.done:
            self.done = True
            await self._outputs.aclose()  # type: ignore[attr-defined]


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
    """Every output of a request folded together: what non-streaming responses render."""

    samples: list[SampleResult]
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    seed: int = 0
    prefill_ms: float | None = None
    decode_ms: list[float] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @classmethod
    def empty(cls, params: SamplingParams) -> Result:
        """Room for every sample the request produces: best_of (or n) samples, or the n
        hypotheses a beam search returns."""
        return cls([SampleResult(i) for i in range(params.num_outputs)])

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
        chosen = sorted(self.samples, key=lambda s: s.cumulative_logprob, reverse=True)[:n]
        return [dataclasses.replace(s, index=i) for i, s in enumerate(chosen)]

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


class Serving:
    def __init__(self, settings: ServerSettings, engine: AsyncEngine, metrics: ServerMetrics) -> None:
        self.settings = settings
        self.engine = engine
        self.tokenizer: Tokenizer = engine.engine.tokenizer
        self.model_config = engine.engine.loaded.config
        self.metrics = metrics
        self.created = int(time.time())
        self._ids = itertools.count()
        self.in_flight: dict[str, str | None] = {}  # request id -> the client's own id
        self._by_user_id: dict[str, str] = {}
        self.draining = False
        self.max_n = min(MAX_N, settings.max_n, settings.engine.max_batch_size)
        self.grammars = GrammarCompiler(self.tokenizer)

    # --- prompts -------------------------------------------------------------------------------

    @property
    def max_input_tokens(self) -> int:
        """min(maxInputTokenLen, maxSeqLen - 1, the model's max_position_embeddings, 1M)."""
        return min(self.settings.engine.max_input_len, self.model_config.max_position, MAX_INPUT_TOKENS)

    def encode(self, text: str, field_name: str, add_special_tokens: bool = True) -> list[int]:
        if not text:
            raise APIError(422, f"{field_name} must be a non-empty string", field_name)
        self.check_text(text, field_name)
        return self.fit_prompt(self.tokenizer.encode(text, add_special_tokens=add_special_tokens), field_name)

    def check_text(self, text: str, field_name: str) -> None:
        """The spec's limit on text inputs (/infer inputs, completions prompt, chat messages),
        checked before tokenizing: 4 MB of characters, or maxRequestLength if smaller."""
        self.check_chars(len(text), field_name)

    def check_chars(self, num_chars: int, field_name: str) -> None:
        limit = min(MAX_INPUT_CHARS, self.settings.max_request_bytes)
        if num_chars > limit:
            raise APIError(422, f"{field_name} has {num_chars} characters; the limit is {limit} "
                                f"(4 MB of characters, or maxRequestLength if smaller)", field_name)

    def fit_prompt(self, ids: list[int], field_name: str) -> list[int]:
        """Applies the prompt-length limit: an error naming both limits, or truncation when
        configured (`truncation` -1 keeps the first tokens, 1 the last)."""
        limit = self.max_input_tokens
        if not ids:
            raise APIError(422, f"{field_name} must not be empty", field_name)
        if len(ids) <= limit:
            return ids
        if self.settings.truncation == -1:
            return ids[:limit]
        if self.settings.truncation == 1:
            return ids[-limit:]
        e = self.settings.engine
        raise APIError(422, f"{field_name} has {len(ids)} tokens; the limit is min(maxInputTokenLen="
                            f"{e.max_input_token_len}, maxSeqLen-1={e.max_seq_len - 1}, max_position_embeddings="
                            f"{self.model_config.max_position}, {MAX_INPUT_TOKENS}) = {limit}", field_name)

    def check_token_ids(self, ids: list[int], field_name: str) -> list[int]:
        vocab = self.model_config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(422, f"{field_name} contains token id {bad}; ids must be in [0, {vocab - 1}]", field_name)
        return self.fit_prompt(ids, field_name)

    def check_samples(self, n: int, best_of: int | None) -> None:
        for name, v in (("n", n), ("best_of", best_of)):
            if v is not None and v > self.max_n:
                raise APIError(422, f"{name} must be in [1, {self.max_n}] (maxN and maxBatchSize), got {v}", name)

    # --- requests ------------------------------------------------------------------------------

    def admit(self) -> None:
        """Refuses at once when the server is stopping or full, never queues without bound."""
        if self.draining:
            raise APIError(503, "The service has been stopped.")
        if len(self.in_flight) >= 3 * self.settings.max_link_num:
            raise APIError(429, f"too many requests in flight (limit 3 x maxLinkNum = "
                                f"{3 * self.settings.max_link_num}); retry later", headers={"Retry-After": "1"})

    async def start(self, gen: Generation) -> OutputStream:
        self.admit()
        request_id = f"endpoint_common_{next(self._ids)}"
        if gen.user_id is not None:
            if gen.user_id in self._by_user_id:
                raise APIError(422, f"id {gen.user_id!r} is already in use by a running request", "id")
            self._by_user_id[gen.user_id] = request_id
        self.in_flight[request_id] = gen.user_id
        self.metrics.received(len(gen.prompt_ids))
        request = EngineRequest(request_id, gen.prompt_ids, gen.params, priority=gen.priority,
                                prompt_text=gen.prompt_text, grammar=gen.grammar)
        try:
            outputs = await self.engine.add_request(request)
        except ValueError as exc:
            self._forget(request_id)
            self.metrics.failed()
            raise APIError(422, str(exc)) from None
        except RuntimeError as exc:
            self._forget(request_id)
            self.metrics.failed()
            raise APIError(503, f"the engine is not running: {exc}") from None
        return _Tracked(self, request_id, gen, outputs)

    def _forget(self, request_id: str) -> None:
        user_id = self.in_flight.pop(request_id, None)
        if user_id is not None:
            self._by_user_id.pop(user_id, None)

    def stop(self, some_id: str) -> bool:
        """stopInfer: by the client's own id or ours; False if no such request is running."""
        request_id = self._by_user_id.get(some_id, some_id)
        if request_id not in self.in_flight:
            return False
        self.engine.abort(request_id)
        return True

    async def collect(self, request: Request, stream: OutputStream) -> Result:
        """Folds a whole request, aborting it if the client goes away first."""
        result = Result.empty(stream.gen.params)

        async def fold() -> Result:
            async for item in stream:
                result.add(item)
            return result

        return await until_disconnect(request, fold(), stream)


class _Tracked(OutputStream):
    """Forgets the request id once the stream ends, however it ends."""

    async def __anext__(self) -> StreamItem:
        try:
            return await super().__anext__()
        except BaseException:
            self.serving._forget(self.request_id)
            raise

    async def aclose(self) -> None:
        try:
            if not self.done:
                self.serving.metrics.failed()
            await super().aclose()
        finally:
            self.serving._forget(self.request_id)


class Closable(Protocol):
    async def aclose(self) -> None: ...


async def until_disconnect(request: Request, work: Awaitable[T], stream: Closable) -> T:
    """Awaits `work`, unless the client disconnects first: then the work is cancelled, the
    stream closed (its engine requests aborted) and ClientGone raised."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await stream.aclose()
        watcher.cancel()
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _disconnected(request: Request) -> None:
    while True:
        message: Any = await request.receive()
        if message["type"] == "http.disconnect":
            return
