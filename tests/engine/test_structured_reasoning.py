"""Guided decoding with a reasoning model (the tiny random Qwen3, its think tags as tokens): the
grammar starts after `</think>`. Tokens before it are the model's own free choice, token for token
what the unconstrained model writes; every token after it is transformers' greedy choice under the
grammar's mask (tests/helpers/guided.py), so the answer parses with exactly those values. A prompt
that closed the block puts the grammar on the first token; a reply that ends or runs out of budget
while reasoning still gets a whole answer."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from helpers.guided import allowed_tokens, end_tag_bias, hf_biased_greedy, hf_guided_greedy
from test_engine import run, tokens

from mindie.config import EngineConfig
from mindie.engine.engine import LLMEngine
from mindie.engine.request import Continuation, EngineRequest, FinishReason, RequestOutput, SamplingParams
from mindie.structured.grammar import Grammar, GrammarCompiler
from mindie.structured.reasoning_gate import GatedMatcher, ReasoningGate
from mindie.structured.reasoning_parser import Phase, ThinkTags, reasoning_tags, split_reasoning

# No free strings: a bias on </think> (whose text a JSON string could hold) cannot leak into the answer.
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["small", "large"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["ok", "size", "n"]}
TURN = "<|im_start|>user\nHow big is it?<|im_end|>\n<|im_start|>assistant\n"
PROMPTS = {Phase.BEFORE: TURN, Phase.INSIDE: TURN + "<think>\n", Phase.AFTER: TURN + "<think>\n\n</think>\n\n"}


@pytest.fixture(scope="module")
def hf(tiny_qwen3_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tags(tiny_qwen3) -> ThinkTags:
    found = reasoning_tags("auto", "qwen3", tiny_qwen3.tokenizer)
    assert found is not None and found.start_id is not None and found.end_id is not None
    return found


@pytest.fixture(scope="module")
def grammar(tiny_qwen3) -> Grammar:
    return GrammarCompiler(tiny_qwen3.tokenizer, num_threads=1).json_schema(SCHEMA)


def encode(loaded, text: str) -> list[int]:
    return loaded.tokenizer.encode(text, add_special_tokens=False)


def gated(grammar: Grammar, tags: ThinkTags, phase: Phase) -> Grammar:
    gate = ReasoningGate.for_prompt(tags, PROMPTS[phase])
    assert gate.phase is phase
    return grammar.after_reasoning(gate)


def request(rid: str, prompt: list[int], grammar: Grammar | None, bias: dict[int, float],
            max_tokens: int = 64, continuation: Continuation | None = None) -> EngineRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, logit_bias=tuple(bias.items()))
    return EngineRequest(rid, prompt, params, grammar=grammar, continuation=continuation)


def generate(loaded, *reqs: EngineRequest) -> dict[str, list[RequestOutput]]:
    return run(LLMEngine(loaded, EngineConfig(num_kv_blocks=64, block_size=4, max_seq_len=256)), list(reqs))


def eos_ids(loaded) -> set[int]:
    return set(loaded.config.eos_token_ids) | set(loaded.tokenizer.eos_token_ids)


def answer_value(loaded, answer: list[int]) -> object:
    """The JSON value of a reference answer (its EOS, if any, dropped), checked against the schema."""
    value = json.loads(loaded.tokenizer.decode([t for t in answer if t not in eos_ids(loaded)]))
    jsonschema.validate(value, SCHEMA)
    return value


def test_reasoning_is_free_and_the_answer_follows_the_grammar(tiny_qwen3, hf, tags, grammar):
    prompt = encode(tiny_qwen3, PROMPTS[Phase.INSIDE])
    bias, at = end_tag_bias(hf, prompt, tags.end_id)
    biases = {tags.end_id: bias}
    # A free request and a constrained one share every batch: the free one is the reference for
    # the reasoning, and the masks of one row never touch the other.
    outs = generate(tiny_qwen3, request("free", prompt, None, biases, max_tokens=at + 1),
                    request("guided", prompt, gated(grammar, tags, Phase.INSIDE), biases))
    free, got = tokens(outs["free"]), tokens(outs["guided"])
    assert free == hf_biased_greedy(hf, prompt, biases, at + 1) and free[-1] == tags.end_id
    # The grammar would not have let the reasoning's first token through: it really was unmasked.
    assert not allowed_tokens(grammar.matcher(), hf.config.vocab_size)[free[0]]
    assert got[: at + 1] == free
    answer = hf_guided_greedy(hf, prompt + free, grammar.matcher(), eos_ids(tiny_qwen3), biases)
    assert got[at + 1:] == answer and outs["guided"][-1].finish_reason is FinishReason.EOS
    reasoning, content = split_reasoning(tags, tiny_qwen3.tokenizer.decode(got), Phase.INSIDE, opens_late=False)
    assert reasoning == tiny_qwen3.tokenizer.decode(free[:-1])
    assert json.loads(content) == answer_value(tiny_qwen3, answer)


@pytest.mark.parametrize("with_gate", [True, False])
def test_a_block_closed_by_the_prompt_puts_the_grammar_on_the_first_token(tiny_qwen3, hf, tags, grammar, with_gate):
    prompt = encode(tiny_qwen3, PROMPTS[Phase.AFTER])
    constrained = gated(grammar, tags, Phase.AFTER) if with_gate else grammar
    got = tokens(generate(tiny_qwen3, request("r", prompt, constrained, {}))["r"])
    answer = hf_guided_greedy(hf, prompt, grammar.matcher(), eos_ids(tiny_qwen3))
    assert got == answer
    text = tiny_qwen3.tokenizer.decode(got)
    assert split_reasoning(tags, text, Phase.AFTER, opens_late=False) == (None, text)
    answer_value(tiny_qwen3, answer)


def test_before_any_block_the_model_may_open_one(tiny_qwen3, hf, tags, grammar):
    """Qwen3's default: the prompt leaves the reply before any block and the model writes <think>
    itself (the first mask allows the grammar's tokens and <think>): it then reasons freely."""
    prompt = encode(tiny_qwen3, PROMPTS[Phase.BEFORE])
    first = hf_guided_greedy(hf, prompt, grammar.matcher(), eos_ids(tiny_qwen3), also_first=[tags.start_id])
    assert first == [tags.start_id]  # this model opens a block at once (the next test bans it)
    bias, at = end_tag_bias(hf, prompt + first, tags.end_id)
    biases = {tags.end_id: bias}  # the grammar's first mask leaves </think> out, whatever its bias
    got = tokens(generate(tiny_qwen3, request("r", prompt, gated(grammar, tags, Phase.BEFORE), biases))["r"])
    reasoning = hf_biased_greedy(hf, prompt + first, biases, at + 1)
    assert got[: at + 2] == first + reasoning and reasoning[-1] == tags.end_id
    answer = hf_guided_greedy(hf, prompt + first + reasoning, grammar.matcher(), eos_ids(tiny_qwen3), biases)
    assert got[at + 2:] == answer
    text = tiny_qwen3.tokenizer.decode(got)
    assert split_reasoning(tags, text, Phase.BEFORE, opens_late=False) == (
        tiny_qwen3.tokenizer.decode(reasoning[:-1]), json.dumps(answer_value(tiny_qwen3, answer)))


def test_before_any_block_an_answer_at_once_follows_the_grammar(tiny_qwen3, hf, tags, grammar):
    prompt = encode(tiny_qwen3, PROMPTS[Phase.BEFORE])
    biases = {tags.start_id: -100.0}
    got = tokens(generate(tiny_qwen3, request("r", prompt, gated(grammar, tags, Phase.BEFORE), biases))["r"])
    answer = hf_guided_greedy(hf, prompt, grammar.matcher(), eos_ids(tiny_qwen3), biases, also_first=[tags.start_id])
    assert got == answer
    answer_value(tiny_qwen3, answer)
    # the first mask is the grammar's and <think>; the block then lifts the mask
    matcher = gated(grammar, tags, Phase.BEFORE).matcher()
    assert isinstance(matcher, GatedMatcher)
    first = allowed_tokens(matcher, hf.config.vocab_size)
    plain = allowed_tokens(grammar.matcher(), hf.config.vocab_size)
    assert first[tags.start_id] and not plain[tags.start_id]
    first[tags.start_id] = False
    assert torch.equal(first, plain)
    assert matcher.advance(tags.start_id) and not matcher.constrains_next


def test_reasoning_that_would_overrun_max_tokens_is_closed_for_the_answer(tiny_qwen3, hf, tags, grammar):
    """A reply that opens a block and would reason forever (a bias on <think> keeps choosing it) is
    given </think> once what is left of max_tokens is just enough for the shortest answer."""
    prompt = encode(tiny_qwen3, PROMPTS[Phase.BEFORE])
    needed = grammar.matcher().min_tokens()
    assert needed is not None
    biases = {tags.start_id: 100.0}
    max_tokens = needed + 12
    outs = generate(tiny_qwen3, request("r", prompt, gated(grammar, tags, Phase.BEFORE), biases, max_tokens))["r"]
    got = tokens(outs)
    closed = got.index(tags.end_id)
    assert closed == max_tokens - needed - 1 and len(got) == max_tokens
    assert got[:closed] == hf_biased_greedy(hf, prompt, biases, closed) == [tags.start_id] * closed
    text = tiny_qwen3.tokenizer.decode(got)
    reasoning, content = split_reasoning(tags, text, Phase.BEFORE, opens_late=False)
    assert reasoning == "<think>" * (closed - 1)
    jsonschema.validate(json.loads(content), SCHEMA)


def test_an_end_of_sample_while_reasoning_closes_the_block_instead(tiny_qwen3, hf, tags, grammar):
    prompt = encode(tiny_qwen3, PROMPTS[Phase.INSIDE])
    eos = next(iter(tiny_qwen3.tokenizer.eos_token_ids))
    biases = {eos: 100.0}  # the model would end at once
    got = tokens(generate(tiny_qwen3, request("r", prompt, gated(grammar, tags, Phase.INSIDE), biases))["r"])
    assert got[0] == tags.end_id
    answer = hf_guided_greedy(hf, prompt + got[:1], grammar.matcher(), eos_ids(tiny_qwen3), biases)
    assert got[1:] == answer
    answer_value(tiny_qwen3, answer)


def test_a_continued_request_replays_its_gate(tiny_qwen3, hf, tags, grammar):
    """PD: a request continued after outputs made elsewhere (inside the block, at its end, inside
    the answer) goes on exactly as the uninterrupted one."""
    prompt = encode(tiny_qwen3, PROMPTS[Phase.INSIDE])
    bias, at = end_tag_bias(hf, prompt, tags.end_id)
    biases = {tags.end_id: bias}
    constrained = gated(grammar, tags, Phase.INSIDE)
    whole = tokens(generate(tiny_qwen3, request("r", prompt, constrained, biases))["r"])
    for done in (at - 1, at + 1, at + 4):
        cont = Continuation(whole[:done], 0, 0.0)
        rest = tokens(generate(tiny_qwen3, request("c", prompt, constrained, biases, continuation=cont))["c"])
        assert whole[:done] + rest == whole


def test_the_shortest_reply_counts_the_end_tag_while_reasoning(tags, grammar):
    inner = grammar.matcher().min_tokens()
    assert inner is not None
    assert gated(grammar, tags, Phase.INSIDE).matcher().min_tokens() == inner + 1
    assert gated(grammar, tags, Phase.BEFORE).matcher().min_tokens() == inner
    assert gated(grammar, tags, Phase.AFTER).matcher().min_tokens() == inner
