"""Offline engine throughput on the embedded SmolLM2-135M-Instruct (default settings: dtype auto, the GGUF's own
weight formats).

    python benchmarks/engine_throughput.py [--skip-concurrent] [--choices]

Prints prefill tokens/s for one 512-token prompt, decode tokens/s at batch 1, and output tokens/s
for 32 concurrent requests of ~256 prompt and 128 output tokens (ignore_eos), with the machine's
memory bandwidth measured beside them. --choices instead measures prefill and batch-1 decode for the
defaults beside every other dtype / quantization choice this CPU runs, interleaved over 2 rounds,
to show whether a default is slower than a choice the user could make.
"""

from __future__ import annotations

import argparse
import time

import torch
from common import memory_read_bandwidth

from mindie import _C, LLM, SamplingParams
from mindie.engine.request import EngineRequest


def random_prompt(n: int, seed: int, vocab: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"prompt_token_ids": torch.randint(100, vocab, (n,), generator=gen).tolist()}


def single_stream(llm: LLM, vocab: int) -> tuple[float, float]:
    """Prefill tokens/s of a 512-token prompt (best of 3) and batch-1 decode tokens/s."""
    prompt = random_prompt(512, 1, vocab)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
        best = min(best, time.perf_counter() - t0)
    t0 = time.perf_counter()
    out = llm.generate(random_prompt(16, 2, vocab), SamplingParams(max_tokens=129, temperature=0, ignore_eos=True),
                       use_tqdm=False)
    n = len(out[0].outputs[0].token_ids)
    return 512 / best, (n - 1) / (time.perf_counter() - t0)


def compare_choices() -> None:
    choices: list[dict] = [{}, {"quantization": "none", "dtype": "float32"}]
    if _C.cpu_features().get("avx512_bf16"):
        choices.insert(1, {"quantization": "none", "dtype": "bfloat16"})
    llms = [LLM(enablePrefixCache=False, **kw) for kw in choices]
    vocab = llms[0].engine.loaded.config.vocab_size
    figures: list[list[tuple[float, float]]] = [[] for _ in choices]
    for _ in range(2):
        for llm, fig in zip(llms, figures):
            llm.generate(random_prompt(64, 0, vocab), SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
            fig.append(single_stream(llm, vocab))
    for kw, fig in zip(choices, figures):
        name = ", ".join(f"{k} {v}" for k, v in kw.items()) or "defaults (dtype auto, quantization auto)"
        print(f"{name:45s} prefill 512 {max(f[0] for f in fig):7.1f} tok/s, "
              f"decode batch 1 {max(f[1] for f in fig):6.1f} tok/s (best of 2 rounds)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-concurrent", action="store_true")
    ap.add_argument("--choices", action="store_true", help="defaults against the other dtype/quantization choices")
    args = ap.parse_args()
    print(f"kernel variant {_C.get_isa()}, kernel threads {_C.get_num_threads()}, "
          f"torch threads {torch.get_num_threads()}, CPU features {_C.cpu_features()}")
    print(f"memory read bandwidth: {memory_read_bandwidth() / 1e9:.1f} GB/s")
    if args.choices:
        compare_choices()
        return
    t0 = time.perf_counter()
    llm = LLM(enablePrefixCache=False)
    print(f"model load: {time.perf_counter() - t0:.1f} s")
    vocab = llm.engine.loaded.config.vocab_size
    llm.generate(random_prompt(64, 0, vocab), SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)

    prefill, decode = single_stream(llm, vocab)
    print(f"prefill, 512-token prompt: {prefill:8.1f} tokens/s")
    print(f"decode, batch 1:           {decode:8.1f} tokens/s (128 tokens after the first, incl. its prefill)")

    if not args.skip_concurrent:
        engine = llm.engine
        for i in range(32):
            ids = random_prompt(256, 10 + i, vocab)["prompt_token_ids"]
            params = SamplingParams(max_tokens=128, temperature=0.8, seed=i, ignore_eos=True)
            engine.add_request(EngineRequest(f"c{i}", ids, params))
        started: set[str] = set()
        total = decode_tokens = 0
        t0 = time.perf_counter()
        t_all_started = None
        while engine.has_unfinished():
            for out in engine.step():
                total += len(out.new_token_ids)
                if t_all_started is not None:
                    decode_tokens += len(out.new_token_ids)
                started.add(out.request_id)
            if t_all_started is None and len(started) == 32:
                t_all_started = time.perf_counter()
        t_end = time.perf_counter()
        print(f"32 concurrent (256 in / 128 out): {total / (t_end - t0):8.1f} output tokens/s "
              f"({total} tokens in {t_end - t0:.1f} s, prefill of 8192 prompt tokens included)")
        print(f"  decode phase alone (all 32 running): {decode_tokens / (t_end - t_all_started):8.1f} output tokens/s")

if __name__ == "__main__":
    main()
