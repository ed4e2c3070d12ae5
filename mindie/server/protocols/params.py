"""The request vocabulary the API families share, in one module so that no family imports from
another: content parts, stop strings, MindIE's nested `parameters` (native, TGI, Triton) and vLLM's
flat sampling fields (vLLM /generate, OpenAI)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import AfterValidator, Field

from mindie.engine.request import (
    MAX_STOP_CHARS_TOTAL,
    MAX_STOP_LIST_ITEM_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from mindie.server.errors import APIError
from mindie.server.fields import INT32_MAX, Body, Seed, number

if TYPE_CHECKING:
    from mindie.server.serving import Serving

MAX_MEDIA_ITEMS = 20

TokenId = number(0, INT32_MAX, integer=True)


class ImageURL(Body):
    url: str
    detail: str | None = None  # OpenAI's; the model's own preprocessing decides the resolution


class VideoURL(Body):
    url: str


class AudioURL(Body):
    url: str


class InputAudio(Body):
    """OpenAI's input_audio part: the file itself, base64, and its format."""

    data: str
    format: str  # wav | mp3 (OpenAI's), flac; checked with the part (a 400 naming it)


class ContentPart(Body):
    type: Literal["text", "image_url", "video_url", "audio_url", "input_audio", "image"]
    text: str | None = None
    image_url: str | ImageURL | None = None  # a bare string (MindIE's docs) or OpenAI's {"url": ...}
    video_url: str | VideoURL | None = None  # the same two forms (vLLM's {"url": ...})
    audio_url: str | AudioURL | None = None  # the same two forms
    input_audio: InputAudio | None = None


def join_parts(value: str | list[ContentPart], field: str) -> str:
    """Text of a string or a list of content parts, for routes that read text only: any image,
    video or audio part is refused (and never fetched). The routes that take media (chat, /infer)
    read them through mindie.server.protocols.media first."""
    if isinstance(value, str):
        return value
    if len(value) > 64 * MAX_MEDIA_ITEMS:
        raise APIError(422, f"{field} has {len(value)} parts; the limit is {64 * MAX_MEDIA_ITEMS}", field)
    texts = []
    for i, part in enumerate(value):
        if part.type != "text":
            raise APIError(422, f"{field}[{i}] is of type {part.type!r}, but this route reads text only (images go "
                                "to /v1/chat/completions and /infer, for a model that reads them); send parts of "
                                "type 'text'", f"{field}[{i}].type")
        if part.text is None:
            raise APIError(422, f"{field}[{i}].text is required for a part of type 'text'", f"{field}[{i}].text")
        texts.append(part.text)
    return "".join(texts)


# --- stop strings --------------------------------------------------------------------------------

StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LIST_ITEM_CHARS)]


def _stop_total(stops: list[str]) -> list[str]:
    total = sum(len(s) for s in stops)
    if total > MAX_STOP_CHARS_TOTAL:
        raise ValueError(f"must have at most {MAX_STOP_CHARS_TOTAL} characters in total, got {total}")
    return stops


# seed 004: up to 1024 strings of 1..1024 characters, 32768 in all
StopList = Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS), AfterValidator(_stop_total)]


def stop_tuple(stop: str | list[str] | None) -> tuple[str, ...]:
    return (stop,) if isinstance(stop, str) else tuple(stop or ())


# --- MindIE's `parameters` (native, TGI, Triton: same names, same meaning) -----------------------

Temperature = number(0, None, lo_open=True)
TopK = number(0, INT32_MAX, lo_open=True, integer=True)
MaxNewTokens = number(0, INT32_MAX, lo_open=True, integer=True)
Penalty = number(0, None, lo_open=True)
TypicalP = number(0, 1, lo_open=True)
Priority = number(1, 5, integer=True)
Timeout = number(1, 3600, integer=True)


def sampling_on(do_sample: bool | None, *warpers: object) -> bool:
    """TGI's rule: sampling is on when asked for, or when any sampling parameter is given."""
    return do_sample if do_sample is not None else any(w is not None for w in warpers)


