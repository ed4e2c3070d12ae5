"""A model whose every layer slides (the tiny Phi-3, window 24) gives a sequence's KV blocks back
once no later query reads them: the count of used blocks is exactly what the window holds, the
tokens are those of the engine that keeps every block and of transformers, and a released block
filled with NaN changes nothing (so no kernel reads it). Prefix caching, n > 1 samples, preemption,
beam search and the C++ step of a GGUF keep their outputs; every block comes back at the end. A
model with a global layer (Gemma 3) keeps them all: one block table serves every layer. A sequence
longer than the whole cache runs on the tiny Mistral (window 10), as transformers runs it."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from helpers.tiny_models import hf_greedy
from test_engine import run, tokens

from mindie.config import EngineConfig
from mindie.engine.engine import LLMEngine
from mindie.engine.request import EngineRequest, RequestOutput, SamplingParams
from mindie.engine.scheduler import window_blocks
from mindie.model.loader import LoadedModel, load_model

BS = 4
PROMPT = [(7 * i + 3) % 250 for i in range(28)]  # past the window (24), short of Phi-3's 32 (short factors)
NEW = 40


@pytest.fixture(scope="module")
def hf(tiny_phi3_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_phi3_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def phi3_cpp_step(tiny_phi3_gguf) -> LoadedModel:
    """The tiny Phi-3 GGUF in its own formats: the C++ step runs it."""
    return load_model(str(tiny_phi3_gguf), dtype=torch.float32)


def make_engine(loaded: LoadedModel, release: bool, **keys) -> LLMEngine:
    engine = LLMEngine(loaded, EngineConfig(**{"num_kv_blocks": 96, "block_size": BS, "max_seq_len": 256, **keys}))
    if not release:  # the engine before blocks were released: every block kept to the end
        engine.scheduler.config = dataclasses.replace(engine.scheduler.config, window=0)
    return engine


def poison_free_blocks(engine: LLMEngine) -> None:
    """NaN into the KV of every block no sequence holds, released ones included: any read of one
    would turn its query's output into NaN. Only with prefix caching off (a cached block holds KV
    another sequence may take up)."""
    assert not engine.blocks.enable_prefix_caching
    free = [b for b in range(engine.blocks.num_blocks) if engine.blocks.ref_count(b) == 0]
    for k_cache, v_cache in engine.runner.kv_caches:
        k_cache[free] = float("nan")
        v_cache[free] = float("nan")


def greedy(max_tokens: int = NEW) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=0)


def test_the_model_configs_say_which_windows_release(tiny_phi3, tiny_gemma3, tiny_llama, tiny_mistral):
    assert tiny_phi3.config.kv_window == 24 and all(tiny_phi3.config.sliding_layers)
    assert tiny_mistral.config.kv_window == 10 and make_engine(tiny_mistral, True).scheduler.config.window == 10
    assert tiny_gemma3.config.sliding_window == 11 and tiny_gemma3.config.kv_window == 0  # a global layer
    assert tiny_llama.config.kv_window == 0
    assert make_engine(tiny_phi3, True).scheduler.config.window == 24
    assert make_engine(tiny_gemma3, True).scheduler.config.window == 0


@pytest.mark.parametrize("model", ["tiny_phi3", "phi3_cpp_step"])
def test_one_sequence_holds_only_its_window(model, request, hf):
    loaded = request.getfixturevalue(model)
    window = loaded.config.kv_window
    engine = make_engine(loaded, True, enable_prefix_caching=False)
    engine.add_request(EngineRequest("r", PROMPT, greedy()))
    outs: list[RequestOutput] = []
    used = []
    while engine.has_unfinished():
        outs += engine.step()
        engine.blocks.check_invariants()
        if engine.requests:
            computed = engine.requests["r"][0].num_computed_tokens
            # allocated for every computed position, less the blocks wholly before the next query's window
            assert engine.blocks.num_used_blocks() == math.ceil(computed / BS) - max(0, computed - window + 1) // BS
            used.append(engine.blocks.num_used_blocks())
        poison_free_blocks(engine)
    assert engine.blocks.num_used_blocks() == 0
    assert max(used) <= math.ceil(window / BS) + 1 < math.ceil((len(PROMPT) + NEW) / BS)
    assert any(b < a for a, b in zip(used, used[1:]))  # a step that frees a block and takes none
    kept = run(make_engine(loaded, False, enable_prefix_caching=False), [EngineRequest("r", PROMPT, greedy())])["r"]
    assert tokens(outs) == tokens(kept)
    assert [lp.logprob for o in outs for lp in o.new_logprobs] == [lp.logprob for o in kept for lp in o.new_logprobs]
    if model == "tiny_phi3":  # the exact path is transformers' greedy (the C++ step is compared with the above)
        assert tokens(outs) == hf_greedy(hf, PROMPT, NEW)[0]


def requests(n_prompts: int) -> list[EngineRequest]:
    """Prompts sharing a 12-token head (prefix-cache hits), n = 2 samples each, seeded sampling."""
    head = PROMPT[:12]
    return [EngineRequest(f"r{i}", head + [(31 * i + k) % 250 for k in range(6 + 5 * i)],
                          SamplingParams(max_tokens=NEW, temperature=0.8, top_k=20, seed=i, n=2, ignore_eos=True))
            for i in range(n_prompts)]


def by_sample(outs: dict[str, list[RequestOutput]]) -> dict[tuple[str, int], list[int]]:
    samples: dict[tuple[str, int], list[int]] = {}
    for rid, seq in outs.items():
        for o in seq:
            samples.setdefault((rid, o.index), []).extend(o.new_token_ids)
    return samples


@pytest.mark.parametrize("keys", [
    dict(),  # prefix caching on: siblings and later prompts share blocks the window releases
    dict(num_kv_blocks=24, max_prefill_tokens=16),  # chunked prefill, and too few blocks: preemption
], ids=["prefix-cache", "preemption"])
def test_shared_and_preempted_sequences_keep_their_outputs(tiny_phi3, keys):
    released = make_engine(tiny_phi3, True, **keys)
    got = run(released, requests(4))
    want = run(make_engine(tiny_phi3, False, **keys), requests(4))
    assert by_sample(got) == by_sample(want)
    if "num_kv_blocks" in keys:
        assert released.scheduler.num_preemptions > 0
    else:
        assert released.blocks.prefix_hit_tokens > 0


def test_beam_search_keeps_its_hypotheses(tiny_phi3):
    params = SamplingParams(max_tokens=30, n=2, best_of=3, use_beam_search=True, ignore_eos=True)
    got = run(make_engine(tiny_phi3, True), [EngineRequest("b", PROMPT, params)])["b"]
    want = run(make_engine(tiny_phi3, False), [EngineRequest("b", PROMPT, params)])["b"]
    assert [(o.new_token_ids, o.beam_score) for o in got] == [(o.new_token_ids, o.beam_score) for o in want]


# The tiny Mistral (window 10) on 8 blocks of 4 (32 tokens) in 8-token steps: a sequence holds at most
# window_blocks(10, 4, 8) = 5 blocks however long it grows.
SMALL_POOL = dict(num_kv_blocks=8, block_size=BS, max_prefill_tokens=8)
LONG = [(11 * i + 5) % 250 for i in range(40)]


@pytest.fixture(scope="module")
def hf_mistral(tiny_mistral_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_mistral_dir, dtype=torch.float32).eval()


def test_a_sequence_longer_than_the_cache_runs_within_its_window(tiny_mistral, hf_mistral):
    """maxSeqLen is the model's 512, not the cache's 32 tokens (which refused this 40-token prompt
    before): the sequence never holds more than its window's blocks, and its tokens and
    log-probabilities are transformers'. A pool too small for the window, or a request handed off
    (it keeps every block), is bounded by the cache as before."""
    config = EngineConfig(**SMALL_POOL, enable_prefix_caching=False)
    assert config.limits(512, 8 * BS).max_input_len == 31 < len(LONG)  # the cache-bound limit
    engine = LLMEngine(tiny_mistral, config)
    assert window_blocks(10, BS, 8) == 5 and engine.limits.max_seq_len == 512
    engine.add_request(EngineRequest("r", LONG, greedy(30)))
    outs: list[RequestOutput] = []
    while engine.has_unfinished():
        outs += engine.step()
        assert engine.blocks.num_used_blocks() <= 5
        poison_free_blocks(engine)
    want, want_lp = hf_greedy(hf_mistral, LONG, 30)
    assert tokens(outs) == want
    assert max(abs(lp.logprob - w) for lp, w in zip((lp for o in outs for lp in o.new_logprobs), want_lp)) < 1e-3
    with pytest.raises(ValueError, match="leaving no room for output"):
        engine.add_request(EngineRequest("h", LONG, greedy(30), handoff=True))
    small = LLMEngine(tiny_mistral, dataclasses.replace(config, num_kv_blocks=4))
    assert small.limits.max_seq_len == 16
    with pytest.raises(ValueError, match="maxInputTokenLen"):
        small.add_request(EngineRequest("r", LONG, greedy(30)))


def test_a_cached_prefix_longer_than_the_window_takes_only_the_window(tiny_mistral, hf_mistral):
    """A 28-token prompt leaves 7 cached blocks; a prompt that starts with it reuses all 28 tokens
    but takes only the blocks its window reads (all 7 revived plus this step's 2 would need 9 of
    the 8): it runs, and its tokens are transformers'."""
    engine = LLMEngine(tiny_mistral, EngineConfig(**SMALL_POOL))
    run(engine, [EngineRequest("a", LONG[:28], greedy(1))])
    assert engine.blocks.num_cached_blocks() == 7
    got = run(engine, [EngineRequest("b", LONG, greedy(30))])["b"]
    assert engine.blocks.prefix_hit_tokens == 28
    assert tokens(got) == hf_greedy(hf_mistral, LONG, 30)[0]
