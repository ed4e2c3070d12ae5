"""Chat messages and tools as request bodies carry them, and their rendering into a prompt
through the chat template: shared by OpenAI's chat route and vLLM's /tokenize."""

from __future__ import annotations

import re
import secrets
from typing import TYPE_CHECKING, Annotated, Any, Literal, NamedTuple

from jinja2 import TemplateError
from pydantic import Field, ValidationError

from mindie.server.errors import APIError
from mindie.server.fields import Body, describe
from mindie.server.protocols import tools as tools_support
from mindie.server.protocols.media import (
    MAX_MEDIA_ITEMS,
    MEDIA_PARTS,
    attach_media,
    check_media,
    media_refs,
    reads_media,
)
from mindie.server.protocols.params import ContentPart, join_parts

if TYPE_CHECKING:
    from mindie.engine.request import MediaInputs
    from mindie.server.serving import Serving


class FunctionCall(Body):
    name: Annotated[str, Field(max_length=256)]
    arguments: str


class ToolCall(Body):
    id: Annotated[str, Field(max_length=256)]
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: Annotated[str, Field(max_length=256)] | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=128)] | None = None
    tool_call_id: Annotated[str, Field(max_length=256)] | None = None


class FunctionDef(Body):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Body):
    type: Literal["function"]
    function: FunctionDef


def render_chat(ctx: Serving, messages: list[Any], tools: list[Tool] | None, add_generation_prompt: bool = True,
                template: str | None = None, kwargs: dict[str, Any] | None = None,
                continue_final: bool = False) -> tuple[str, list[int]]:
    """The conversation through the model's chat template (or the request's), in Jinja's sandbox,
    as text and token ids; tools through the template when it takes them, else through the
    fallback block. What the client wrote in a message is tokenized as plain text: a
    "<|im_start|>" there is text, never a control token. Only the template's own text can be.
    `continue_final`: the prompt ends where the final message's text ends (the template's end
    of turn cut off), so the model goes on writing that message."""
    plain = []
    for i, m in enumerate(messages):
        m = m if isinstance(m, Message) else parse_message(m, i)
        if m.role == "tool" and m.tool_call_id is None:
            raise APIError(422, f"messages[{i}].tool_call_id is required for a message of role 'tool'",
                           f"messages[{i}].tool_call_id")
        if not m.content and not (m.role == "assistant" and m.tool_calls):  # seed 004: absent or empty
            raise APIError(422, f"messages[{i}].content must be a non-empty string or list of parts (it may be "
                                "absent or empty only for an assistant message with tool_calls)",
                           f"messages[{i}].content")
        d: dict[str, Any] = {"role": m.role, "content": _template_content(ctx, m.content, f"messages[{i}].content")}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        plain.append(d)
    tool_dicts = [t.model_dump(exclude_none=True) for t in tools] if tools else None
    source = template if template is not None else ctx.tokenizer.chat_template
    if not tools_support.template_takes_tools(source):
        plain, tool_dicts = tools_support.apply_fallback(plain, tool_dicts), None
    if getattr(ctx.engine.engine.loaded.model, "template_reads_parts", False):
        # SmolVLM's template iterates a message's content as parts (a string renders nothing):
        # text goes in as one text part, as vLLM's "openai" content format gives it
        for m in plain:
            if isinstance(m.get("content"), str):
                m["content"] = [{"type": "text", "text": m["content"]}]
    # Each message's text goes through the template as a marker, so the rendered prompt can be
    # cut into the template's text and the client's.
    nonce = secrets.token_hex(8)
    contents: list[str] = []
    for m in plain:
        if isinstance(m.get("content"), str):
            contents.append(m["content"])
            m["content"] = f"\ue000{nonce}{len(contents) - 1}\ue001"
        elif isinstance(m.get("content"), list):  # a vision model's parts: the text parts are marked
            for part in m["content"]:
                if part["type"] == "text":
                    contents.append(part["text"])
                    part["text"] = f"\ue000{nonce}{len(contents) - 1}\ue001"
    ctx.check_chars(sum(map(len, contents)), "messages")  # before the template renders them
    try:
        rendered = ctx.tokenizer.apply_chat_template(plain, add_generation_prompt=add_generation_prompt,
                                                     tools=tool_dicts, template=template, **(kwargs or {}))
    except (TemplateError, TypeError, ValueError, KeyError, AttributeError) as exc:
        # the template is code over the client's messages: any failure is the request's
        raise APIError(422, f"the chat template failed on these messages: {exc}", "messages") from None
    pieces = re.split(f"\ue000{nonce}(\\d+)\ue001", rendered)
    if continue_final:
        pieces = _cut_after_final(pieces, plain, len(contents) - 1)
    text = "".join(contents[int(p)] if k % 2 else p for k, p in enumerate(pieces))
    if not any(s in c for c in contents for s in ctx.tokenizer.special_texts):
        # nothing to defuse: the whole prompt in one pass, exactly as transformers tokenizes it
        return text, ctx.tokenizer.encode(text, add_special_tokens=False)
    ids: list[int] = []
    for k, piece in enumerate(pieces):
        if k % 2:  # a message's text
            ids += ctx.tokenizer.encode_plain(contents[int(piece)])
        elif piece:
            ids += ctx.tokenizer.encode(piece, add_special_tokens=False)
    return text, ids


