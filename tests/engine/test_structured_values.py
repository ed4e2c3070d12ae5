"""Constrained output keeps what the model chose (the embedded SmolLM2): greedy decoding under a
JSON schema or a required tool call gives the same tokens as greedy free decoding for as long as
the free output stays inside the grammar, whole outputs included. Few-shot prompts make the free
answer a one-line JSON document, with numbers, strings, booleans, objects and arrays in every
position; the comparison itself holds whatever the model writes."""

from __future__ import annotations

import json

import jsonschema
import pytest
from test_engine import run, tokens

from mindie.config import EngineConfig
from mindie.engine.engine import LLMEngine
from mindie.engine.request import EngineRequest, SamplingParams
from mindie.structured.grammar import Grammar, GrammarCompiler

FIELDS = {  # name -> (schema, the two few-shot values)
    "name": ({"type": "string"}, ("Anna", "Bob")),
    "age": ({"type": "integer"}, (25, 14)),
    "height": ({"type": "number"}, (1.62, 1.8)),
    "adult": ({"type": "boolean"}, (True, False)),
    "pets": ({"type": "object", "properties": {"cats": {"type": "integer"}, "dogs": {"type": "integer"}},
              "required": ["cats", "dogs"]}, ({"cats": 3, "dogs": 1}, {"cats": 0, "dogs": 2})),
    "scores": ({"type": "array", "items": {"type": "integer"}}, ([7, 9], [4])),
}
FACTS = ["Anna is 25 years old and 1.62 m tall. She has 3 cats and 1 dog. Her scores: 7 and 9.",
         "Bob is 14 years old and 1.8 m tall. He has 0 cats and 2 dogs. His score: 4."]
QUESTIONS = ["Tom is 31 years old and 1.75 m tall. He has 2 cats and 4 dogs. His scores: 6 and 8.",
             "Mia is 7 years old and 1.2 m tall. She has 5 cats and 0 dogs. Her score: 10."]
MAX_NEW = 64


def rotated(r: int) -> list[str]:
    keys = list(FIELDS)
    return keys[r:] + keys[:r]


def schema_of(order: list[str]) -> dict:
    return {"type": "object", "properties": {k: FIELDS[k][0] for k in order}, "required": order}


def shot(order: list[str], i: int) -> dict:
    return {k: FIELDS[k][1][i] for k in order}


@pytest.fixture(scope="module")
def compiler(smollm) -> GrammarCompiler:
    return GrammarCompiler(smollm.tokenizer, num_threads=1)


def prompt(smollm, messages: list[dict]) -> list[int]:
    return smollm.tokenizer.encode(smollm.tokenizer.apply_chat_template(messages), add_special_tokens=False)


def greedy(smollm, prompts: list[list[int]], grammar: Grammar | None) -> list[list[int]]:
    """Each prompt's greedy answer, free or under `grammar`, the stop at EOS included."""
    engine = LLMEngine(smollm, EngineConfig(num_kv_blocks=128, max_seq_len=1024))
    reqs = [EngineRequest(f"r{i}", ids, SamplingParams(max_tokens=MAX_NEW, temperature=0), grammar=grammar)
            for i, ids in enumerate(prompts)]
    outs = run(engine, reqs)
    return [tokens(outs[r.request_id]) for r in reqs]


def inside(grammar: Grammar, ids: list[int], eos: set[int]) -> tuple[int, bool]:
    """How many leading tokens of `ids` the grammar accepts, and whether they are a whole value
    (then the constrained answer ends there too)."""
    matcher = grammar.matcher()
    for k, token in enumerate(ids):
        if token in eos:
            return k, matcher.accepts_eos()
        if not matcher.advance(token):
            return k, False
    return len(ids), False


def check_same_choices(smollm, grammar: Grammar, free: list[list[int]], constrained: list[list[int]]) -> int:
    """The constrained answers equal the free ones as far as those stay inside the grammar; the
    number of whole free answers (compared in full)."""
    eos, whole = set(smollm.tokenizer.eos_token_ids), 0
    for f, c in zip(free, constrained):
        k, complete = inside(grammar, f, eos)
        assert c[:k] == f[:k], (smollm.tokenizer.decode(f), smollm.tokenizer.decode(c))
        if complete:
            whole += 1
            assert c[:k] == f[:k] and (len(c) == k or c[k] in eos), smollm.tokenizer.decode(c)
    return whole


@pytest.mark.parametrize("r", range(len(FIELDS)))
def test_json_schema_keeps_the_models_values_in_every_position(smollm, compiler, r):
    order = rotated(r)
    messages = [{"role": "system", "content": "Extract the facts as one line of JSON."}]
    for i, fact in enumerate(FACTS):
        messages += [{"role": "user", "content": fact}, {"role": "assistant", "content": json.dumps(shot(order, i))}]
    prompts = [prompt(smollm, messages + [{"role": "user", "content": q}]) for q in QUESTIONS]
    grammar = compiler.json_schema(schema_of(order))
    free, constrained = greedy(smollm, prompts, None), greedy(smollm, prompts, grammar)
    check_same_choices(smollm, grammar, free, constrained)
    for c in constrained:
        jsonschema.validate(json.loads(smollm.tokenizer.decode(c)), schema_of(order))


@pytest.mark.parametrize("r", [0, 3])
def test_required_tool_call_keeps_the_models_arguments(smollm, compiler, r):
    """The free answer is a call written in the same form the grammar asks for (as the few-shot
    turns show it), so a required call must carry the same argument values."""
    order = rotated(r)
    messages = [{"role": "system", "content": "Call save_person with the facts, as one line of JSON."}]
    for i, fact in enumerate(FACTS):
        call = {"name": "save_person", "arguments": shot(order, i)}
        messages += [{"role": "user", "content": fact}, {"role": "assistant", "content": json.dumps(call)}]
    prompts = [prompt(smollm, messages + [{"role": "user", "content": q}]) for q in QUESTIONS]
    grammar = compiler.tool_call({"save_person": schema_of(order), "other": None})
    free, constrained = greedy(smollm, prompts, None), greedy(smollm, prompts, grammar)
    check_same_choices(smollm, grammar, free, constrained)
