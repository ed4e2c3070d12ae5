"""What the API families share: content parts, finish-reason names, stream framing, and the
TGI-style rule for when sampling is on."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from starlette.responses import JSONResponse, Response, StreamingResponse

from mindie.engine.request import FinishReason
from mindie.server.errors import APIError, ErrorStyle
from mindie.server.fields import Body
from mindie.server.serving import Closable, GenerationTimeout

MAX_MEDIA_ITEMS = 20


class ContentPart(Body):
    type: Literal["text", "image_url", "video_url", "audio_url", "input_audio", "image"]
    text: str | None = None


def join_parts(value: str | list[ContentPart], field: str) -> str:
    """Text of a string or a list of content parts. This model reads text only: any image, video
    or audio part is refused (and never fetched)."""
    if isinstance(value, str):
        return value
    if len(value) > 64 * MAX_MEDIA_ITEMS:
        raise APIError(422, f"{field} has {len(value)} parts; the limit is {64 * MAX_MEDIA_ITEMS}", field)
    texts = []
    for i, part in enumerate(value):
        if part.type != "text":
            raise APIError(422, f"{field}[{i}] is of type {part.type!r}, but the served model reads text only; "
                                "send parts of type 'text'", f"{field}[{i}].type")
        if part.text is None:
            raise APIError(422, f"{field}[{i}].text is required for a part of type 'text'", f"{field}[{i}].text")
        texts.append(part.text)
    return "".join(texts)


# MindIE's native names (eos_token / stop_sequence / length), used by the native, TGI and Triton
# routes; a cancelled request ends as stop_sequence there.
MINDIE_REASONS = {FinishReason.EOS: "eos_token", FinishReason.STOP: "stop_sequence",
                  FinishReason.LENGTH: "length", FinishReason.ABORT: "stop_sequence"}
OPENAI_REASONS = {FinishReason.EOS: "stop", FinishReason.STOP: "stop", FinishReason.LENGTH: "length",
                  FinishReason.ABORT: "stop"}


def sampling_on(do_sample: bool | None, *warpers: object) -> bool:
    """TGI's rule: sampling is on when asked for, or when any sampling parameter is given."""
    return do_sample if do_sample is not None else any(w is not None for w in warpers)


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def sse(obj: Any, space: bool = True) -> bytes:
    return (("data: " if space else "data:") + dumps(obj) + "\n\n").encode()


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(dumps(obj).encode(), status_code=status, media_type="application/json")


def error_response(err: APIError, style: ErrorStyle) -> Response:
    return JSONResponse(err.body(style), status_code=err.status, headers=err.headers)


def stream_response(
    stream: Closable,
    events: Callable[[], AsyncIterator[bytes]],
    on_error: Callable[[APIError], bytes],
    media_type: str = "text/event-stream",
) -> StreamingResponse:
    """Streams a family's events. An error after the response started (a timeout) cannot change
    the status any more: it becomes one last event in the family's framing. However the stream
    ends, including a client that goes away, the request is closed, which aborts it if unfinished."""

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in events():
                yield chunk
        except GenerationTimeout as exc:
            yield on_error(APIError(500, str(exc)))
        except APIError as exc:
            yield on_error(exc)
        finally:
            await stream.aclose()

    return StreamingResponse(body(), media_type=media_type, headers={"Cache-Control": "no-cache"})
