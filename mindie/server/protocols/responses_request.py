"""The Responses API's request: its body (validated, and refused where this server cannot honour
a field, with OpenAI's string `code`), its input items as the chat route's messages (a
`function_call` item an assistant message's `tool_calls`, a `function_call_output` item a `tool`
message), its function tools and text format in the chat route's terms, and the constraint they
ask for. openai_responses.py parses with it and renders the response."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import AfterValidator, Field, ValidationError

from mindie.server.errors import APIError
from mindie.server.fields import INT32_MAX, Body, describe, number
from mindie.server.protocols.guided import ResponseFormat
from mindie.server.protocols.messages import Tool
from mindie.server.protocols.params import ContentPart

if TYPE_CHECKING:
    pass

MAX_ITEMS = 4096
MAX_TOOLS = 128
NAME = r"^[A-Za-z0-9_-]{1,64}$"


class ResponsesError(APIError):
    """An APIError with the string `code` OpenAI's Responses API gives it."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(status, message, param)
        self.code = code


def unsupported(param: str, why: str) -> ResponsesError:
    return ResponsesError(400, f"{param} is not supported: {why}", param, "unsupported_parameter")


def _unsupported_value(param: str, value: Any, why: str) -> ResponsesError:
    return ResponsesError(400, f"{param} {value!r} is not supported: {why}", param, "unsupported_value")


# --- the request body ----------------------------------------------------------------------------


def _metadata(value: dict[str, str]) -> dict[str, str]:
    """OpenAI's limits: 16 pairs, keys of up to 64 characters, values of up to 512."""
    if len(value) > 16:
        raise ValueError(f"must have at most 16 pairs, got {len(value)}")
    for k, v in value.items():
        if len(k) > 64 or len(v) > 512:
            raise ValueError(f"keys must have at most 64 characters and values 512, got {k[:70]!r}")
    return value


class FunctionTool(Body):
    """A function tool in the Responses API's flat shape (chat nests it under `function`)."""

    type: Literal["function"]
    name: Annotated[str, Field(pattern=NAME)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # absent or null: true, as OpenAI's default
    defer_loading: bool = False
    allowed_callers: list[str] | None = None
    output_schema: dict[str, Any] | None = None

    def to_chat(self) -> Tool:
        return Tool.model_validate({"type": "function", "function": {
            "name": self.name, "description": self.description, "parameters": self.parameters,
            "strict": self.strict is not False}})

    def echo(self) -> dict[str, Any]:
        return {"type": "function", "name": self.name, "description": self.description,
                "parameters": self.parameters, "strict": self.strict is not False}


class TextFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(pattern=NAME)] | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    def echo(self) -> dict[str, Any]:
        if self.type != "json_schema":
            return {"type": self.type}
        return {"type": "json_schema", "name": self.name, "schema": self.json_schema,
                "description": self.description, "strict": self.strict}


class TextConfig(Body):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class Reasoning(Body):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponseStreamOptions(Body):
    # Obfuscation pads stream events against length side channels; these events carry no padding.
    include_obfuscation: bool = True


class ResponsesRequest(Body):
    model: Annotated[str, Field(min_length=1)]
    # Items are read one by one (to_messages, function_tools) so that a refusal names the item.
    input: str | Annotated[list[dict[str, Any]], Field(max_length=MAX_ITEMS, description=(
        "a user message, or message (role user/system/developer/assistant, content a string or input_text/"
        "output_text/input_image/input_audio/audio_url/video_url parts), function_call (call_id, name, "
        "arguments) and function_call_output (call_id, output) items"))]
    instructions: str | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS, description=(
        "function tools: {type: function, name, description, parameters, strict (default true)}"))] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    # A limit on calls to built-in tools; this server runs none, so any limit holds.
    max_tool_calls: number(0, INT32_MAX, integer=True) | None = None  # type: ignore[valid-type]
    text: TextConfig | None = None
    max_output_tokens: number(0, INT32_MAX, lo_open=True, integer=True) | None = None  # type: ignore[valid-type]
    temperature: number(0, 2) = 1.0  # type: ignore[valid-type]
    top_p: number(0, 1, lo_open=True) = 1.0  # type: ignore[valid-type]
    top_logprobs: number(0, 20, integer=True) | None = None  # type: ignore[valid-type]
    include: Annotated[list[str], Field(max_length=16)] | None = None
    metadata: Annotated[dict[str, str], AfterValidator(_metadata)] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # prefix caching needs no key: every prompt's blocks are cached
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    service_tier: str | None = None
    store: bool = True
    stream: bool = False
    stream_options: ResponseStreamOptions | None = None
    previous_response_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    reasoning: Reasoning | None = None
    background: bool = False
    # Refused whenever present (see refuse).
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    moderation: Any = None
    image: Any = None
    access_programs: Any = None
    prompt_cache_options: Any = None
    background_options: Any = None

    @property
    def format(self) -> TextFormat | None:
        """The constrained output format, None for plain text."""
        fmt = self.text.format if self.text is not None else None
        return fmt if fmt is not None and fmt.type != "text" else None


