"""Runs prompts with media through one engine and compares the results with transformers'."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from mindie.config import EngineConfig
from mindie.engine.engine import LLMEngine
from mindie.engine.request import EngineRequest, MediaInputs, SamplingParams
from mindie.model.loader import LoadedModel

NEW = 8
# Two bfloat16 computations of the same logits may order a top-2 pair this close either way (the tiny
# models' logits, |x| < 16, are 1/32 to 1/16 apart in bfloat16; transformers' own can tie exactly).
NEAR_TIE = 0.1


class Greedy(NamedTuple):
    """transformers' greedy generate: the tokens, each one's log-probability, and each step's top-1
    minus top-2 logit (how near a tie the choice was)."""

    tokens: list[int]
    logprobs: list[float]
    margins: list[float]


def run(loaded: LoadedModel, prompts: list[tuple[list[int], MediaInputs | None]], **config) -> list:
    """All prompts in one engine, admitted together: (tokens, log-probabilities, cached tokens) each."""
    engine = LLMEngine(loaded, EngineConfig(**{"block_size": 4, "num_kv_blocks": 256, **config}))
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, logprobs=0)
    for i, (ids, media) in enumerate(prompts):
        engine.add_request(EngineRequest(f"r{i}", ids, params, media=media))
    got: dict[str, list] = {f"r{i}": [[], [], 0] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id][0] += out.new_token_ids
            got[out.request_id][1] += [lp.logprob for lp in out.new_logprobs]
            got[out.request_id][2] = out.num_cached_prompt_tokens
    engine.scheduler.blocks.check_invariants()
    run.preemptions = engine.scheduler.num_preemptions  # type: ignore[attr-defined]
    return [got[f"r{i}"] for i in range(len(prompts))]


def run_one_after_another(loaded: LoadedModel, prompts: list[tuple[list[int], MediaInputs | None]]) -> list:
    """Each prompt in turn through one engine, so that a later one can find an earlier one's blocks in
    the prefix cache: (tokens, cached prompt tokens) each."""
    engine = LLMEngine(loaded, EngineConfig(block_size=4, num_kv_blocks=256))
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    results = []
    for i, (ids, media) in enumerate(prompts):
        engine.add_request(EngineRequest(f"r{i}", ids, params, media=media))
        tokens: list[int] = []
        cached = 0
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.new_token_ids
                cached = out.num_cached_prompt_tokens
        results.append((tokens, cached))
    return results


def assert_same(ours: list, want: Greedy) -> None:
    assert ours[0] == want.tokens
    assert max(abs(a - b) for a, b in zip(ours[1], want.logprobs)) < 1e-3


def assert_same_until_a_near_tie(ours: list, want: Greedy) -> None:
    """Our (tokens, log-probabilities) against transformers' in the same dtype (bfloat16): the same
    tokens up to the first step where transformers' top-2 logits are within NEAR_TIE (rounding may
    pick either there, and later tokens follow another prefix), log-probabilities within 0.1 (a few
    bfloat16 steps of the logits) before it."""
    assert len(ours[0]) == len(want.tokens)
    same = next((i for i, (a, b) in enumerate(zip(ours[0], want.tokens)) if a != b), len(want.tokens))
    if same < len(want.tokens):
        assert want.margins[same] < NEAR_TIE, (same, ours[0], want.tokens, want.margins)
    assert max((abs(a - b) for a, b in zip(ours[1][:same], want.logprobs[:same])), default=0.0) < 0.1


def assert_quantized_step_reads_images(loaded: LoadedModel, quant: LoadedModel, prompt: Any, image: Any,
                                       other: Any) -> None:
    """`quant` (q8_0 weights in the C++ step, media rows passed in with the batch) against the exact
    `loaded`: the same tokens until 8-bit weights flip a near tie (not before the third) with
    log-probabilities within 0.1 up to there, the image read, and a row's bits its own whether its
    image is prefilled in chunks beside other requests or alone. `prompt(model, images[, text])`."""
    text = prompt(quant, [], "Tell me a story.")
    got = run(quant, [prompt(quant, [image]), text, prompt(quant, [other])], max_prefill_tokens=16)
    want = run(loaded, [prompt(loaded, [image]), text, prompt(loaded, [other])], max_prefill_tokens=16)
    for g, w in zip(got, want, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(g[0], w[0])) if x != y), NEW)
        assert same >= 3
        assert max(abs(x - y) for x, y in zip(g[1][:same], w[1][:same])) < 0.1
    assert got[0][1] != got[2][1]  # the image is read
    assert run(quant, [prompt(quant, [image])])[0][:2] == got[0][:2]  # bit for bit
    assert run(quant, [text])[0][:2] == got[1][:2]


def hf_generate_greedy(model: Any, ids: torch.Tensor, new_tokens: int, **inputs: Any) -> Greedy:
    """transformers' greedy generate of `new_tokens` after the prompt `ids` [1, n] with the model's
    media `inputs` (float32 pixels or features: the model casts them to its dtype)."""
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                             min_new_tokens=new_tokens, output_logits=True, return_dict_in_generate=True, **inputs)
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    logits = [step[0].float() for step in out.logits]
    top2 = [step.topk(2).values for step in logits]
    return Greedy(tokens, [float(torch.log_softmax(step, -1)[t]) for step, t in zip(logits, tokens)],
                  [float(v[0] - v[1]) for v in top2])
