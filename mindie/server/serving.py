"""Between the protocol families and the engine: admission, request ids, prompt limits, and
running a parsed `Call`: its engine requests started as `OutputStream`s, or folded into whole
`Result`s. Nothing here knows which API family asked."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from typing import TYPE_CHECKING

from starlette.requests import Request

from mindie.engine.async_engine import AsyncEngine
from mindie.engine.request import MAX_N, EngineRequest
from mindie.server.config import ServerSettings
from mindie.server.errors import APIError
from mindie.server.metrics import ServerMetrics
from mindie.server.protocols.base import Call
from mindie.server.results import Result
from mindie.server.streams import OutputStream, merge, until_disconnect
from mindie.structured.grammar import GrammarCompiler
from mindie.structured.reasoning_parser import reasoning_tags
from mindie.tokenizer import Tokenizer

if TYPE_CHECKING:
    from mindie.server.dmi import PDNode

MAX_INPUT_CHARS = 4 * 2**20  # characters of one text input (the spec's 4 MB)
MAX_INPUT_TOKENS = 2**20  # tokens of one prompt, whatever the configuration allows


class Serving:
    def __init__(self, settings: ServerSettings, engine: AsyncEngine, metrics: ServerMetrics) -> None:
        self.settings = settings
        self.engine = engine
        self.tokenizer: Tokenizer = engine.engine.tokenizer
        self.model_config = engine.engine.loaded.config
        self.limits = engine.engine.limits
        self.metrics = metrics
        self.created = int(time.time())
        self._ids = itertools.count()
        self.in_flight: dict[str, str | None] = {}  # request id -> the client's own id
        self._by_user_id: dict[str, str] = {}
        self.draining = False
        self.max_n = min(MAX_N, settings.max_n, settings.engine.max_batch_size)
        self.grammars = GrammarCompiler(self.tokenizer)
        # the think tags chat replies are split on (reasoning_content), None: replies are not split
        self.reasoning = reasoning_tags(settings.reasoning_parser, self.model_config.architecture, self.tokenizer)
        self.pd: PDNode | None = None  # the prefill/decode role, in inferMode dmi

    # --- prompts -------------------------------------------------------------------------------

    @property
    def max_input_tokens(self) -> int:
        """min(maxInputTokenLen, maxSeqLen - 1, the model's max_position_embeddings, 1M)."""
        return min(self.limits.max_input_len, self.model_config.max_position, MAX_INPUT_TOKENS)

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
        e = self.limits
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

    async def start(self, call: Call, request_id: str | None = None) -> list[OutputStream]:
        """Admits and names each of the call's requests and queues it on the engine; on any
        refusal, closes those already started and raises. `request_id` names the requests
        instead of the server's counter (a PD req-id: request k > 0 gets "<id>-<k>")."""
        streams: list[OutputStream] = []
        try:
            for k, request in enumerate(call.requests):
                name = None if request_id is None else request_id if k == 0 else f"{request_id}-{k}"
                streams.append(await self._start_one(request, call, None if streams else call.user_id, name))
        except BaseException:
            for s in streams:
                await s.aclose()
            raise
        return streams

    async def _start_one(self, request: EngineRequest, call: Call, user_id: str | None,
                         request_id: str | None = None) -> OutputStream:
        self.admit()
        if request_id is None:
            request_id = f"endpoint_common_{next(self._ids)}"
        elif request_id in self.in_flight:
            raise APIError(400, f"req-id {request_id} is already in use by a running request", "req-id")
        if user_id is not None:
            if user_id in self._by_user_id:
                raise APIError(422, f"id {user_id!r} is already in use by a running request", "id")
            self._by_user_id[user_id] = request_id
        self.in_flight[request_id] = user_id
        self.metrics.received(len(request.prompt_token_ids))
        named = dataclasses.replace(request, request_id=request_id, arrival_time=time.monotonic())
        try:
            outputs = await self.engine.add_request(named)
        except ValueError as exc:
            self._not_started(request_id)
            raise APIError(422, str(exc)) from None
        except RuntimeError as exc:
            self._not_started(request_id)
            raise APIError(503, f"the engine is not running: {exc}") from None
        except asyncio.CancelledError:  # the client went away first; add_request aborted the request
            self._not_started(request_id)
            raise
        return OutputStream(self, named, call, outputs)

    def _not_started(self, request_id: str) -> None:
        self.forget(request_id)
        self.metrics.failed()

    def forget(self, request_id: str) -> None:
        """The request has ended (or never started): its ids are free again."""
        user_id = self.in_flight.pop(request_id, None)
        if user_id is not None:
            self._by_user_id.pop(user_id, None)

    def stop(self, some_id: str) -> bool:
        """stopInfer: by the client's own id or ours; False if no such request is running."""
        request_id = self._by_user_id.get(some_id, some_id)
        if request_id not in self.in_flight:
            if self.pd is not None:
                self.pd.stop(request_id)  # a decode node may yet be handed the request
            return False
        if self.pd is not None:
            self.pd.stop(request_id)
        self.engine.abort(request_id)
        return True

    async def start_while_connected(self, request: Request, call: Call) -> list[OutputStream]:
        """`start`, unless the client goes away before the engine has taken every request: then
        they are aborted at once, with no step run for them, and ClientGone raised."""
        return await until_disconnect(request, self.start(call))

    async def collect(self, request: Request, call: Call) -> list[Result]:
        """Starts the call's requests and folds them whole; a client that goes away at any point,
        while its requests wait for the engine too, aborts them at once (ClientGone)."""
        return await until_disconnect(request, self._fold(call))

    async def _fold(self, call: Call) -> list[Result]:
        streams = await self.start(call)
        results = [Result.empty(s.request_id, s.request.params) for s in streams]
        try:
            async for k, item in merge(streams):
                results[k].add(item)
        finally:  # cancelled (the client went away) or failed: the unfinished ones are aborted
            for s in streams:
                await s.aclose()
        return results
