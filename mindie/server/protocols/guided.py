"""Structured output asked for in the vocabularies of vLLM (`structured_outputs`, `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`), llama.cpp (`grammar` in GBNF, a top-level
`json_schema`) and TGI (`parameters.grammar`), read into one `Constraint`, so a request from any
of those clients is constrained as it asked and never silently free. Compiling goes through the
server's one GrammarCompiler, off the event loop; a constraint that does not compile, or two
that compete, is a 400 naming the field."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from mindie.server.errors import APIError
from mindie.server.fields import Body
from mindie.structured.errors import GrammarError

if TYPE_CHECKING:
    from mindie.server.serving import Serving
    from mindie.structured.grammar import Grammar, GrammarCompiler
    from mindie.structured.reasoning_gate import ReasoningGate

Kind = Literal["json", "json_object", "regex", "choice", "grammar"]

# vLLM's structured_outputs options that only restate what every constraint here does: no free
# whitespace in JSON, objects that list their properties get no others, and no fallback backend.
_RESTATED_OPTIONS = {"disable_any_whitespace", "disable_additional_properties", "disable_fallback"}
_STRUCTURED_KINDS: dict[str, Kind] = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar",
                                      "json_object": "json_object"}


class ResponseFormat(Body):
    """OpenAI's response_format (chat; vLLM takes it on completions too)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None
    # llama.cpp's {"type": "json_object", "schema": ...} and huggingface_hub's "value"
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    value: dict[str, Any] | None = None

    def answer_schema(self) -> dict[str, Any] | None:
        """The JSON schema the answer must follow; None for plain text."""
        if self.type == "text":
            return None
        # llama.cpp's and huggingface_hub's schema beside the type, where OpenAI has none
        inline = self.schema_ if self.schema_ is not None else self.value
        if self.type == "json_object":
            return {"type": "object"} if inline is None else inline
        schema = (self.json_schema or {}).get("schema") if inline is None else inline
        if not isinstance(schema, dict):
            raise APIError(422, "response_format.json_schema.schema must be a JSON schema object",
                           "response_format.json_schema.schema")
        return schema


@dataclass(frozen=True)
class Constraint:
    param: str  # the field that asked for it, named in errors
    kind: Kind
    value: Any

    def compile(self, compiler: GrammarCompiler) -> Grammar:
        try:
            if self.kind == "json":
                return compiler.json_schema(self.value)
            if self.kind == "json_object":
                return compiler.json_object()
            if self.kind == "regex":
                return compiler.regex(self.value)
            if self.kind == "choice":
                return compiler.choice(self.value)
            return compiler.grammar(self.value)
        except GrammarError as exc:
            raise APIError(422, f"{self.param}: {exc}", self.param) from None


class GuidedFields(Body):
    """The request fields of vLLM's and llama.cpp's structured output, on every route that takes
    vLLM's flat sampling fields."""

    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, max_length=4096)
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    grammar: str | None = None  # llama.cpp: GBNF
    json_schema: dict[str, Any] | None = None  # llama.cpp

    def guided(self) -> list[Constraint]:
        """Every constraint these fields ask for (callers refuse more than one)."""
        if self.guided_whitespace_pattern is not None:
            raise APIError(422, "guided_whitespace_pattern is not supported: JSON is generated without free "
                                "whitespace", "guided_whitespace_pattern")
        found = []
        if self.guided_json is not None:
            found.append(Constraint("guided_json", "json", schema_value(self.guided_json, "guided_json")))
        for param, kind in (("guided_regex", "regex"), ("guided_choice", "choice"), ("guided_grammar", "grammar"),
                            ("grammar", "grammar")):
            if getattr(self, param) is not None:
                found.append(Constraint(param, kind, getattr(self, param)))  # type: ignore[arg-type]
        if self.json_schema is not None:
            found.append(Constraint("json_schema", "json", self.json_schema))
        if self.structured_outputs is not None:
            found += _structured_outputs(self.structured_outputs)
        return found


def schema_value(value: Any, param: str) -> dict[str, Any]:
    """A JSON schema sent as an object or as JSON text (vLLM takes both)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise APIError(422, f"{param} must be a JSON schema object or its JSON text: {exc}", param) from None
    if not isinstance(value, dict):
        raise APIError(422, f"{param} must be a JSON schema object", param)
    return value


def _structured_outputs(options: dict[str, Any]) -> list[Constraint]:
    found = []
    for key, value in options.items():
        param = f"structured_outputs.{key}"
        if value is None or key in _RESTATED_OPTIONS:
            continue
        kind = _STRUCTURED_KINDS.get(key)
        if kind is None:
            raise APIError(422, f"{param} is not supported (supported: {', '.join(_STRUCTURED_KINDS)})", param)
        if kind == "json":
            value = schema_value(value, param)
        elif kind == "json_object":
            if value is not True:
                raise APIError(422, f"{param} must be true when given", param)
        elif kind == "choice":
            if not isinstance(value, list):
                raise APIError(422, f"{param} must be a list of strings", param)
        elif not isinstance(value, str):
            raise APIError(422, f"{param} must be a string", param)
        found.append(Constraint(param, kind, value))
    return found


def response_format(value: ResponseFormat | None) -> list[Constraint]:
    """response_format as a constraint, where nothing else (tools) shares the output."""
    schema = None if value is None else value.answer_schema()
    return [] if schema is None else [Constraint("response_format", "json", schema)]


def one_of(constraints: list[Constraint]) -> Constraint | None:
    if len(constraints) > 1:
        names = ", ".join(c.param for c in constraints)
        raise APIError(422, f"only one structured-output constraint may be given, got {names}",
                       constraints[1].param)
    return constraints[0] if constraints else None


async def compile_checked(ctx: Serving, build: Any, max_tokens: int | None, what: str,
                          budget_param: str = "max_tokens", gate: ReasoningGate | None = None) -> Grammar | None:
    """`build()` (a compile, off the event loop), behind `gate` when the reply may reason first,
    then the budget check: a `max_tokens` (named `budget_param` in the request) too small for any
    valid output is a 400 saying how many tokens are needed, where that is known."""
    grammar = await asyncio.to_thread(build)
    if grammar is not None and gate is not None:
        grammar = grammar.after_reasoning(gate)
    if grammar is not None and max_tokens is not None:
        needed = grammar.matcher().min_tokens(limit=max_tokens + 1)
        if needed is not None and needed > max_tokens or needed is None and grammar.budgeted:
            raise APIError(422, f"{budget_param} is {max_tokens}, too few for any valid output: {what} needs at "
                                f"least {needed or 'more than ' + str(max_tokens)} tokens", budget_param)
    return grammar


async def compile_guided(ctx: Serving, constraint: Constraint | None, max_tokens: int | None,
                         gate: ReasoningGate | None = None) -> Grammar | None:
    if constraint is None:
        return None
    return await compile_checked(ctx, lambda: constraint.compile(ctx.grammars), max_tokens, constraint.param,
                                 gate=gate)
