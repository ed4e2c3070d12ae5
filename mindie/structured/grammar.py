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

Here: the compiler and its cache, and the compiled `Grammar`. A request's `GrammarMatcher` and the
rule that fits a JSON value into max_tokens are in matcher.py; the schema rewrites done before
compiling (bounds on free strings and keys, the tool-call schema) in schemas.py; a grammar that
starts after a reasoning model's think block (no mask while it reasons) in reasoning_gate.py.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import llguidance
import torch
from llguidance.gbnf_to_lark import any_to_lark

from mindie.structured.errors import GrammarError
from mindie.structured.matcher import Closers, GrammarMatcher
from mindie.structured.reasoning_gate import GatedMatcher, ReasoningGate
from mindie.structured.schemas import bound_schema, tool_call_schema
from mindie.tokenizer import Tokenizer

_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Grammar:
    """A compiled constraint: a pristine llguidance matcher that is only ever copied. With a
    `gate`, each sample's matcher starts after the reply's reasoning (reasoning_gate.py)."""

    def __init__(self, matcher: llguidance.LLMatcher, bitmask_words: int, closers: Closers | None = None,
                 gate: ReasoningGate | None = None) -> None:
        self._matcher = matcher
        self._words = bitmask_words
        self._closers = closers
        self.gate = gate

    def matcher(self) -> GrammarMatcher | GatedMatcher:
        inner = GrammarMatcher(self._matcher.deep_copy(), self._words, self._closers)
        return inner if self.gate is None else GatedMatcher(inner, self.gate)

    def after_reasoning(self, gate: ReasoningGate) -> Grammar:
        """This grammar for one request whose reply may reason first (the compiled one, shared)."""
        return Grammar(self._matcher, self._words, self._closers, gate)

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
        # llguidance's view of the vocabulary holds tens of MiB (56 MiB resident for the embedded
        # model's, 36 MiB once the heap is trimmed): built at the first compile, not at start-up.
        self._tokenizer: llguidance.LLTokenizer | None = None
        self.vocab_size = tokenizer.vocab_size
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
        matcher = llguidance.LLMatcher(self._get_tokenizer(), text, log_level=0, limits=self._limits)
        if matcher.is_error():
            raise GrammarError(f"invalid JSON schema: {matcher.get_error()}")
        # Some problems (an over-complex lexer) surface only at the first mask: find them now, on a
        # copy, rather than in the engine.
        probe = matcher.deep_copy()
        probe.compute_bitmask()
        if probe.is_error():
            raise GrammarError(f"invalid JSON schema: {probe.get_error()}")
        return Grammar(matcher, self.bitmask_words, self._get_closers() if closers else None)

    def _get_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                source = self._tokenizer_source
                self._tokenizer = llguidance.LLTokenizer(
                    source.backend.to_str(), n_vocab=source.vocab_size, eos_token=list(source.eos_token_ids) or None)
            return self._tokenizer

    def _get_closers(self) -> Closers:
        with self._lock:
            if self._closers is None:
                self._closers = Closers.for_tokenizer(self._tokenizer_source, self.vocab_size)
            return self._closers
