"""Media parts of a request (chat `content` lists, /infer `inputs` lists): which parts are
images, videos and audio, the limits on them, and turning a rendered prompt plus its media into the engine
request's token ids and `MediaInputs`. Shared by the families that take media; a refusal is a 400
naming the part and the rule."""

from __future__ import annotations

import asyncio
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, NamedTuple

from mindie.media import MediaError, load_image
from mindie.media.audio import AUDIO_FORMATS, load_audio
from mindie.media.video import load_video
from mindie.server.errors import APIError

if TYPE_CHECKING:
    from mindie.engine.request import MediaInputs
    from mindie.server.serving import Serving

MAX_MEDIA_ITEMS = 20  # seed 004: image, video and audio parts together in one request
OTHER_MEDIA = ("image",)
# part type -> the medium it carries
MEDIA_PARTS = {"image_url": "image", "video_url": "video", "audio_url": "audio", "input_audio": "audio"}
MEDIA_KINDS = ("image", "video", "audio")
_AUDIO_MIMES = {"wav": "audio/wav", "mp3": "audio/mpeg", "flac": "audio/flac"}  # input_audio's format -> data: URI


class MediaRef(NamedTuple):
    kind: str  # image | video | audio
    where: str  # the part, as a field path: messages[0].content[1].image_url
    ref: str  # local path, data: URI or URL


def chat_media_refs(messages: list[Any]) -> list[MediaRef]:
    """The image, video and audio parts of chat messages, in the order the chat template renders them."""
    refs: list[MediaRef] = []
    for i, m in enumerate(messages):
        content = getattr(m, "content", None)
        if isinstance(content, list):
            refs += media_refs(content, f"messages[{i}].content")
    return refs


def url_of(part: Any, where: str) -> str | None:
    """A media part's reference: for image_url / video_url / audio_url a bare string (MindIE's
    docs) or OpenAI's {"url": ...}; for input_audio its base64 data as a data: URI, so that it
    meets the same size rules as any other."""
    value = getattr(part, part.type)
    if part.type == "input_audio" and value is not None:
        if value.format not in _AUDIO_MIMES:
            raise APIError(400, f"{where}.input_audio.format is {value.format!r}; the audio formats read are "
                                f"{', '.join(AUDIO_FORMATS)}", f"{where}.input_audio.format")
        return f"data:{_AUDIO_MIMES[value.format]};base64,{value.data}"
    return value if isinstance(value, str) or value is None else value.url


def media_refs(parts: list[Any], field: str) -> list[MediaRef]:
    """The image, video and audio parts of one content list, in order."""
    refs = []
    for i, part in enumerate(parts):
        where = f"{field}[{i}]"
        if part.type in OTHER_MEDIA:
            raise APIError(422, f"{where} is of type {part.type!r}; this server reads text, image_url, video_url, "
                                "audio_url and input_audio parts", f"{where}.type")
        if part.type in MEDIA_PARTS:
            url = url_of(part, where)
            if url is None:
                raise APIError(400, f"{where}.{part.type} is required for a part of type {part.type!r} (a local "
                                    "path, a data: URI or an http(s) URL)", f"{where}.{part.type}")
            refs.append(MediaRef(MEDIA_PARTS[part.type], f"{where}.{part.type}", url))
    return refs


def reads_media(ctx: Serving, kind: str) -> bool:
    """Whether the served model reads images (kind "image"), videos ("video") or audio ("audio")."""
    model = ctx.engine.engine.loaded.model
    return hasattr(model, "prepare_prompt") and kind in model.media_tokens.pads


def check_media(ctx: Serving, refs: list[MediaRef], limit: int = MAX_MEDIA_ITEMS) -> None:
    """Refuses media the served model does not read, and more than `limit` of them."""
    for r in refs:
        if not reads_media(ctx, r.kind):
            kinds = [{"image": "images", "video": "videos"}.get(k, k) for k in MEDIA_KINDS if reads_media(ctx, k)]
            reads = f"{', '.join(['text', *kinds[:-1]])} and {kinds[-1]}" if kinds else "text only"
            raise APIError(400, f"{r.where}: the served model {ctx.settings.model_name} reads {reads}; it takes no "
                                f"{r.kind} parts", r.where)
    if len(refs) > limit:
        raise APIError(400, f"the request has {len(refs)} media parts; the limit is {limit}", refs[limit].where)