_ABSENT_ONLY = {
    "conversation": "conversation objects are not kept here; continue a conversation with previous_response_id",
    "prompt": "stored prompt templates are not kept here; send the prompt as input and instructions",
    "context_management": "context compaction is not done here",
    "moderation": "moderation is not run here",
    "image": "this server does not generate images",
    "access_programs": "access programs do not apply to this server",
    "prompt_cache_options": "prefix caching here is automatic and takes no options",
    "background_options": "background responses are not run here",
}


def refuse(req: ResponsesRequest) -> None:
    """A 400 for the first field whose value this server cannot honour."""
    for name, why in _ABSENT_ONLY.items():
        if getattr(req, name) is not None:
            raise unsupported(name, why)
    if req.background:
        raise unsupported("background", "responses run in the foreground; send background false")
    r = req.reasoning
    if r is not None and (r.effort not in (None, "none") or r.summary is not None or r.generate_summary is not None):
        raise unsupported("reasoning", "the served model does not reason; send reasoning null")
    if req.truncation == "auto":
        raise _unsupported_value("truncation", "auto", "input items are never dropped; send 'disabled'")
    if req.text is not None and req.text.verbosity not in (None, "medium"):
        raise _unsupported_value("text.verbosity", req.text.verbosity, "the served model has one verbosity")
    if req.service_tier not in (None, "auto", "default"):
        raise _unsupported_value("service_tier", req.service_tier, "this server has one tier, 'default'")
    if req.prompt_cache_retention == "24h":
        raise _unsupported_value("prompt_cache_retention", "24h", "the prefix cache lives in memory")
    if req.include:
        raise _unsupported_value("include[0]", req.include[0], "no extra output data is produced here")
    if req.top_logprobs:
        raise unsupported("top_logprobs", "log-probabilities are returned by /v1/chat/completions (logprobs)")


# --- input items -> chat messages ----------------------------------------------------------------


class _MessageItem(Body):
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict[str, Any]]


class _FunctionCallItem(Body):
    call_id: Annotated[str, Field(min_length=1, max_length=256)]
    name: Annotated[str, Field(min_length=1, max_length=256)]
    arguments: str


class _FunctionCallOutputItem(Body):
    call_id: Annotated[str, Field(min_length=1, max_length=256)]
    output: str | list[dict[str, Any]]


def _item(model: type[Body], raw: dict[str, Any], where: str) -> Any:
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        message, param = describe(exc)
        raise ResponsesError(400, f"{where}.{message}", f"{where}.{param}" if param else where) from None


def _part_text(part: dict[str, Any], where: str) -> str:
    if part.get("type") == "input_file":
        raise _unsupported_value(f"{where}.type", "input_file", "this server stores and reads no files; send images "
                                 "as input_image, audio as input_audio or audio_url and video as video_url parts")
    if part.get("type") not in ("input_text", "output_text") or not isinstance(part.get("text"), str):
        raise ResponsesError(400, f"{where} must be an input_text or output_text part with a string text", where,
                             "invalid_value")
    return part["text"]


def _text(content: str | list[dict[str, Any]], where: str) -> str:
    """The text of a string or a list of text parts (a function call's output)."""
    if isinstance(content, str):
        return content
    return "".join(_part_text(part, f"{where}[{j}]") for j, part in enumerate(content))


# The chat route's own media parts, which a Responses message takes as they are: OpenAI's
# input_audio (the same shape in both APIs) and the audio_url / video_url parts chat takes (vLLM's).
CHAT_MEDIA_PARTS = ("input_audio", "audio_url", "video_url")


def _media_part(part: dict[str, Any], where: str) -> dict[str, Any]:
    """A media part as the chat route's content part: the image of an input_image under
    image_url, a chat media part checked as chat checks it (a 400 naming the part)."""
    if part["type"] in CHAT_MEDIA_PARTS:
        _item(ContentPart, part, where)
        return part
    if isinstance(part.get("image_url"), str) and part["image_url"]:
        return {"type": "image_url", "image_url": {"url": part["image_url"]}}
    if part.get("file_id") is not None:
        raise unsupported(f"{where}.file_id", "this server stores no files; send image_url (an http(s) URL, a data: "
                                              "URI or an allowed local path)")
    raise ResponsesError(400, f"{where}.image_url is required for an input_image part (an http(s) URL, a data: URI "
                              "or an allowed local path)", f"{where}.image_url", "invalid_value")