def sampling_params(p: Any, max_new_tokens: int) -> SamplingParams:
    """The engine's parameters from a MindIE-style `parameters` object."""
    do_sample = sampling_on(p.do_sample, p.temperature, p.top_k, p.top_p)
    try:
        return SamplingParams(
            max_tokens=max_new_tokens,
            temperature=p.temperature if p.temperature is not None else 1.0,
            top_k=p.top_k or 0,
            top_p=p.top_p if p.top_p is not None else 1.0,
            repetition_penalty=p.repetition_penalty,
            seed=p.seed,
            do_sample=do_sample,
            stop=stop_tuple(getattr(p, "stop", None)),
        )
    except ValueError as exc:
        raise APIError(422, f"parameters.{exc}") from None


# --- vLLM's flat sampling fields (vLLM /generate, OpenAI) ----------------------------------------

# field -> the values that change nothing (accepted); any other value is refused
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "min_p": (0, 0.0), "typical_p": (1, 1.0), "mirostat": (0,), "bad_words": ([],), "allowed_token_ids": (),
    "truncate_prompt_tokens": (), "reasoning_effort": (), "prediction": (), "web_search_options": (), "audio": (),
    "modalities": (["text"],),
}

Samples = number(1, 128, integer=True)


class SamplingFields(Body):
    max_tokens: number(0, INT32_MAX, lo_open=True, integer=True) | None = None  # type: ignore[valid-type]
    repetition_penalty: number(0, 2, lo_open=True) = 1.0  # type: ignore[valid-type]
    presence_penalty: number(-2, 2) = 0.0  # type: ignore[valid-type]
    frequency_penalty: number(-2, 2) = 0.0  # type: ignore[valid-type]
    temperature: number(0, None) = 1.0  # type: ignore[valid-type]
    top_p: number(1e-6, 1, lo_open=True) = 1.0  # type: ignore[valid-type]
    top_k: number(0, INT32_MAX, lo_open=True, integer=True, also=(-1,)) = -1  # type: ignore[valid-type]
    seed: Seed | None = None
    stop: StopString | StopList | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id (as a string) -> bias in [-100, 100]
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    ignore_eos: bool = False
    min_tokens: number(0, INT32_MAX, integer=True) = 0  # type: ignore[valid-type]
    n: Samples = 1
    best_of: Samples | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False

    # What peers' clients send that changes the output and that this server does not do: refused
    # unless neutral, never dropped (unknown fields in general are ignored, as MindIE does).
    min_p: Any = None
    typical_p: Any = None
    mirostat: Any = None
    bad_words: Any = None
    allowed_token_ids: Any = None
    truncate_prompt_tokens: Any = None
    reasoning_effort: Any = None
    prediction: Any = None
    web_search_options: Any = None
    audio: Any = None
    modalities: Any = None

    def _refuse_unsupported(self) -> None:
        for name, neutral in _NEUTRAL.items():
            value = getattr(self, name)
            if value is not None and value not in neutral:
                raise APIError(422, f"{name} is not supported by this server (got {value!r}); leave it out"
                               + (f" or send {neutral[0]!r}" if neutral else ""), name)

    def sampling_params(self, ctx: Serving, logprobs: int | None = None, max_tokens: int | None = None,
                        stream: bool = False) -> SamplingParams:
        self._refuse_unsupported()
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
        for t in self.stop_token_ids or ():
            if not 0 <= t < vocab:
                raise APIError(422, f"stop_token_ids: token id {t} is outside the vocabulary [0, {vocab})",
                               "stop_token_ids")
        stop_ids = tuple(dict.fromkeys(self.stop_token_ids or ()))
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
                logit_bias=self._logit_bias(vocab),
                include_stop_str_in_output=self.include_stop_str_in_output,
                ignore_eos=self.ignore_eos,
                min_tokens=self.min_tokens,
                skip_special_tokens=self.skip_special_tokens,
                logprobs=logprobs,
                n=self.n,
                best_of=best_of,
                **extra,
            )
        except (ValueError, TypeError) as exc:
            raise APIError(422, str(exc)) from None

    def _logit_bias(self, vocab: int) -> tuple[tuple[int, float], ...]:
        out = []
        for key, bias in (self.logit_bias or {}).items():
            token = int(key) if key.lstrip("-").isdigit() else None
            if token is None or not 0 <= token < vocab:
                raise APIError(422, f"logit_bias: key {key!r} is not a token id in the vocabulary [0, {vocab})",
                               "logit_bias")
            if not -100 <= bias <= 100:
                raise APIError(422, f"logit_bias: the bias of token {token} must be in [-100, 100], got {bias}",
                               "logit_bias")
            out.append((token, float(bias)))
        return tuple(out)
