"""What OpenAI's chat (openai_chat.py) and completions (openai_completions.py) routes share: the
common body fields, the model check, log-probabilities and usage in OpenAI's shapes, and the
model routes GET /v1/models[/{m}]."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response

from mindie.engine.request import SamplingParams, TokenLogprob
from mindie.server.errors import APIError, ErrorStyle
from mindie.server.fields import INT32_MAX, Body, number
from mindie.server.http import json_response
from mindie.server.protocols.base import Renderer, sse
from mindie.server.protocols.guided import GuidedFields
from mindie.server.protocols.params import SamplingFields
from mindie.server.results import Result

if TYPE_CHECKING:
    from mindie.server.serving import Serving
    from mindie.tokenizer import Tokenizer


class StreamOptions(Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far


class OpenAIFields(SamplingFields, GuidedFields):
    model: Annotated[str, Field(min_length=1)]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_completion_tokens: number(0, INT32_MAX, lo_open=True, integer=True) | None = None  # type: ignore[valid-type]
    user: str | None = None
    # vLLM's: the prompt's and each choice's token ids, and the prompt tokens' log-probabilities
    return_token_ids: bool = False
    prompt_logprobs: number(0, 20, integer=True) | None = None  # type: ignore[valid-type]

    def with_prompt_logprobs(self, params: SamplingParams) -> SamplingParams:
        if self.prompt_logprobs is None:
            return params
        if self.stream:
            raise APIError(422, "prompt_logprobs is available without stream only", "prompt_logprobs")
        return replace(params, prompt_logprobs=max(self.prompt_logprobs, params.prompt_logprobs or 0))

    @property
    def output_limit(self) -> int | None:
        """max_completion_tokens, the newer name, over max_tokens."""
        return self.max_completion_tokens or self.max_tokens


def check_model(ctx: Serving, model: str) -> None:
    if model != ctx.settings.model_name:
        raise APIError(404, f"The model `{model}` does not exist; this server serves `{ctx.settings.model_name}`",
                       "model")


# --- log-probabilities ---------------------------------------------------------------------------


def _piece(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tokenizer: Tokenizer, lps: list[TokenLogprob]) -> dict[str, Any]:
    def entry(t: int, lp: float) -> dict[str, Any]:
        piece = _piece(tokenizer, t)
        return {"token": piece, "logprob": lp, "bytes": list(piece.encode())}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in lps]}


def _top(tokenizer: Tokenizer, lp: TokenLogprob) -> dict[str, float]:
    """The top-N entries, and the chosen token when it is not among them (seed 002: N + 1)."""
    top = {_piece(tokenizer, t): v for t, v in lp.top}
    if all(t != lp.token_id for t, _ in lp.top):
        top.setdefault(_piece(tokenizer, lp.token_id), lp.logprob)
    return top


def completion_logprobs(tokenizer: Tokenizer, lps: list[TokenLogprob | None], offset: int,
                        token_ids: list[int] | None = None) -> dict[str, Any]:
    """The legacy completions shape. With `token_ids` (echo), entries may be None: the prompt's
    first token has no log-probability."""
    ids = token_ids if token_ids is not None else [lp.token_id for lp in lps]  # type: ignore[union-attr]
    tokens, offsets = [], []
    for t in ids:
        offsets.append(offset)
        piece = _piece(tokenizer, t)
        tokens.append(piece)
        offset += len(piece)
    return {"tokens": tokens, "token_logprobs": [lp.logprob if lp else None for lp in lps],
            "top_logprobs": [_top(tokenizer, lp) if lp else None for lp in lps],
            "text_offset": offsets}


def vllm_prompt_logprobs(tokenizer: Tokenizer, prompt_ids: list[int],
                         lps: list[TokenLogprob | None] | None) -> list[dict[str, Any] | None]:
    """vLLM's prompt_logprobs: per prompt token (None for the first, which nothing predicts) the
    token and the top-N, id -> {logprob, rank, decoded_token}; a rank the top-N does not show is
    null (not computed)."""
    out: list[dict[str, Any] | None] = []
    for token, lp in zip(prompt_ids, lps or [None] * len(prompt_ids)):
        if lp is None:
            out.append(None)
            continue
        ranks = {t: r for r, (t, _) in enumerate(lp.top, 1)}
        entry = {}
        for t, v in [(token, lp.logprob), *lp.top]:
            entry.setdefault(str(t), {"logprob": v, "rank": ranks.get(t), "decoded_token": _piece(tokenizer, t)})
        out.append(entry)
    return out


# --- usage ---------------------------------------------------------------------------------------


def usage(results: list[Result], prompt_tokens: int) -> dict[str, Any]:
    completion = sum(r.num_output_tokens for r in results)
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                           "total_tokens": prompt_tokens + completion}
    # always present: clients read it without checking (0 without a prefix-cache hit)
    out["prompt_tokens_details"] = {"cached_tokens": sum(r.num_cached_tokens for r in results)}
    out["batch_size"] = [b for r in results for b in r.batch_sizes]
    out["queue_wait_time"] = [q for r in results for q in r.queue_wait_us]
    return out


class OpenAIRenderer(Renderer):
    """What the chat and completions renderers share: the error style, and the `created` time that
    every chunk of one response repeats, which a PD decode node takes over from the prefill node."""

    style = ErrorStyle.OPENAI

    def __init__(self) -> None:
        self.created = int(time.time())

    def carried(self) -> dict[str, Any]:
        return {"created": self.created}

    def restore(self, carried: dict[str, Any]) -> None:
        created = carried.get("created")
        if isinstance(created, int) and not isinstance(created, bool):
            self.created = created


@dataclass
class StreamUsage:
    """Where a stream's usage goes: a chunk of its own at the end, only with include_usage (as
    OpenAI, vLLM and llama.cpp do; MindIE put it on the chunk that ends the request, which clients
    written for OpenAI read as a second usage); with continuous_usage_stats on every chunk too."""

    options: StreamOptions | None
    prompt_tokens: int

    @property
    def include(self) -> bool:
        return bool(self.options and self.options.include_usage)

    def running(self, chunk: dict[str, Any], results: list[Result]) -> dict[str, Any]:
        if self.options and self.options.continuous_usage_stats:
            chunk["usage"] = usage(results, self.prompt_tokens)
        return chunk

    def chunks(self, head: dict[str, Any], results: list[Result]) -> list[bytes]:
        """What ends every stream: the usage chunk when asked for, then [DONE]."""
        tail = [sse({**head, "choices": [], "usage": usage(results, self.prompt_tokens)})] if self.include else []
        return [*tail, b"data: [DONE]\n\n"]


# --- models --------------------------------------------------------------------------------------


def _model_card(ctx: Serving) -> dict[str, Any]:
    return {"id": ctx.settings.model_name, "object": "model", "created": ctx.created, "owned_by": "MindIE Server",
            "root": ctx.settings.model_name, "parent": None, "max_model_len": ctx.settings.engine.max_seq_len}


async def list_models(ctx: Serving, request: Request) -> Response:
    return json_response({"object": "list", "data": [_model_card(ctx)]})


async def get_model(ctx: Serving, request: Request) -> Response:
    model = request.path_params["model"]
    if model != ctx.settings.model_name:
        raise APIError(404, f"Model {model} not found.", "model")
    return json_response(_model_card(ctx))
