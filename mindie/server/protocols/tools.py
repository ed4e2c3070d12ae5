"""Tool calling and structured output for the chat route: prompting, the constraint a request
asks for, and reading calls back out of the model's text.

Prompting: a chat template that takes `tools` gets them; otherwise one fallback block in the system
turn lists the functions and the JSON form of a call, and earlier assistant `tool_calls` are
written into their message in that same form, so multi-turn conversations round-trip through any
template. Constraints: `tool_choice` "required" or a named function, and `response_format`
json_object / json_schema, compile (llguidance, cached) into a grammar the engine enforces with a
token mask; a schema that does not compile is a 400 before anything reaches the engine.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from mindie.server.errors import APIError
from mindie.structured.errors import GrammarError

if TYPE_CHECKING:
    from mindie.structured.grammar import Grammar, GrammarCompiler

FALLBACK_BLOCK = (
    "You can call functions. To call one, answer with only a JSON object of the form "
    '{{"name": <function name>, "arguments": <object of arguments>}} and nothing else. '
    "Otherwise answer normally. The functions:\n{functions}"
)


def template_takes_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template  # type: ignore[operator]


def call_text(tool_calls: list[dict[str, Any]]) -> str:
    """Earlier calls written the way the fallback block asks the model to write them."""
    calls = []
    for c in tool_calls:
        try:
            arguments = json.loads(c["function"]["arguments"])
        except (json.JSONDecodeError, TypeError):
            arguments = c["function"]["arguments"]
        calls.append({"name": c["function"]["name"], "arguments": arguments})
    return json.dumps(calls[0] if len(calls) == 1 else calls, ensure_ascii=False)


def apply_fallback(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Messages for a template that knows nothing of tools."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["content"] = ((m.get("content") or "") + "\n" + call_text(m.pop("tool_calls"))).strip()
        m.pop("tool_call_id", None)
        out.append(m)
    if tools:
        functions = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
        block = FALLBACK_BLOCK.format(functions=functions)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{block}"
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _check_parameters(parameters: dict[str, Any], where: str) -> None:
    """Seed 004's shape: {"type": "object", "properties": {...}, "required": [...]}, with an
    optional additionalProperties (false when absent, which the grammar honours). `required` may be
    left out, as JSON Schema allows and langchain, pydantic-ai and the `llm` CLI do for tools whose
    arguments all have defaults: it reads as []; so may `properties` (a tool without arguments)."""
    if parameters.get("type") != "object":
        raise APIError(422, f"{where}.type must be 'object', got {parameters.get('type')!r}", f"{where}.type")
    properties = parameters.get("properties", {})
    if not isinstance(properties, dict) or not all(isinstance(v, dict) for v in properties.values()):
        raise APIError(422, f"{where}.properties must be an object mapping each parameter name to its schema "
                            "object", f"{where}.properties")
    required = parameters.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise APIError(422, f"{where}.required must be a list of parameter names", f"{where}.required")
    missing = [r for r in required if r not in properties]
    if missing:
        raise APIError(422, f"{where}.required names {missing}, which are not in properties", f"{where}.required")
    extra = parameters.get("additionalProperties", False)
    if not isinstance(extra, bool | dict):
        raise APIError(422, f"{where}.additionalProperties must be true, false or a schema object, got {extra!r}",
                       f"{where}.additionalProperties")


def check_tools(tools: list[Any] | None, tool_choice: Any) -> dict[str, dict[str, Any] | None]:
    """Name -> parameters of each tool, after the seed's rules; raises a 400-worthy APIError."""
    by_name: dict[str, dict[str, Any] | None] = {}
    for i, tool in enumerate(tools or []):
        f = tool.function
        if f.parameters is not None:
            _check_parameters(f.parameters, f"tools[{i}].function.parameters")
        if f.name in by_name:
            raise APIError(422, f"tools[{i}].function.name {f.name!r} is defined twice", f"tools[{i}].function.name")
        by_name[f.name] = f.parameters
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") if tool_choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise APIError(422, "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                                "\"function\": {\"name\": <a tool name>}}", "tool_choice")
        if name not in by_name:
            raise APIError(422, f"tool_choice names function {name!r}, which is not in tools ({sorted(by_name)})",
                           "tool_choice.function.name")
    elif tool_choice == "required" and not by_name:
        raise APIError(422, "tool_choice 'required' needs at least one tool in tools", "tool_choice")
    return by_name


def constrained(tool_choice: Any, response_format: Any, strict: bool) -> bool:
    """Whether `constraint` has a grammar for these: a call is required or named, a format is
    asked for, or a strict tool may be called."""
    formatted = response_format is not None and response_format.type != "text"
    return tool_choice == "required" or isinstance(tool_choice, dict) or formatted or (
        strict and tool_choice != "none")


def constraint(compiler: GrammarCompiler, tools: dict[str, dict[str, Any] | None], tool_choice: Any,
               response_format: Any, strict: bool = False) -> Grammar | None:
    """The grammar the output must follow, if any (compiling can take a while: call it off the
    event loop). `strict`: a tool asks for strict arguments, so with tool_choice "auto" the output
    is either plain text or a call that follows its schema. A response format beside tools that
    may be called ("auto") makes the output either an answer in that format or a call: a format
    alone would leave the model no way to call a tool."""
    try:
        if tool_choice == "required":
            return compiler.tool_call(tools)
        if isinstance(tool_choice, dict):
            name = tool_choice["function"]["name"]
            return compiler.tool_call({name: tools[name]})
        answer = None if response_format is None else response_format.answer_schema()
        if tools and tool_choice in (None, "auto") and (strict or answer is not None):
            return compiler.text_or_tool_call(tools, answer)
        return None if answer is None else compiler.json_schema(answer)
    except GrammarError as exc:
        param = "response_format.json_schema.schema" if response_format is not None else "tools"
        raise APIError(422, f"{param}: {exc}", param) from None
