"""Request-body building blocks shared by every API family: ranged numbers, bounded strings and
lists, and the conversion of a validation failure into one message naming the field, the problem
and the allowed range.

The families' request models (one pydantic model per route) are built from these, so the same
models validate bodies and generate `/openapi.json`.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from mindie.engine.request import SEED_MAX

INT32_MAX = 2**31 - 1


def _fmt(x: float | None, default: str) -> str:
    if x is None:
        return default
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else repr(x)


def number(
    lo: float | None = None,
    hi: float | None = None,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
    integer: bool = False,
    also: tuple[int, ...] = (),
    exclude: tuple[float, ...] = (),
) -> Any:
    """A number in [lo, hi] (either end open); `also` lists values accepted outside the range,
    `exclude` values refused inside it."""
    left = "(" if lo_open or lo is None else "["
    right = ")" if hi_open or hi is None else "]"
    rule = f"{left}{_fmt(lo, '-inf')}, {_fmt(hi, 'inf')}{right}"
    if also:
        rule = " or ".join(str(a) for a in also) + f" or {rule}"
    if exclude:
        rule += " except " + ", ".join(_fmt(e, "") for e in exclude)

    def check(v: float) -> float:
        if v in also:
            return v
        bad = (
            (not integer and not math.isfinite(v))
            or (lo is not None and (v <= lo if lo_open else v < lo))
            or (hi is not None and (v >= hi if hi_open else v > hi))
            or v in exclude
        )
        if bad:
            raise ValueError(f"must be in {rule}, got {v!r}")
        return v

    schema: dict[str, Any] = {"description": f"in {rule}"}
    if lo is not None and not also:
        schema["exclusiveMinimum" if lo_open else "minimum"] = lo
    if hi is not None:
        schema["exclusiveMaximum" if hi_open else "maximum"] = hi
    return Annotated[int if integer else float, AfterValidator(check), Field(json_schema_extra=schema)]


Seed = number(0, SEED_MAX, integer=True)  # uint64 on every route


def text(min_len: int = 0, max_len: int | None = None) -> Any:
    return Annotated[str, Field(min_length=min_len, max_length=max_len)]


def items(kind: Any, max_items: int | None = None, min_items: int = 0) -> Any:
    return Annotated[list[kind], Field(min_length=min_items, max_length=max_items)]


class Body(BaseModel):
    """Base of every request model: strict types (a string is not a number), unknown fields
    ignored (as MindIE does), and an explicit null means "not set" (the TGI client sends every
    optional field as null)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: v for k, v in value.items() if v is not None}
        return value


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _loc(parts: tuple[Any, ...]) -> str:
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif "[" in p or "-" in p or p in _TYPE_TAGS:  # union-member tags pydantic adds
            continue
        else:
            out += f".{p}" if out else p
    return out or "body"


def _short(value: Any) -> str:
    r = repr(value)
    return r if len(r) <= 80 else r[:77] + "..."


def describe(error: ValidationError) -> tuple[str, str | None]:
    """One message for the first problem, and the field it is about."""
    errors = error.errors(include_url=False)
    # Of a union's failed branches, the one that got deepest is the one the client meant; at equal
    # depth, one whose type matched (its complaint is about the value) over a type mismatch.
    err = max(errors, key=lambda e: (len(e["loc"]), not e["type"].endswith("_type")))
    field = _loc(tuple(err["loc"]))
    kind, msg = err["type"], err["msg"].removeprefix("Value error, ")
    if kind == "json_invalid":
        return f"the request body is not valid JSON: {msg.removeprefix('Invalid JSON: ')}", None
    if kind == "missing":
        return f"{field} is required", field
    if kind == "model_type" or kind == "dict_type" and not err["loc"]:
        return "the request body must be a JSON object", None
    if kind == "value_error":
        return f"{field} {msg}", field
    return f"{field}: {msg[0].lower() + msg[1:]}, got {_short(err.get('input'))}", field


def validate(model: type[BaseModel], body: bytes) -> Any:
    """Validates a raw JSON body against a request model; raises ValidationError."""
    return model.model_validate_json(body)
