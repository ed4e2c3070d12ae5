"""The vLLM 0.2.6-compatible POST /generate (body with `prompt`), plus vLLM's tokenizer routes
(/tokenize, /detokenize, /tokenizer_info) that evaluation tools use instead of a local tokenizer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response

from mindie.engine.request import EngineRequest
from mindie.server.errors import APIError, ErrorStyle
from mindie.server.fields import Body, validate
from mindie.server.http import json_response
from mindie.server.protocols.base import UNNAMED, Call, Renderer, dumps
from mindie.server.protocols.family import Family, Kind, Route, plain_prompt
from mindie.server.protocols.guided import GuidedFields, compile_guided, one_of
from mindie.server.protocols.media import attach_media, chat_media_refs, check_media
from mindie.server.protocols.messages import parse_message, render_chat, render_parts
from mindie.server.protocols.params import ContentPart, SamplingFields, TokenId, join_parts
from mindie.server.results import Result, StreamItem

if TYPE_CHECKING:
    from mindie.server.serving import Serving


class VLLMRequest(SamplingFields, GuidedFields):
    prompt: str | list[ContentPart]
    stream: bool = False
    model: str | None = None  # a LoRA id in MindIE; none are loaded here


async def parse(ctx: Serving, body: bytes, path: Mapping[str, str]) -> tuple[Call, Renderer]:
    req = validate(VLLMRequest, body)
    if req.model not in (None, "None", ctx.settings.model_name):
        raise APIError(422, f"model {req.model!r} is not served (LoRA adapters are not supported)", "model")
    media = None
    if (parts := await render_parts(ctx, req.prompt, "prompt")) is not None:
        text, ids, media = parts  # the reply echoes the text parts only (the spec's "text part")
    else:
        text = join_parts(req.prompt, "prompt")
        ids = ctx.encode(text, "prompt")
    params = req.sampling_params(ctx, stream=req.stream)
    grammar = await compile_guided(ctx, one_of(req.guided()), params.max_tokens)
    request = EngineRequest(UNNAMED, ids, params, prompt_text=text, grammar=grammar, media=media)
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
    """vLLM's body (`prompt` or `messages`, `add_special_tokens`, `return_token_strs`) or
    llama.cpp's (`content`, `add_special`, `with_pieces`)."""

    prompt: str | None = None
    content: str | None = None
    messages: list[dict[str, Any]] | None = Field(None, max_length=4096)
    add_special_tokens: bool | None = None
    add_special: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    with_pieces: bool = False
    model: str | None = None


class DetokenizeRequest(Body):
    tokens: list[TokenId] = Field(max_length=4 * 2**20)
    model: str | None = None


async def tokenize(ctx: Serving, request: Request, body: bytes) -> Response:
    req = validate(TokenizeRequest, body)
    texts = [(name, v) for name, v in (("prompt", req.prompt), ("content", req.content)) if v is not None]
    if len(texts) + (req.messages is not None) != 1:
        raise APIError(422, "exactly one of prompt (or llama.cpp's content) and messages is required", "prompt")
    if req.add_special_tokens is not None and req.add_special is not None:
        raise APIError(422, "add_special_tokens (vLLM) and add_special (llama.cpp) name the same choice: send one",
                       "add_special")
    if texts:
        name, text = texts[0]
        ctx.check_text(text, name)
        # vLLM adds the special tokens unless told not to; llama.cpp adds them only when asked
        special = req.add_special_tokens if req.add_special_tokens is not None else \
            req.add_special if req.add_special is not None else name == "prompt"
        ids = ctx.tokenizer.encode(text, add_special_tokens=special)
    else:
        if req.continue_final_message and req.add_generation_prompt:
            raise APIError(422, "continue_final_message and add_generation_prompt cannot both be true",
                           "continue_final_message")
        messages = [parse_message(m, i) if isinstance(m, dict) else m for i, m in enumerate(req.messages)]
        refs = chat_media_refs(messages)
        check_media(ctx, refs)
        _, ids = render_chat(ctx, messages, None, req.add_generation_prompt,
                             continue_final=req.continue_final_message)
        ids, _media = await attach_media(ctx, ids, refs, "messages")  # the count includes image tokens
    tokens: list[Any] = ids
    if req.with_pieces:
        tokens = [{"id": t, "piece": ctx.tokenizer.decode([t], skip_special_tokens=False)} for t in ids]
    out: dict[str, Any] = {"count": len(ids), "max_model_len": ctx.settings.engine.max_seq_len, "tokens": tokens}
    if req.return_token_strs:
        out["token_strs"] = [ctx.tokenizer.id_to_token(t) for t in ids]
    return json_response(out)


async def detokenize(ctx: Serving, request: Request, body: bytes) -> Response:
    req = validate(DetokenizeRequest, body)
    ids = ctx.check_token_ids(list(req.tokens), "tokens") if req.tokens else []
    text = ctx.tokenizer.decode(ids, skip_special_tokens=False)
    return json_response({"prompt": text, "content": text})  # vLLM's name, and llama.cpp's


async def tokenizer_info(ctx: Serving, request: Request) -> Response:
    tok = ctx.tokenizer

    def text(token_id: int | None) -> str | None:
        return None if token_id is None else tok.id_to_token(token_id)

    eos = tok.eos_token_ids[0] if tok.eos_token_ids else None
    return json_response({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": ctx.settings.engine.max_seq_len,
        "vocab_size": tok.vocab_size,
        "bos_token_id": tok.bos_token_id,
        "bos_token": text(tok.bos_token_id),
        "eos_token_id": eos,
        "eos_token_ids": list(tok.eos_token_ids),
        "eos_token": text(eos),
        "pad_token_id": tok.pad_token_id,
        "pad_token": text(tok.pad_token_id),
        "add_bos_token": tok.add_bos_token,
        "chat_template": tok.chat_template,
    })


# vLLM's tokenizer routes come from its OpenAI server: they answer in OpenAI's error shape.
FAMILY = Family("vllm", ErrorStyle.MINDIE, lambda body: (dumps(body) + "\0").encode(),
                lambda body: plain_prompt(body.get("prompt")), routes=(
    Route("POST", "/generate", Kind.GENERATE, parse, stream=None, claims="prompt", body_model=VLLMRequest,
          summary="vLLM (a body with `prompt`)"),
    Route("POST", "/tokenize", Kind.INFO, handler=tokenize, body_model=TokenizeRequest, summary="vLLM tokenize",
          style=ErrorStyle.OPENAI),
    Route("POST", "/detokenize", Kind.INFO, handler=detokenize, body_model=DetokenizeRequest,
          summary="vLLM detokenize", style=ErrorStyle.OPENAI),
    Route("GET", "/tokenizer_info", Kind.INFO, handler=tokenizer_info, style=ErrorStyle.OPENAI),
))
