"""Offline engine throughput on the embedded SmolLM2-135M-Instruct (bf16).

    python benchmarks/engine_throughput.py [--skip-concurrent]

Prints prefill tokens/s for one 512-token prompt, decode tokens/s at batch 1, and output tokens/s
for 32 concurrent requests of ~256 prompt and 128 output tokens (ignore_eos), with the machine's
memory bandwidth measured beside them.
"""

from __future__ import annotations

import argparse
import time

import torch
from common import memory_read_bandwidth

from mindie import LLM, SamplingParams, _C


def random_prompt(n: int, seed: int, vocab: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"prompt_token_ids": torch.randint(100, vocab, (n,), generator=gen).tolist()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-concurrent", action="store_true")
    args = ap.parse_args()
    print(f"kernel variant {_C.get_isa()}, kernel threads {_C.get_num_threads()}, torch threads {torch.get_num_threads()}")
    print(f"memory read bandwidth: {memory_read_bandwidth() / 1e9:.1f} GB/s")
    t0 = time.perf_counter()
    llm = LLM(dtype="bfloat16", enablePrefixCache=False)
    print(f"model load: {time.perf_counter() - t0:.1f} s")
    vocab = llm.engine.loaded.config.vocab_size
    llm.generate(random_prompt(64, 0, vocab), SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)

    prompt = random_prompt(512, 1, vocab)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
        best = min(best, time.perf_counter() - t0)
    print(f"prefill, 512-token prompt: {512 / best:8.1f} tokens/s ({best * 1e3:.0f} ms)")

    t0 = time.perf_counter()
    out = llm.generate(random_prompt(16, 2, vocab), SamplingParams(max_tokens=129, temperature=0, ignore_eos=True),
                       use_tqdm=False)
    t = time.perf_counter() - t0
    n = len(out[0].outputs[0].token_ids)
    print(f"decode, batch 1:           {(n - 1) / t:8.1f} tokens/s ({n} tokens in {t:.2f} s, incl. prefill)")

    if not args.skip_concurrent:
        prompts = [random_prompt(256, 10 + i, vocab) for i in range(32)]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=128, temperature=0.8, seed=0, ignore_eos=True),
                            use_tqdm=False)
        t = time.perf_counter() - t0
        total = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"32 concurrent (256 in / 128 out): {total / t:8.1f} output tokens/s ({total} tokens in {t:.1f} s)")


if __name__ == "__main__":
    main()