class PartsPrompt(NamedTuple):
    text: str  # the text parts, joined (what routes that echo the prompt echo)
    ids: list[int]  # the prompt, image placeholders expanded
    media: MediaInputs


async def render_parts(ctx: Serving, parts: str | list[ContentPart], field: str, limit: int = MAX_MEDIA_ITEMS
                       ) -> PartsPrompt | None:
    """A plain route's multimodal prompt (/infer `inputs`, TGI `inputs`, vLLM `prompt`, Triton
    `text_input`): the parts as one user turn through the chat template, as MindIE builds such a
    prompt, each image where its part stands. None when the parts hold no image: the route reads
    its text as it always has."""
    refs = media_refs(parts, field) if isinstance(parts, list) else []
    if not refs:
        return None
    check_media(ctx, refs, limit)
    _, ids = render_chat(ctx, [Message(role="user", content=parts)], None)
    ids, media = await attach_media(ctx, ids, refs, field)
    assert media is not None  # media were found above
    text = "".join(p.text or "" for p in parts if isinstance(p, ContentPart) and p.type == "text")
    return PartsPrompt(text, ctx.fit_prompt(ids, field), media)


def _template_content(ctx: Serving, content: str | list[ContentPart] | None, field: str) -> Any:
    """A message's content as the chat template reads it: text, or for a model that reads media
    and a message that holds some, the parts in order ({"type": "image"} / {"type": "video"} /
    {"type": "audio"} where one goes; the template writes its placeholder there)."""
    if content is None or isinstance(content, str):
        return content
    if not any(p.type in MEDIA_PARTS and reads_media(ctx, MEDIA_PARTS[p.type]) for p in content):
        return join_parts(content, field)
    parts: list[dict[str, Any]] = []
    for k, p in enumerate(content):
        if p.type in MEDIA_PARTS:
            parts.append({"type": MEDIA_PARTS[p.type]})
        elif p.type == "text":
            if p.text is None:
                raise APIError(422, f"{field}[{k}].text is required for a part of type 'text'", f"{field}[{k}].text")
            parts.append({"type": "text", "text": p.text})
        else:  # media_refs refused every other media type before rendering
            raise APIError(422, f"{field}[{k}] is of type {p.type!r}, which this server does not read", field)
    return parts


def _cut_after_final(pieces: list[str], plain: list[dict[str, Any]], final: int) -> list[str]:
    """`pieces` (template text and message markers, alternating) up to the final message's text: its
    content, or its last part where the template reads parts (which must then be a text part)."""
    where = f"messages[{len(plain) - 1}].content"
    content = plain[-1].get("content")
    ends_in_text = isinstance(content, str) or (isinstance(content, list) and bool(content)
                                                and content[-1].get("type") == "text")
    if not ends_in_text or final < 0:
        raise APIError(422, f"continue_final_message needs the final message to end in text ({where})", where)
    marks = [k for k in range(1, len(pieces), 2) if int(pieces[k]) == final]
    if not marks:
        raise APIError(422, "continue_final_message: the chat template does not render the final message",
                       where)
    return pieces[: marks[-1] + 1]


def parse_message(raw: Any, i: int) -> Message:
    try:
        return Message.model_validate(raw)
    except ValidationError as exc:
        msg, _ = describe(exc)
        raise APIError(422, f"messages[{i}].{msg}", f"messages[{i}]") from None
