"""Media parts of a request (chat `content` lists, /infer `inputs` lists): which parts are
images, the limits on them, and turning a rendered prompt plus its images into the engine
request's token ids and `MediaInputs`. Shared by the families that take images; a refusal is a 400
naming the part and the rule."""

from __future__ import annotations

import asyncio
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, NamedTuple

from mindie.media import MediaError, load_image
from mindie.server.errors import APIError

if TYPE_CHECKING:
    from mindie.engine.request import MediaInputs
    from mindie.server.serving import Serving

MAX_MEDIA_ITEMS = 20  # seed 004: image, video and audio parts together in one request
OTHER_MEDIA = ("video_url", "audio_url", "input_audio", "image")


class ImageRef(NamedTuple):
    where: str  # the part, as a field path: messages[0].content[1].image_url
    ref: str  # local path, data: URI or URL


def chat_image_refs(messages: list[Any]) -> list[ImageRef]:
    """The image parts of chat messages, in the order the chat template renders them."""
    refs: list[ImageRef] = []
    for i, m in enumerate(messages):
        content = getattr(m, "content", None)
        if isinstance(content, list):
            refs += image_refs(content, f"messages[{i}].content")
    return refs


def image_url_of(part: Any) -> str | None:
    """An image_url part's reference: a bare string (MindIE's docs) or OpenAI's {"url": ...}."""
    value = part.image_url
    return value if isinstance(value, str) or value is None else value.url


def image_refs(parts: list[Any], field: str) -> list[ImageRef]:
    """The image parts of one content list, in order. Parts of other media types are refused."""
    refs = []
    for i, part in enumerate(parts):
        where = f"{field}[{i}]"
        if part.type in OTHER_MEDIA:
            raise APIError(422, f"{where} is of type {part.type!r}; this server reads text and image_url parts "
                                "only (video and audio are not supported yet)", f"{where}.type")
        if part.type == "image_url":
            url = image_url_of(part)
            if url is None:
                raise APIError(400, f"{where}.image_url is required for a part of type 'image_url' (a local "
                                    "path, a data: URI or an http(s) URL)", f"{where}.image_url")
            refs.append(ImageRef(f"{where}.image_url", url))
    return refs


def reads_images(ctx: Serving) -> bool:
    return hasattr(ctx.engine.engine.loaded.model, "prepare_prompt")


def check_images(ctx: Serving, refs: list[ImageRef], limit: int = MAX_MEDIA_ITEMS) -> None:
    """Refuses images for a text-only model, and more than `limit` of them."""
    if not refs:
        return
    if not reads_images(ctx):
        raise APIError(400, f"{refs[0].where}: the served model {ctx.settings.model_name} reads text only; it "
                            "takes no image parts", refs[0].where)
    if len(refs) > limit:
        raise APIError(400, f"the request has {len(refs)} media parts; the limit is {limit}", refs[limit].where)


# On a PD decode node, while it parses a handed-off body again: the media P read (their token
# counts and keys), which stand in for the images, so that D never fetches or encodes them.
HANDED_OVER: ContextVar[MediaInputs | None] = ContextVar("handed_over_media", default=None)


async def attach_images(ctx: Serving, ids: list[int], refs: list[ImageRef], field: str
                        ) -> tuple[list[int], MediaInputs | None]:
    """Fetches and decodes the images (concurrently), preprocesses them for the model and expands
    the prompt's image placeholders: (token ids, media), or (ids, None) without images."""
    if not refs:
        return ids, None
    given = HANDED_OVER.get()
    if given is not None:
        from mindie.model.qwen2_vl_processor import expand_placeholders

        pad = ctx.engine.engine.loaded.model.image_tokens.pad_id
        try:
            return expand_placeholders(ids, pad, list(given.items))[0], given
        except ValueError as exc:
            raise APIError(400, f"{field}: {exc} handed over", field) from None
    async def fetch(r: ImageRef) -> Any:
        try:
            return await load_image(r.ref, ctx.settings.media, r.where)
        except MediaError as exc:
            raise APIError(400, str(exc), r.where) from None

    images = await asyncio.gather(*(fetch(r) for r in refs))
    model = ctx.engine.engine.loaded.model
    try:
        expanded, media = await asyncio.to_thread(model.prepare_prompt, ids, list(images))
    except ValueError as exc:  # the model's preprocessing refused an image, or the placeholders disagree
        index = getattr(exc, "index", None)
        where = refs[index].where if index is not None else field
        raise APIError(400, f"{where}: {exc}", where) from None
    if len(expanded) > ctx.max_input_tokens:
        raise APIError(400, f"{field} has {len(expanded)} tokens with its images' {media.num_tokens}; the limit is "
                            f"{ctx.max_input_tokens} (images are never truncated)", field)
    return expanded, media