class HandedOver(NamedTuple):
    """On a PD decode node, while it parses a handed-off body again: P's prompt, its media expanded
    by P's model (Qwen2-VL's runs of pads, Idefics3's tile layouts alike), and the media P read
    (their spans and keys, no content). They stand in for the body's media parts, so that D never
    fetches, decodes or expands a medium: how a family lays its media out is P's business alone."""

    prompt: list[int]
    media: MediaInputs | None


HANDED_OVER: ContextVar[HandedOver | None] = ContextVar("handed_over_media", default=None)


def take_handed_over(given: HandedOver, pads: dict[str, int], refs: list[MediaRef], field: str
                      ) -> tuple[list[int], MediaInputs]:
    """P's prompt and media, once they agree with each other and with the body's media parts:
    each item's span inside the prompt holding its kind's pad only, every pad of the prompt in
    some item's span, and the same kinds of media as the body's parts. A 400 naming `field` if not."""
    def refuse(why: str) -> APIError:
        return APIError(400, f"{field}: {why} handed over by the prefill node", field)

    media = given.media
    if media is None:
        raise refuse("the body holds media parts but no media were")
    if {item.kind for item in media.items} != {r.kind for r in refs}:
        raise refuse(f"the body's media are {sorted({r.kind for r in refs})}, not the "
                     f"{sorted({item.kind for item in media.items})}")
    covered: set[int] = set()
    for item in media.items:
        span = given.prompt[item.offset : item.offset + item.num_tokens]
        if item.offset < 0 or len(span) != item.num_tokens or set(span) != {pads.get(item.kind)}:
            raise refuse(f"the prompt does not hold the {item.num_tokens} {item.kind} tokens at {item.offset}")
        covered.update(range(item.offset, item.offset + item.num_tokens))
    if len(covered) != media.num_tokens or sum(t in pads.values() for t in given.prompt) != len(covered):
        raise refuse("the prompt's media tokens are not the media's, one to one")
    return given.prompt, media


async def attach_media(ctx: Serving, ids: list[int], refs: list[MediaRef], field: str
                       ) -> tuple[list[int], MediaInputs | None]:
    """Fetches and decodes the images and audio and probes the videos (concurrently), preprocesses them for
    the model and expands the prompt's placeholders: (token ids, media), or (ids, None) without media.
    On a PD decode node: the prompt and media P handed over."""
    if not refs:
        return ids, None
    model = ctx.engine.engine.loaded.model
    given = HANDED_OVER.get()
    if given is not None:
        return take_handed_over(given, model.media_tokens.pads, refs, field)

    async def fetch(r: MediaRef) -> Any:
        try:
            if r.kind == "video":
                return await load_video(r.ref, ctx.settings.media, r.where)
            if r.kind == "audio":  # decoded at the feature extractor's rate, refused beyond its window
                spec = model.audio_spec
                clip = await load_audio(r.ref, ctx.settings.media, r.where, spec.sampling_rate, spec.chunk_length)
                return clip.samples
            return await load_image(r.ref, ctx.settings.media, r.where)
        except MediaError as exc:
            raise APIError(400, str(exc), r.where) from None

    fetched = await asyncio.gather(*(fetch(r) for r in refs))
    of_kind = {kind: [(r, x) for r, x in zip(refs, fetched) if r.kind == kind] for kind in MEDIA_KINDS}
    try:
        expanded, media = await asyncio.to_thread(model.prepare_prompt, ids,
                                                  *([x for _, x in of_kind[kind]] for kind in MEDIA_KINDS))
    except ValueError as exc:  # the model's preprocessing refused a medium, or the placeholders disagree
        kind, index = getattr(exc, "kind", None), getattr(exc, "index", None)
        where = of_kind[kind][index][0].where if kind is not None else field
        raise APIError(400, f"{where}: {exc}", where) from None
    if len(expanded) > ctx.max_input_tokens:
        raise APIError(400, f"{field} has {len(expanded)} tokens with its media's {media.num_tokens}; the limit is "
                            f"{ctx.max_input_tokens} (media are never truncated)", field)
    return expanded, media
