"""Grammar-constrained decoding with the embedded model's tokenizer: random walks through the
allowed tokens (random logits, masked by the kernel, then argmax) always give valid JSON; EOS only
once the value is complete; bad schemas are GrammarErrors; the cache is bounded."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch

from mindie import ops
from mindie.structured.grammar import Grammar, GrammarCompiler, GrammarError
from mindie.structured.schemas import tool_call_schema
from mindie.structured.tool_parser import parse_tool_calls
from mindie.tokenizer import Tokenizer

RECORD = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 100000},
        "name": {"type": "string", "maxLength": 12},
        "status": {"enum": ["active", "disabled", "pending review"]},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
        "owner": {
            "type": "object",
            "properties": {
                "email": {"type": "string", "maxLength": 20},
                "admin": {"type": "boolean"},
                "manager": {"type": ["string", "null"], "maxLength": 6},
            },
            "required": ["email", "admin"],
            "additionalProperties": False,
        },
        "points": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["id", "name", "status", "owner", "points"],
    "additionalProperties": False,
}

TOOLS = {
    "get_weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 16},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "search": {
        "type": "object",
        "properties": {"query": {"type": "string", "maxLength": 10}, "limit": {"type": "integer", "minimum": 1}},
        "required": ["query"],
        "additionalProperties": False,
    },
    "list_files": None,  # no parameters
}


@pytest.fixture(scope="module")
def tok(smollm_tokenizer: Tokenizer) -> Tokenizer:
    return smollm_tokenizer


@pytest.fixture(scope="module")
def compiler(tok: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tok, num_threads=2)


def allowed(compiler: GrammarCompiler, row: torch.Tensor) -> torch.Tensor:
    """bool [vocab]: the tokens a bitmask row allows (as tests/reference/token_mask.py reads it)."""
    bits = np.unpackbits(row.numpy().view(np.uint8), bitorder="little")  # single-threaded, unlike torch's
    return torch.from_numpy(bits[: compiler.vocab_size].astype(bool))


def walk(compiler: GrammarCompiler, tok: Tokenizer, grammar: Grammar, seed: int, max_steps: int = 2000) -> str:
    """Greedy decoding of random logits under the grammar, until EOS; checks the mask each step."""
    gen = torch.Generator().manual_seed(seed)
    matcher = grammar.matcher()
    mask = compiler.allocate_bitmask(1)
    ids: list[int] = []
    for _ in range(max_steps):
        matcher.fill_bitmask(mask[0])
        ok = allowed(compiler, mask[0])
        eos_allowed = bool(ok[list(tok.eos_token_ids)].any())
        assert eos_allowed == matcher.accepts_eos()
        if eos_allowed:
            json.loads(tok.decode(ids))  # EOS only once the value is complete
        logits = torch.randn(1, compiler.vocab_size, generator=gen)
        ops.apply_token_bitmask(logits, mask)
        token = int(logits.argmax())
        assert ok[token].item()
        if token in tok.eos_token_ids:
            assert matcher.advance(token) and matcher.is_finished()
            return tok.decode(ids)
        assert matcher.advance(token), matcher.error
        ids.append(token)
    raise AssertionError(f"no EOS after {max_steps} tokens: {tok.decode(ids)!r}")


@pytest.mark.parametrize("seed", range(6))
def test_random_walk_gives_valid_json(compiler, tok, seed):
    text = walk(compiler, tok, compiler.json_schema(RECORD), seed)
    jsonschema.validate(json.loads(text), RECORD)
    assert "\n" not in text and text.startswith('{"id": ')  # one line, declaration order


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_random_walk_gives_parseable_tool_calls(compiler, tok, parallel, seed):
    text = walk(compiler, tok, compiler.tool_call(TOOLS, parallel=parallel), seed)
    parsed = parse_tool_calls(text, tool_names=TOOLS)
    assert parsed.content == "" and len(parsed.tool_calls) >= 1
    assert parallel or len(parsed.tool_calls) == 1
    for call in parsed.tool_calls:
        schema = TOOLS[call.name] or {"type": "object", "additionalProperties": False}
        jsonschema.validate(json.loads(call.arguments), schema)


def test_named_function_allows_only_that_name(compiler, tok):
    grammar = compiler.tool_call({"search": TOOLS["search"]})
    for seed in range(2):
        (call,) = parse_tool_calls(walk(compiler, tok, grammar, seed)).tool_calls
        assert call.name == "search"


def test_json_object_accepts_an_object_and_nothing_else(compiler, tok):
    grammar = compiler.json_object()
    matcher = grammar.matcher()
    row = compiler.allocate_bitmask(1)[0]
    for token in tok.encode('{"a": [1, {"b": null}]}', add_special_tokens=False):
        matcher.fill_bitmask(row)
        assert allowed(compiler, row)[token]
        assert not matcher.accepts_eos()
        assert matcher.advance(token)
    assert matcher.accepts_eos()
    matcher.fill_bitmask(row)
    assert allowed(compiler, row).nonzero().flatten().tolist() == list(tok.eos_token_ids)
    fresh = grammar.matcher()  # a new matcher starts over: no array, no text, no EOS at first
    fresh.fill_bitmask(row)
    first = allowed(compiler, row)
    for text in ("[", "Sure", " {"):
        assert not first[tok.encode(text, add_special_tokens=False)[0]]
    assert not any(first[e] for e in tok.eos_token_ids)


def test_disallowed_token_puts_the_matcher_in_error(compiler, tok):
    matcher = compiler.json_object().matcher()
    assert not matcher.advance(tok.encode("hello", add_special_tokens=False)[0])
    assert matcher.error and matcher.is_finished()


def test_fill_bitmasks_matches_per_row_fill(compiler, tok):
    grammars = [compiler.json_schema(RECORD), compiler.json_object(), compiler.tool_call(TOOLS)]
    matchers = [g.matcher() for g in grammars]
    for m, text in zip(matchers, ['{"id": 1', '{"x', '{"name": "se']):
        for token in tok.encode(text, add_special_tokens=False):
            assert m.advance(token), m.error
    batch = torch.zeros(4, compiler.bitmask_words, dtype=torch.int32)
    compiler.fill_bitmasks(matchers, batch)
    for i, m in enumerate(matchers):
        row = compiler.allocate_bitmask(1)[0]
        m.fill_bitmask(row)
        assert torch.equal(batch[i], row)
    assert torch.equal(batch[3], torch.zeros(compiler.bitmask_words, dtype=torch.int32))  # untouched


def test_bitmask_buffers_are_checked(compiler):
    matcher = compiler.json_object().matcher()
    words = compiler.bitmask_words
    for bad in (torch.zeros(words, dtype=torch.int64), torch.zeros(words - 1, dtype=torch.int32),
                torch.zeros(2 * words, dtype=torch.int32)[::2]):
        with pytest.raises(ValueError, match="out_row"):
            matcher.fill_bitmask(bad)
    with pytest.raises(ValueError, match="out"):
        compiler.fill_bitmasks([matcher], torch.zeros(0, words, dtype=torch.int32))


@pytest.mark.parametrize(
    "schema,problem",
    [
        ({"type": "foo"}, "foo"),
        ({"type": "string", "pattern": "(a"}, "unclosed group"),
        ({"type": "object", "properties": {"a": {"$ref": "#/defs/x"}}}, "/defs/x"),
        ({"type": "integer", "minimum": 5, "maximum": 3}, "minimum"),
        ({"type": "string", "format": "no-such-format"}, "no-such-format"),
        ([{"type": "object"}], "must be an object"),
        ({"const": float("nan")}, "not JSON"),
    ],
)
def test_bad_schema_is_a_grammar_error_naming_the_problem(compiler, schema, problem):
    with pytest.raises(GrammarError, match=problem) as info:
        compiler.json_schema(schema)
    assert isinstance(info.value, ValueError)  # the server turns it into a 400


def test_bad_tools_are_grammar_errors(compiler):
    with pytest.raises(GrammarError, match="at least one tool"):
        compiler.tool_call({})
    with pytest.raises(GrammarError, match="non-empty string"):
        compiler.tool_call({"": None})
    with pytest.raises(GrammarError, match="'f'"):
        compiler.tool_call({"f": ["not", "a", "schema"]})  # type: ignore[dict-item]
    with pytest.raises(GrammarError, match="foo"):
        compiler.tool_call({"f": {"type": "foo"}})


def test_tool_call_schema_forms():
    single = tool_call_schema({"f": None})
    assert single["required"] == ["name", "arguments"] and single["properties"]["name"] == {"const": "f"}
    assert tool_call_schema({"f": None, "g": None})["anyOf"][1]["properties"]["name"] == {"const": "g"}
    listed = tool_call_schema({"f": None}, parallel=True)
    assert listed["type"] == "array" and listed["minItems"] == 1 and listed["items"] == single


def test_cache_is_bounded_lru_keyed_by_canonical_json(tok):
    compiler = GrammarCompiler(tok, cache_size=3, num_threads=1)
    schemas = [{"type": "object", "properties": {f"k{i}": {"type": "integer"}}} for i in range(5)]
    grammars = [compiler.json_schema(s) for s in schemas]
    assert len(compiler) == 3
    assert compiler.json_schema(json.loads(json.dumps(schemas[4]))) is grammars[4]  # equal dict: a hit
    assert compiler.json_schema(schemas[2]) is grammars[2]  # now the most recent
    assert compiler.json_schema(schemas[0]) is not grammars[0]  # evicted, compiled again
    assert len(compiler) == 3
    assert compiler.json_schema(schemas[2]) is grammars[2]  # survived the eviction
    reordered = {"properties": {"k2": {"type": "integer"}}, "type": "object"}
    assert compiler.json_schema(reordered) is not grammars[2]  # key order is part of the key
    with pytest.raises(ValueError, match="cache_size"):
        GrammarCompiler(tok, cache_size=0)


def test_bound_schema_caps_free_strings_and_closes_listed_objects():
    from mindie.structured.schemas import MAX_FREE_STRING, bound_schema

    schema = {"type": "object", "properties": {
        "a": {"type": "string"}, "b": {"type": "string", "maxLength": 5}, "c": {"type": "string", "enum": ["x"]},
        "d": {"type": "array", "items": {"type": "object", "properties": {"e": {"type": "string"}}}},
        "f": {"type": "object"}}}
    out = bound_schema(schema)
    assert out["properties"]["a"]["maxLength"] == MAX_FREE_STRING
    assert out["properties"]["b"]["maxLength"] == 5 and "maxLength" not in out["properties"]["c"]
    assert out["additionalProperties"] is False
    assert out["properties"]["d"]["items"]["additionalProperties"] is False
    assert out["properties"]["d"]["items"]["properties"]["e"]["maxLength"] == MAX_FREE_STRING
    assert "additionalProperties" not in out["properties"]["f"]  # a free-form object stays free
    assert schema["properties"]["a"] == {"type": "string"}  # the caller's schema is untouched


def test_text_or_tool_call_takes_text_or_a_valid_call(compiler, tok):
    tools = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
    grammar = compiler.text_or_tool_call(tools)

    def follows(text: str) -> bool:
        m = grammar.matcher()
        return all(m.advance(t) for t in tok.encode(text, add_special_tokens=False)) and m.accepts_eos()

    assert follows("It is sunny today.")
    assert follows('{"name": "get_weather", "arguments": {"city": "Paris"}}')
    assert not follows('{"name": "get_weather", "arguments": {"town": "Paris"}}')
    assert not follows('{"name": "other", "arguments": {}}')
    assert compiler.text_or_tool_call(tools) is grammar  # cached


# --- the budget rule keeps what the model chose ------------------------------------------------

VALUES = {  # one value of each kind, placed in every position of an object below
    "n": ({"type": "integer"}, 31),
    "x": ({"type": "number"}, -2.5),
    "s": ({"type": "string"}, "Tom Smith"),
    "b": ({"type": "boolean"}, True),
    "o": ({"type": "object", "properties": {"k": {"type": "integer"}, "v": {"type": "array", "items": {
        "type": "integer"}}}, "required": ["k", "v"]}, {"k": 7, "v": [12, 3]}),
    "a": ({"type": "array", "items": {"type": "number"}}, [1.25, 40, 8]),
}


def rotations() -> list[tuple[dict, dict]]:
    """(schema, document) with the keys of VALUES in each rotation, so every kind of value is
    first, last and in between."""
    keys = list(VALUES)
    out = []
    for r in range(len(keys)):
        order = keys[r:] + keys[:r]
        schema = {"type": "object", "properties": {k: VALUES[k][0] for k in order}, "required": order}
        out.append((schema, {k: VALUES[k][1] for k in order}))
    return out


def follow(grammar: Grammar, ids: list[int], budget: int) -> list[int]:
    """The tokens fit_budget lets through when the model picks `ids` with `budget` tokens left at
    the start."""
    matcher, out = grammar.matcher(), []
    for i, token in enumerate(ids):
        chosen = matcher.fit_budget(token, budget - i)
        assert matcher.advance(chosen), matcher.error
        out.append(chosen)
    return out


@pytest.mark.parametrize("case", range(len(VALUES)))
def test_fit_budget_keeps_every_token_of_a_valid_value(compiler, tok, case):
    schema, doc = rotations()[case]
    ids = tok.encode(json.dumps(doc), add_special_tokens=False)
    grammar = compiler.json_schema(schema)
    assert follow(grammar, ids, budget=len(ids) + 64) == ids


@pytest.mark.parametrize("case", range(len(VALUES)))
def test_tool_call_arguments_keep_every_token(compiler, tok, case):
    schema, doc = rotations()[case]
    ids = tok.encode(json.dumps({"name": "f", "arguments": doc}), add_special_tokens=False)
    for grammar in (compiler.tool_call({"f": schema, "g": None}), compiler.text_or_tool_call({"f": schema})):
        assert follow(grammar, ids, budget=len(ids) + 64) == ids


@pytest.mark.parametrize("text,closing", [('{"n": 3', ","), ('{"n": 31, "x": -2', ","),
                                          ('{"n": 31, "x": -2.5, "s": "To', '"'), ('{"a": [1.25, 4', "]")])
def test_shortest_completion_closes_a_number_or_string_where_it_stands(compiler, tok, text, closing):
    schema = rotations()[0][0] if text.startswith('{"n"') else rotations()[5][0]
    matcher = compiler.json_schema(schema).matcher()
    for token in tok.encode(text, add_special_tokens=False):
        assert matcher.advance(token)
    needed = matcher.min_tokens(limit=200)
    assert needed is not None and needed < 80
    path = forced_path(matcher, needed, tok.encode("\n", add_special_tokens=False)[0])
    assert tok.decode(path).startswith(closing)
    json.loads(text + tok.decode(path))


def forced_path(matcher, budget: int, unwanted: int) -> list[int]:
    """The completion fit_budget forces with exactly `budget` tokens left when the model only ever
    wants `unwanted`, a token the grammar never allows."""
    path = []
    for left in range(budget, 0, -1):
        token = matcher.fit_budget(unwanted, left)
        assert matcher.advance(token), matcher.error
        path.append(token)
        if matcher.accepts_eos():
            break
    return path


@pytest.mark.parametrize("seed", range(3))
def test_budget_rule_fires_only_when_the_budget_is_the_completion(compiler, tok, seed):
    """With room to spare the model's tokens all pass; with exactly the shortest completion's
    length left the value still finishes, valid, in that many tokens."""
    grammar = compiler.json_schema(RECORD)
    needed = grammar.matcher().min_tokens()
    assert needed is not None
    gen = torch.Generator().manual_seed(seed)
    mask = compiler.allocate_bitmask(1)
    for budget, expect_free in ((4096, True), (needed, False)):
        matcher, ids, replaced = grammar.matcher(), [], 0
        while not matcher.accepts_eos() or not ids:
            assert len(ids) < budget
            matcher.fill_bitmask(mask[0])
            logits = torch.randn(1, compiler.vocab_size, generator=gen)
            ops.apply_token_bitmask(logits, mask)
            logits[0, list(tok.eos_token_ids)] = -float("inf")
            wanted = int(logits.argmax())
            token = matcher.fit_budget(wanted, budget - len(ids))
            replaced += token != wanted
            assert matcher.advance(token), matcher.error
            ids.append(token)
            if matcher.is_finished():
                break
        jsonschema.validate(json.loads(tok.decode(ids)), RECORD)
        assert (replaced == 0) == expect_free


PERSON_TOOL = {  # what pydantic emits for a model inside a model: the inner one under $defs
    "$defs": {"Person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                          "age": {"type": "integer"}},
                         "required": ["name", "age"], "title": "Person"}},
    "type": "object",
    "properties": {"people": {"type": "array", "items": {"$ref": "#/$defs/Person"}, "maxItems": 2},
                   "enum": {"enum": [{"$ref": "#/not/a/schema"}]}},
    "required": ["people"],
}


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("others", [{}, {"list_files": None}])
def test_tool_parameters_with_defs_resolve_under_arguments(compiler, tok, parallel, others):
    tools = {"add_people": PERSON_TOOL, **others}
    grammar = compiler.tool_call(tools, parallel=parallel)
    call = {"name": "add_people", "arguments": {"people": [{"name": "Ann", "age": 31}, {"name": "Bo", "age": 2}]}}
    text = json.dumps([call] if parallel else call)
    assert follow(grammar, tok.encode(text, add_special_tokens=False), 400) == tok.encode(text,
                                                                                          add_special_tokens=False)
    bad = text.replace('"age": 31', '"age": "31"')  # the $ref is enforced, not skipped
    matcher = grammar.matcher()
    assert not all(matcher.advance(t) for t in tok.encode(bad, add_special_tokens=False))
    for seed in range(2):
        for parsed in parse_tool_calls(walk(compiler, tok, grammar, seed), tool_names=tools).tool_calls:
            if parsed.name == "add_people":
                jsonschema.validate(json.loads(parsed.arguments), PERSON_TOOL)
    assert compiler.text_or_tool_call(tools) is not None


def test_relocated_refs_keep_literals_and_property_names():
    from mindie.structured.schemas import relocate_refs

    out = relocate_refs(PERSON_TOOL, "/properties/arguments")
    assert out["properties"]["people"]["items"] == {"$ref": "#/properties/arguments/$defs/Person"}
    assert out["properties"]["enum"] == {"enum": [{"$ref": "#/not/a/schema"}]}  # a value, not a reference
    assert relocate_refs({"$ref": "#"}, "/items") == {"$ref": "#/items"}
    assert relocate_refs({"$ref": "https://example.com/s.json"}, "/x") == {"$ref": "https://example.com/s.json"}
    assert PERSON_TOOL["properties"]["people"]["items"] == {"$ref": "#/$defs/Person"}  # the input is untouched


def test_answer_or_tool_call_takes_a_formatted_answer_or_a_valid_call(compiler, tok):
    tools = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
    answer = {"type": "object", "properties": {"summary": {"type": "string"}}, "required": ["summary"]}
    grammar = compiler.text_or_tool_call(tools, answer)

    def follows(text: str) -> bool:
        m = grammar.matcher()
        return all(m.advance(t) for t in tok.encode(text, add_special_tokens=False)) and m.accepts_eos()

    assert follows('{"summary": "Sunny"}')
    assert follows('{"name": "get_weather", "arguments": {"city": "Paris"}}')
    assert not follows("It is sunny today.")
    assert not follows('{"summary": 3}')
    assert not follows('{"name": "get_weather", "arguments": {"town": "Paris"}}')
    for seed in range(3):
        text = walk(compiler, tok, grammar, seed)
        parsed = parse_tool_calls(text, tool_names=tools)
        if parsed.tool_calls:
            jsonschema.validate(json.loads(parsed.tool_calls[0].arguments), tools["get_weather"])
        else:
            jsonschema.validate(json.loads(text), answer)


def test_budget_rule_searches_only_when_it_can_matter(compiler, tok, monkeypatch):
    """A model that follows the known completion needs no search, and once no completion fits
    what is left the rule stops searching (the value is cut as a free one would be)."""
    from mindie.structured import matcher as matcher_module

    calls = []
    search = matcher_module._shortest_path
    monkeypatch.setattr(matcher_module, "_shortest_path", lambda *a: calls.append(1) or search(*a))
    never = tok.encode("\n", add_special_tokens=False)[0]  # never allowed inside this JSON
    matcher = compiler.json_schema(RECORD).matcher()
    needed = matcher.min_tokens()
    calls.clear()
    forced = []
    for left in range(needed, 0, -1):  # the model keeps wanting a forbidden token: the path is followed
        token = matcher.fit_budget(never, left)
        assert matcher.advance(token)
        forced.append(token)
    assert matcher.accepts_eos() and len(calls) <= 3  # the first step searches, the rest follow the path
    jsonschema.validate(json.loads(tok.decode(forced)), RECORD)

    long = {"type": "array", "items": {"type": "integer"}, "minItems": 50}
    matcher = compiler.json_schema(long).matcher()
    calls.clear()
    ids = tok.encode("[1, 2, 3, 4, 5", add_special_tokens=False)
    for i, token in enumerate(ids):
        assert matcher.fit_budget(token, 20 - i) == token  # no completion fits: the model's token stands
        assert matcher.advance(token)
    assert len(calls) == 2  # one failed search after the first token, one from before it, then none
