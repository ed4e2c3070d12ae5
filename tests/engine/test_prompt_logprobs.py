"""Prompt log-probabilities (echo + logprobs scoring) against transformers on the tiny model, under
chunked prefill and with the prompt already in the prefix cache."""

from __future__ import annotations

import pytest
import torch
from test_engine import run

from mindie.config import EngineConfig
from mindie.engine.engine import LLMEngine
from mindie.engine.request import EngineRequest, SamplingParams


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("prefill_tokens", [7, 4096])
def test_prompt_logprobs_match_transformers(tiny_llama, hf, prefill_tokens):
    prompt = torch.randint(0, 256, (29,), generator=torch.Generator().manual_seed(1)).tolist()
    engine = LLMEngine(tiny_llama, EngineConfig(num_kv_blocks=64, block_size=8, max_prefill_tokens=prefill_tokens))
    run(engine, [EngineRequest("warm", prompt, SamplingParams(max_tokens=2, temperature=0))])  # fills the cache
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3, n=2, best_of=2)
    outs = run(engine, [EngineRequest("r", prompt, params)])["r"]
    [first] = [o for o in outs if o.prompt_logprobs is not None]
    lps = first.prompt_logprobs
    assert first.index == 0 and len(lps) == len(prompt) and lps[0] is None
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    for p in range(1, len(prompt)):
        assert lps[p].token_id == prompt[p]
        assert lps[p].logprob == pytest.approx(ref[p - 1, prompt[p]].item(), abs=1e-4)
        top_ids = [t for t, _ in lps[p].top]
        assert top_ids == ref[p - 1].topk(3).indices.tolist()
