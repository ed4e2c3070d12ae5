"""JSON-schema constraints compiled by llguidance into per-request token matchers.

Life of a constraint: the server compiles the request's schema while it parses the body, so a
schema llguidance rejects is a :class:`GrammarError` (a 400) and never reaches the engine; the
engine gives the request a :class:`GrammarMatcher` (a copy of the compiled grammar, microseconds);
each step the sampler fills one bitmask row per constrained request (:meth:`GrammarCompiler.
fill_bitmasks`), masks the logits with ``ops.apply_token_bitmask`` (free rows share the batch with
mask index -1), samples, and calls :meth:`GrammarMatcher.advance` with the sampled token.

JSON comes out on one line with ", " and ": " separators and no other whitespace: the form models
saw most in training, and free whitespace lets a constrained model loop on newlines forever.
EOS is allowed only once the value is complete.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np
import torch
from llguidance.gbnf_to_lark import any_to_lark

from mindie.structured.errors import GrammarError
from mindie.tokenizer import Tokenizer

_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Closers:
    """What a shortest completion is built from, per tokenizer: tokens that end things, best
    first, then the shortest values, and every token's length to pick the longest allowed one
    where none of those fits (an enum value, a required key, a string's minimum length).

    The order is what keeps the greedy search finite: a closing quote first (inside a string it
    ends the string; where a value is due it opens the shortest one), then the characters that
    close containers or separate items, which are never content outside a string, and only then
    values. A digit before a separator would extend a number forever ("3" -> "30" -> "300").
    """

    preferred: tuple[int, ...]
    lengths: np.ndarray  # int32 [vocab]: characters of each token's text; -1 for special tokens

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, vocab_size: int) -> Closers:
        preferred = []
        for piece in ('"', '"}', '"]', "}", "]", "}]", "}}", ", ", ",", "0", "null", "true", "false", ": ", ":"):
            ids = tokenizer.encode(piece, add_special_tokens=False)
            if len(ids) == 1 and ids[0] not in preferred:
                preferred.append(ids[0])
        lengths = np.array([len(tokenizer.decode([t], skip_special_tokens=True)) or -1 for t in range(vocab_size)],
                           dtype=np.int32)
        return cls(tuple(preferred), lengths)


def _shortest_path(matcher: llguidance.LLMatcher, closers: Closers, limit: int) -> list[int] | None:
    """A short token path from `matcher`'s state (not changed) to a complete value, found greedily:
    forced tokens, else the first allowed closer, else the longest allowed token; None if there is
    none within `limit` tokens. Each step of the path leads to the rest of it, so following it
    one token at a time takes exactly its length."""
    m = matcher.deep_copy()
    path: list[int] = []
    while not m.is_accepting():
        if len(path) >= limit or m.is_error():
            return None
        forced = m.compute_ff_tokens()[: limit - len(path)]
        if forced:
            if m.try_consume_tokens(forced) != len(forced):
                return None
            path += forced
            continue
        # A single-token check per closer: far cheaper than the whole vocabulary's mask.
        token = next((t for t in closers.preferred if m.validate_tokens([t]) == 1), -1)
        if token < 0:
            allowed = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")
            scores = np.where(allowed[: len(closers.lengths)].astype(bool), closers.lengths, -2)
            token = int(scores.argmax())
            if scores[token] < 0:
                return None  # only special tokens (EOS) left, yet not accepting
        if not m.consume_token(token):
            return None
        path.append(token)
    return path


class GrammarMatcher:
    """One request's position in its grammar. Not thread-safe; owned by the engine thread."""

    def __init__(self, matcher: llguidance.LLMatcher, bitmask_words: int, closers: Closers | None = None) -> None:
        self._matcher = matcher
        self._words = bitmask_words
        self._closers = closers
        # A completion that fits the budget from the current state: a model that follows it needs
        # no search. None when not known.
        self._path: list[int] | None = None
        self._next: tuple[int, list[int]] | None = None  # fit_budget's token and the path after it
        # No completion fits what is left: the rule cannot help any more, and searching again
        # each step would only cost time (max_tokens cuts the value as it would a free one).
        self._hopeless = False

    def fit_budget(self, token: int, budget: int) -> int:
        """The token to take now with `budget` tokens left (this one included): `token`, unless
        the value could then no longer be completed within the budget, in which case the next
        token of a shortest completion from here. So a value always finishes, closing what is open
        and filling the required fields, when the budget comes down to what that needs."""
        if self._closers is None or self._hopeless:
            return token
        if self._path and self._path[0] == token:  # the known completion goes on fitting
            self._next = (token, self._path[1:])
            return token
        after = self._matcher.deep_copy()
        if after.consume_token(token):
            rest = _shortest_path(after, self._closers, budget - 1)
            if rest is not None:
                self._next = (token, rest)
                return token
        path = self._path if self._path else _shortest_path(self._matcher, self._closers, budget)
        if not path:  # None: nothing fits any more; []: the value is already complete (EOS is allowed)
            self._hopeless = path is None
            return token
        self._next = (path[0], path[1:])
        return path[0]

    def min_tokens(self, limit: int = 4096) -> int | None:
        """Tokens the shortest completion from here needs (greedy, an upper bound); None if not known."""
        if self._closers is None:
            return None
        path = _shortest_path(self._matcher, self._closers, limit)
        return None if path is None else len(path)

    @property
    def bitmask_words(self) -> int:
        return self._words

    def fill_bitmask(self, out_row: torch.Tensor) -> None:
        """Write the allowed next tokens into ``out_row`` (int32 [bitmask_words], contiguous):
        bit ``j`` of word ``w`` set = token ``32 * w + j`` allowed. Once the value is complete only
        the EOS tokens are allowed; after an error, only EOS too."""
        # Written through a raw pointer: a wrong buffer must be an exception, not a crash.
        if out_row.dtype != torch.int32 or out_row.device.type != "cpu" or out_row.shape != (self._words,):
            got = f"{out_row.dtype} {list(out_row.shape)} on {out_row.device}"
            raise ValueError(f"out_row: expected int32 [{self._words}] on the CPU, got {got}")
        if not out_row.is_contiguous():
            raise ValueError("out_row: must be contiguous")
        self._matcher.unsafe_compute_mask_ptr(out_row.data_ptr(), 4 * self._words)

    def advance(self, token_id: int) -> bool:
        """Consume the sampled token. False if the grammar forbids it: the matcher is then in its
        error state for good (see :attr:`error`) and the request should finish."""
        known, self._next = self._next, None
        self._path = known[1] if known is not None and known[0] == token_id else None
        return self._matcher.consume_token(token_id)

    def accepts_eos(self) -> bool:
        """The text so far is a complete value: EOS is allowed now."""
        return self._matcher.is_accepting()

    def is_finished(self) -> bool:
        """Nothing but EOS can follow (the value is closed, or the matcher failed)."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() if self._matcher.is_error() else None


class Grammar:
    """A compiled constraint: a pristine llguidance matcher that is only ever copied."""

    def __init__(self, matcher: llguidance.LLMatcher, bitmask_words: int, closers: Closers | None = None) -> None:
        self._matcher = matcher
        self._words = bitmask_words
        self._closers = closers

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._matcher.deep_copy(), self._words, self._closers)

    @property
    def budgeted(self) -> bool:
        """Whether outputs end in time within max_tokens (JSON: see GrammarMatcher.fit_budget)."""
        return self._closers is not None


class GrammarCompiler:
    """Compiles JSON schemas for one tokenizer, caching up to ``cache_size`` grammars (LRU).

    The cache key is the schema's compact JSON with its key order kept: llguidance emits object
    properties in declaration order, so two orders are two grammars. Thread-safe: the server
    compiles while the engine thread makes matchers. ``num_threads``: llguidance's threads for
    :meth:`fill_bitmasks` (None: its default, 80% of the cores up to 32).
    """

    def __init__(self, tokenizer: Tokenizer, cache_size: int = 128, num_threads: int | None = None) -> None:
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        self._tokenizer = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size, eos_token=list(tokenizer.eos_token_ids) or None
        )
        self.vocab_size = self._tokenizer.vocab_size
        # Logits wider than this (a padded lm_head) are forbidden by the mask kernel past the end.
        self.bitmask_words = (self.vocab_size + 31) // 32
        self.cache_size = cache_size
        # Short error messages: verbose ones quote parser state and the schema back to the client.
        self._limits = llguidance.LLParserLimits(verbose_errors=False)
        self._executor = llguidance.LLExecutor(num_threads)
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._tokenizer_source = tokenizer
        self._closers: Closers | None = None  # built at the first compile (decodes the vocabulary once)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._cache)

    # --- what the server compiles ------------------------------------------------------------

    def json_schema(self, schema: Mapping[str, Any]) -> Grammar:
        """Output must be JSON valid under ``schema`` (response_format json_schema)."""
        if not isinstance(schema, Mapping):
            raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
        try:
            key = json.dumps(schema, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as e:
            raise GrammarError(f"the schema is not JSON: {e}") from None
        return self._cached(key, lambda: self._compile(key))

    def text_or_tool_call(self, tools: Mapping[str, Mapping[str, Any] | None],
                          answer: Mapping[str, Any] | None = None) -> Grammar:
        """tool_choice "auto" with strict tools: either plain text that does not start the way a
        call does (with "{", "<" or whitespace), or one call to one of ``tools`` that follows its
        schema. With an ``answer`` schema (a response format beside the tools) the answer is JSON
        under it instead of plain text."""
        schema = {**bound_schema(tool_call_schema(tools)), "x-guidance": _JSON_OPTIONS}
        if answer is None:
            text = "TEXT\nTEXT: /[^{<\\s][\\s\\S]*/"
        else:
            if not isinstance(answer, Mapping):
                raise GrammarError(f"a JSON schema must be an object, got {type(answer).__name__}")
            text = "answer\nanswer: %json " + json.dumps({**bound_schema(answer), "x-guidance": _JSON_OPTIONS},
                                                          ensure_ascii=False)
        lark = "start: call | " + text + "\ncall: %json " + json.dumps(schema, ensure_ascii=False)
        def build() -> Grammar:
            try:
                return self._finish(llguidance.LLMatcher.grammar_from_lark(lark))
            except ValueError as e:
                raise GrammarError(f"invalid tool parameters schema: {e}") from None

        return self._cached("lark:" + lark, build)

    def _cached(self, key: str, build: Callable[[], Grammar]) -> Grammar:
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                return found
        grammar = build()  # outside the lock: compiling can take a while
        with self._lock:
            self._cache[key] = grammar
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return grammar

    def regex(self, pattern: str) -> Grammar:
        """Output must match `pattern` in full (vLLM's guided_regex, TGI's regex grammar)."""
        return self._cached("regex:" + pattern, lambda: self._free_form(
            llguidance.LLMatcher.grammar_from_regex(pattern), "regex"))

    def choice(self, options: Sequence[str]) -> Grammar:
        """Output must be exactly one of `options` (vLLM's guided_choice)."""
        if not options or not all(isinstance(o, str) and o for o in options):
            raise GrammarError("choice: a non-empty list of non-empty strings is needed")
        lark = "start: " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)
        return self._cached("lark:" + lark, lambda: self._free_form(lark, "choice"))

    def grammar(self, text: str) -> Grammar:
        """Output must follow a context-free grammar, in Lark's syntax (llguidance's) or in
        llama.cpp's GBNF (rules written `name ::= ...`), which is converted to Lark first."""
        def build() -> Grammar:
            try:
                lark = any_to_lark(text)
            except Exception as e:  # the converter raises its own error types and a few plain ones
                raise GrammarError(f"invalid grammar: {e}") from None
            return self._free_form(lark, "grammar")

        return self._cached("grammar:" + text, build)

    def _free_form(self, grammar: str, what: str) -> Grammar:
        """A grammar that is not JSON: no budget-aware ending, since the closers that shortest
        completions are built from are JSON's (max_tokens may cut such an output short)."""
        try:
            return self._finish(grammar, closers=False)
        except GrammarError as e:
            raise GrammarError(f"invalid {what}: {str(e).removeprefix('invalid JSON schema: ')}") from None

    def json_object(self) -> Grammar:
        """Output must be some JSON object (response_format json_object)."""
        return self.json_schema({"type": "object"})

    def tool_call(self, tools: Mapping[str, Mapping[str, Any] | None], parallel: bool = False) -> Grammar:
        """Output must call one of ``tools`` (name -> parameters schema; None = no parameters):
        ``{"name": <a tool name>, "arguments": <that tool's parameters>}``, or with ``parallel`` a
        non-empty JSON array of such objects. For tool_choice "required" pass every tool, for a
        named function just that one. :mod:`mindie.structured.tool_parser` reads both forms."""
        return self.json_schema(tool_call_schema(tools, parallel))

    # --- what the engine calls each step -------------------------------------------------------

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        """int32 [rows, bitmask_words], every token allowed."""
        return torch.full((rows, self.bitmask_words), -1, dtype=torch.int32)

    def fill_bitmasks(self, matchers: Sequence[GrammarMatcher], out: torch.Tensor) -> None:
        """``matchers[i].fill_bitmask(out[i])`` for all i, in parallel on llguidance's threads."""
        if out.dtype != torch.int32 or out.dim() != 2 or out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError("out: expected a contiguous int32 CPU tensor [rows, bitmask_words]")
        if out.shape[1] != self.bitmask_words or out.shape[0] < len(matchers):
            raise ValueError(
                f"out: expected at least {len(matchers)} rows of {self.bitmask_words} words, got {list(out.shape)}"
            )
        if not matchers:
            return
        pairs = [(m._matcher, i) for i, m in enumerate(matchers)]
        self._executor.unsafe_compute_mask_ptr(pairs, out.data_ptr(), 4 * self.bitmask_words, out.shape[0])

    # --- internals -----------------------------------------------------------------------------

    def _compile(self, schema_json: str) -> Grammar:
        bounded = json.dumps(bound_schema(json.loads(schema_json)), ensure_ascii=False)
        try:
            text = llguidance.LLMatcher.grammar_from_json_schema(bounded, overrides=_JSON_OPTIONS)
        except ValueError as e:
            raise GrammarError(f"invalid JSON schema: {e}") from None
        return self._finish(text)

    def _finish(self, text: str, closers: bool = True) -> Grammar:
        matcher = llguidance.LLMatcher(self._tokenizer, text, log_level=0, limits=self._limits)
        if matcher.is_error():
            raise GrammarError(f"invalid JSON schema: {matcher.get_error()}")
        # Some problems (an over-complex lexer) surface only at the first mask: find them now, on a
        # copy, rather than in the engine.
        probe = matcher.deep_copy()
        probe.compute_bitmask()
        if probe.is_error():
            raise GrammarError(f"invalid JSON schema: {probe.get_error()}")
        return Grammar(matcher, self.bitmask_words, self._get_closers() if closers else None)

    def _get_closers(self) -> Closers:
        with self._lock:
            if self._closers is None:
                self._closers = Closers.for_tokenizer(self._tokenizer_source, self.vocab_size)
            return self._closers


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
