"""The vLLM 0.2.6-compatible POST /generate (body with `prompt`), plus vLLM's tokenizer routes
(/tokenize, /detokenize, /tokenizer_info) that evaluation tools use instead of a local tokenizer."""

from typing import Any, Literal

from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response

from mindie.engine.request import MAX_STOP_TOKEN_IDS, SamplingParams
from mindie.server.errors import APIError, ErrorStyle
from mindie.server.fields import INT32_MAX, Body, Seed, number, parse
from mindie.server.protocols.common import ContentPart, dumps, join_parts, json_response, stream_response
from mindie.server.protocols.native import stop_tuple
from mindie.server.protocols.tgi import StopList, StopString
from mindie.server.serving import Generation, Result, Serving

MaxTokens = number(0, INT32_MAX, lo_open=True, integer=True)
RepetitionPenalty = number(0, 2, lo_open=True)
Penalty = number(-2, 2)
Temperature = number(0, None)
TopP = number(1e-6, 1, lo_open=True)
TopK = number(0, INT32_MAX, lo_open=True, integer=True, also=(-1,))
Samples = number(1, 128, integer=True)
TokenId = number(0, INT32_MAX, integer=True)
StopTokenIds = Field(None, max_length=MAX_STOP_TOKEN_IDS)


class SamplingFields(Body):
    """vLLM's flat sampling fields, shared with the OpenAI routes."""

    max_tokens: MaxTokens | None = None
    repetition_penalty: RepetitionPenalty = 1.0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = -1
    seed: Seed | None = None
    stop: StopString | StopList | None = None
    stop_token_ids: list[int] | None = StopTokenIds  # ids outside [0, vocab) are ignored, as MindIE
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    ignore_eos: bool = False
    n: Samples = 1
    best_of: Samples | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False

    def sampling_params(self, ctx: Serving, logprobs: int | None = None, max_tokens: int | None = None,
                        stream: bool = False) -> SamplingParams:
        ctx.check_samples(self.n, self.best_of)
        best_of = self.best_of
        if self.use_beam_search:
            # seed 002: best_of is not validated with beam search; the width is at least n
            best_of = None if best_of is None else max(best_of, self.n)
        else:
            if best_of is not None and best_of < self.n:
                raise APIError(422, f"best_of must be in [n={self.n}, 128], got {best_of}", "best_of")
            if stream and best_of not in (None, self.n):
                raise APIError(422, f"best_of must equal n={self.n} when streaming, got {best_of}", "best_of")
            for name, value in (("n", self.n), ("best_of", best_of)):
                if value is not None and value > 1 and self.temperature == 0:
                    raise APIError(422, f"temperature must be > 0 when {name} > 1 ({name}={value}); greedy "
                                        "samples would be identical", "temperature")
        # temperature 0 is greedy: the argmax of the raw logits, no other post-processing
        greedy = self.temperature == 0 and not self.use_beam_search
        vocab = ctx.model_config.vocab_size
        stop_ids = tuple(dict.fromkeys(t for t in (self.stop_token_ids or ()) if 0 <= t < vocab))
        extra: dict[str, Any] = {}
        if self.use_beam_search:
            extra = {"use_beam_search": True, "length_penalty": self.length_penalty,
                     "early_stopping": self.early_stopping}
        try:
            return SamplingParams(
                max_tokens=max_tokens or self.max_tokens,
                temperature=self.temperature,
                top_k=0 if greedy else self.top_k,
                top_p=1.0 if greedy else self.top_p,
                repetition_penalty=1.0 if greedy else self.repetition_penalty,
                presence_penalty=0.0 if greedy else self.presence_penalty,
                frequency_penalty=0.0 if greedy else self.frequency_penalty,
                seed=self.seed,
                stop=stop_tuple(self.stop),
                stop_token_ids=stop_ids,
                include_stop_str_in_output=self.include_stop_str_in_output,
                ignore_eos=self.ignore_eos,
                skip_special_tokens=self.skip_special_tokens,
                logprobs=logprobs,
                n=self.n,
                best_of=best_of,
                **extra,
            )
        except (ValueError, TypeError) as exc:
            raise APIError(422, str(exc)) from None


class VLLMRequest(SamplingFields):
    prompt: str | list[ContentPart]
    stream: bool = False
    model: str | None = None  # a LoRA id in MindIE; none are loaded here


async def generate(ctx: Serving, request: Request, req: VLLMRequest) -> Response:
    if req.model not in (None, "None", ctx.settings.model_name):
        raise APIError(422, f"model {req.model!r} is not served (LoRA adapters are not supported)", "model")
    text = join_parts(req.prompt, "prompt")
    gen = Generation(ctx.encode(text, "prompt"), req.sampling_params(ctx, stream=req.stream), stream=req.stream,
                     prompt_text=text)
    stream = await ctx.start(gen)
    n = gen.params.n
    if not req.stream:
        result = await ctx.collect(request, stream)
        return json_response({"text": [f"{text} {s.text}" for s in result.best(n)]})

    async def events():  # type: ignore[no-untyped-def]
        result = Result.empty(gen.params)
        async for item in stream:
            result.add(item)
            out = item.output
            texts = [""] * n
            texts[out.index] = result.stream_text(out, ctx.settings.full_text)
            yield (dumps({"text": texts}) + "\0").encode()

    return stream_response(stream, events, lambda e: (dumps(e.body(ErrorStyle.MINDIE)) + "\0").encode(),
                           media_type="text/event-stream")


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
    req = parse(TokenizeRequest, body)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(422, "exactly one of prompt and messages is required", "prompt")
    if req.prompt is not None:
        ctx.check_text(req.prompt, "prompt")
        ids = ctx.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    else:
        from mindie.server.protocols.openai import render_chat

        _, ids = render_chat(ctx, req.messages, None, req.add_generation_prompt)
    return json_response({"count": len(ids), "max_model_len": ctx.settings.engine.max_seq_len, "tokens": ids})


async def detokenize(ctx: Serving, request: Request, body: bytes) -> Response:
    req = parse(DetokenizeRequest, body)
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
