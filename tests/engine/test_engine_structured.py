"""Grammar-constrained samples in the engine (tiny random Llama, byte-level tokenizer): the output
follows the schema and ends when the value is complete, and free samples in the same batch get
exactly the tokens they get alone."""

from __future__ import annotations

import json

import jsonschema
import pytest
from test_engine import run, tokens

from mindie.config import EngineConfig
from mindie.engine.engine import LLMEngine
from mindie.engine.request import EngineRequest, FinishReason, SamplingParams
from mindie.structured.grammar import GrammarCompiler

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"},
                                           "tag": {"type": "string", "enum": ["a", "b"]}},
          "required": ["ok", "n", "tag"]}


@pytest.fixture(scope="module")
def grammar(tiny_llama):
    return GrammarCompiler(tiny_llama.tokenizer).json_schema(SCHEMA)


def engine(loaded) -> LLMEngine:
    return LLMEngine(loaded, EngineConfig(num_kv_blocks=64, block_size=8))


def free_request(i: int) -> EngineRequest:
    return EngineRequest(f"free{i}", [5 + i, 9, 17], SamplingParams(max_tokens=20, temperature=1.0, seed=100 + i,
                                                                     ignore_eos=True))


def test_constrained_output_follows_the_schema_and_stops(tiny_llama, grammar):
    reqs = [EngineRequest(f"c{i}", [3, 4, 5 + i], SamplingParams(max_tokens=200, temperature=1.0, seed=i, n=2),
                          grammar=grammar) for i in range(4)]
    outs = run(engine(tiny_llama), reqs)
    for req in reqs:
        per_sample: dict[int, list] = {}
        for o in outs[req.request_id]:
            per_sample.setdefault(o.index, []).append(o)
        for samples in per_sample.values():
            assert samples[-1].finish_reason is FinishReason.EOS
            text = tiny_llama.tokenizer.decode(tokens(samples))
            jsonschema.validate(json.loads(text), SCHEMA)


def test_free_samples_are_unchanged_by_constrained_neighbours(tiny_llama, grammar):
    alone = run(engine(tiny_llama), [free_request(i) for i in range(3)])
    constrained = [EngineRequest(f"c{i}", [7, 8, i], SamplingParams(max_tokens=30, temperature=1.0, seed=i),
                                 grammar=grammar) for i in range(3)]
    mixed = run(engine(tiny_llama), [*constrained, *[free_request(i) for i in range(3)]])
    for i in range(3):
        assert tokens(mixed[f"free{i}"]) == tokens(alone[f"free{i}"])


def test_beam_search_with_a_grammar_is_refused(tiny_llama, grammar):
    with pytest.raises(ValueError, match="use_beam_search"):
        engine(tiny_llama).add_request(EngineRequest("b", [1, 2], SamplingParams(use_beam_search=True, n=2,
                                                                             temperature=0), grammar=grammar))