def _content(content: str | list[dict[str, Any]], where: str) -> str | list[dict[str, Any]]:
    """A message's content as the chat route takes it: its text, or, where it holds media parts,
    the parts in order as chat parts (text, and the media for the server's media readers)."""
    media = ("input_image", *CHAT_MEDIA_PARTS)
    if isinstance(content, str) or not any(part.get("type") in media for part in content):
        return nonempty(_text(content, where), where)
    return [_media_part(part, f"{where}[{j}]") if part.get("type") in media
            else {"type": "text", "text": _part_text(part, f"{where}[{j}]")} for j, part in enumerate(content)]


def nonempty(text: str, where: str) -> str:
    if not text:
        raise ResponsesError(400, f"{where} must not be empty", where, "invalid_value")
    return text


def to_messages(items: list[dict[str, Any]], field_name: str = "input", sources: list[int] | None = None
                ) -> list[dict[str, Any]]:
    """Responses items (input items, or a response's output items) as chat messages: consecutive
    function calls, and the assistant text before them, make one assistant message. `sources`, when
    given, gets the index of the item each message began with."""
    out: list[dict[str, Any]] = []
    for i, raw in enumerate(items):
        count = len(out)
        where = f"{field_name}[{i}]"
        kind = raw.get("type") or ("message" if "role" in raw else None)
        if kind == "message":
            m = _item(_MessageItem, raw, where)
            out.append({"role": m.role, "content": _content(m.content, f"{where}.content")})
        elif kind == "function_call":
            c = _item(_FunctionCallItem, raw, where)
            call = {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            o = _item(_FunctionCallOutputItem, raw, where)
            text = nonempty(_text(o.output, f"{where}.output"), f"{where}.output")
            out.append({"role": "tool", "tool_call_id": o.call_id, "content": text})
        elif kind == "reasoning":
            raise _unsupported_value(f"{where}.type", kind, "the served model does not reason")
        else:
            raise ResponsesError(400, f"{where}.type {kind!r} is not supported: the items taken are message, "
                                      "function_call and function_call_output", f"{where}.type", "unsupported_value")
        if sources is not None and len(out) > count:
            sources.append(i)
    return out


# --- tools and the output constraint -------------------------------------------------------------


def function_tools(raw: list[dict[str, Any]]) -> list[FunctionTool]:
    tools = []
    for i, t in enumerate(raw):
        where = f"tools[{i}]"
        if t.get("type") != "function":
            raise _unsupported_value(f"{where}.type", t.get("type"), "this server runs only function tools, which "
                                                                      "your code executes; built-in tools are not run")
        tool = _item(FunctionTool, t, where)
        if tool.defer_loading:
            raise unsupported(f"{where}.defer_loading", "there is no tool search here")
        if tool.allowed_callers not in (None, ["direct"]):
            raise unsupported(f"{where}.allowed_callers", "only the model calls functions here ('direct')")
        if tool.output_schema is not None:
            raise unsupported(f"{where}.output_schema", "function outputs are passed to the model as given")
        tools.append(tool)
    return tools


def chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    """The chat route's tool_choice for a Responses one."""
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function":
        raise _unsupported_value("tool_choice.type", choice.get("type"), "send 'none', 'auto', 'required' or "
                                                                         '{"type": "function", "name": <a tool name>}')
    name = choice.get("name")
    if not isinstance(name, str):
        raise ResponsesError(400, "tool_choice.name is required: the name of a function in tools",
                             "tool_choice.name", "invalid_value")
    return {"type": "function", "function": {"name": name}}


def as_responses(err: APIError) -> APIError:
    """A shared helper's error (written for the chat route) with the Responses API's field names."""
    def rename(s: str) -> str:
        return s.replace(".function.", ".").replace("response_format.json_schema.schema", "text.format.schema")

    param = "input" if err.param == "messages" else rename(err.param) if err.param else None
    return APIError(err.status, rename(err.message), param, err.headers)


def chat_format(fmt: TextFormat | None) -> ResponseFormat | None:
    """The chat route's response_format for a Responses text.format (None: plain text)."""
    if fmt is None:
        return None
    if fmt.type == "json_object":
        return ResponseFormat.model_validate({"type": "json_object"})
    if fmt.name is None:
        raise ResponsesError(400, "text.format.name is required for a json_schema format", "text.format.name",
                             "missing_required_parameter")
    if fmt.json_schema is None:
        raise ResponsesError(400, "text.format.schema is required for a json_schema format: a JSON schema object",
                             "text.format.schema", "missing_required_parameter")
    return ResponseFormat.model_validate({"type": "json_schema",
                                          "json_schema": {"name": fmt.name, "schema": fmt.json_schema}})
