"""JSON-schema rewrites done before compiling: bounding what a sampling model could extend forever,
and the schema of a tool call built from the tools' parameter schemas."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mindie.structured.errors import GrammarError

MAX_FREE_STRING = 256  # characters


def bound_schema(schema: Any) -> Any:
    """The schema the output is generated under: every string with no length bound, pattern,
    format, enum or const gets maxLength MAX_FREE_STRING, and an object that lists its properties
    but says nothing of others gets only those. A sampling model can otherwise stay inside one
    string, or keep inventing keys, until max_tokens cuts the value off unfinished. Whatever the
    bounded schema allows, the original allows too."""
    if isinstance(schema, list):
        return [bound_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bound_schema(v) for k, v in schema.items()}
    if out.get("type") == "string" and not any(k in out for k in ("maxLength", "pattern", "format", "enum",
                                                                     "const")):
        out["maxLength"] = MAX_FREE_STRING
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def tool_call_schema(tools: Mapping[str, Mapping[str, Any] | None], parallel: bool = False) -> dict[str, Any]:
    """The JSON schema of a call to one of ``tools`` (see :meth:`GrammarCompiler.tool_call`)."""
    if not tools:
        raise GrammarError("tools: at least one tool is needed")
    calls = []
    for i, (name, parameters) in enumerate(tools.items()):
        if not isinstance(name, str) or not name:
            raise GrammarError(f"tools: a tool name must be a non-empty string, got {name!r}")
        if parameters is None:
            parameters = {"type": "object", "properties": {}, "additionalProperties": False}
        elif not isinstance(parameters, Mapping):
            raise GrammarError(f"tools: the parameters of {name!r} must be a JSON schema object")
        where = ("/items" if parallel else "") + ("" if len(tools) == 1 else f"/anyOf/{i}") + "/properties/arguments"
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": relocate_refs(parameters, where)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {"type": "array", "items": call, "minItems": 1} if parallel else call


_LITERAL_KEYWORDS = frozenset({"const", "enum", "default", "examples"})  # hold values, not schemas
_NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def relocate_refs(schema: Any, pointer: str) -> Any:
    """`schema` moved to `pointer` inside a larger document: its local references ("#/$defs/X",
    "#") are resolved against its own root, so each is rewritten to start at `pointer`. This is
    what keeps the $defs that pydantic emits for a model inside a model resolving once a tool's
    parameters sit under a call's "arguments"."""
    if isinstance(schema, list):
        return [relocate_refs(s, pointer) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = "#" + pointer + value[1:]
        elif key in _LITERAL_KEYWORDS:
            out[key] = value
        elif key in _NAMED_SCHEMAS and isinstance(value, Mapping):  # keys are names, values schemas
            out[key] = {name: relocate_refs(sub, pointer) for name, sub in value.items()}
        else:
            out[key] = relocate_refs(value, pointer)
    return out
