"""The vLLM 0.2.6-compatible POST /generate (body with `prompt`), plus vLLM's tokenizer routes
(/tokenize, /detokenize, /tokenizer_info) that evaluation tools use instead of a local tokenizer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response

from mindie.engine.request import EngineRequest
from mindie.server.errors import APIError
from mindie.server.fields import Body, validate
from mindie.server.protocols.base import UNNAMED, Call, Renderer, dumps
from mindie.server.protocols.messages import render_chat
from mindie.server.protocols.params import ContentPart, SamplingFields, TokenId, join_parts
from mindie.server.responses import json_response
from mindie.server.results import Result, StreamItem

if TYPE_CHECKING:
    from mindie.server.serving import Serving


class VLLMRequest(SamplingFields):
    prompt: str | list[ContentPart]
    stream: bool = False
    model: str | None = None  # a LoRA id in MindIE; none are loaded here


async def parse(ctx: Serving, body: bytes, path: Mapping[str, str]) -> tuple[Call, Renderer]:
    req = validate(VLLMRequest, body)
    if req.model not in (None, "None", ctx.settings.model_name):
        raise APIError(422, f"model {req.model!r} is not served (LoRA adapters are not supported)", "model")
    text = join_parts(req.prompt, "prompt")
    ids = ctx.encode(text, "prompt")
    params = req.sampling_params(ctx, stream=req.stream)
    request = EngineRequest(UNNAMED, ids, params, prompt_text=text)
    return Call([request], stream=req.stream), VLLMRenderer(text, params.n, ctx.settings.full_text)


class VLLMRenderer(Renderer):
    """Stream events are JSON objects each ended by a NUL byte, not SSE."""

    def __init__(self, prompt: str, n: int, full_text: bool) -> None:
        self.prompt = prompt
        self.n = n
        self.full_text = full_text

    def whole(self, results: list[Result]) -> Any:
        return {"text": [f"{self.prompt} {s.text}" for s in results[0].best(self.n)]}

    def event(self, k: int, item: StreamItem, results: list[Result]) -> list[bytes]:
        out = item.output
        texts = [""] * self.n
        texts[out.index] = results[0].stream_text(out, self.full_text)
        return [(dumps({"text": texts}) + "\0").encode()]

    def error(self, err: APIError) -> bytes:
        return (dumps(err.body(self.style)) + "\0").encode()


class TokenizeRequest(Body):
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = Field(None, max_length=4096)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    model: str | None = None


class DetokenizeRequest(Body):
    tokens: list[TokenId] = Field(max_length=4 * 2**20)
    model: str | None = None


async def tokenize(ctx: Serving, request: Request, body: bytes) -> Response:
    req = validate(TokenizeRequest, body)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(422, "exactly one of prompt and messages is required", "prompt")
    if req.prompt is not None:
        ctx.check_text(req.prompt, "prompt")
        ids = ctx.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    else:
        _, ids = render_chat(ctx, req.messages, None, req.add_generation_prompt)
    return json_response({"count": len(ids), "max_model_len": ctx.settings.engine.max_seq_len, "tokens": ids})


async def detokenize(ctx: Serving, request: Request, body: bytes) -> Response:
    req = validate(DetokenizeRequest, body)
    ids = ctx.check_token_ids(list(req.tokens), "tokens") if req.tokens else []
    return json_response({"prompt": ctx.tokenizer.decode(ids, skip_special_tokens=False)})


async def tokenizer_info(ctx: Serving, request: Request) -> Response:
    tok = ctx.tokenizer
    return json_response({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": ctx.settings.engine.max_seq_len,
        "vocab_size": tok.vocab_size,
        "bos_token_id": tok.bos_token_id,
        "eos_token_ids": list(tok.eos_token_ids),
        "add_bos_token": tok.add_bos_token,
        "chat_template": tok.chat_template,
    })
