"""Where a batch-1 decode step's time goes, on any GGUF (issue 24).

    python benchmarks/profile_decode.py [--model GGUF] [--tokens 64] [--threads N]

1. The engine: wall time per step of a batch-1 decode, and of it the C++ forward call (runner.model.forward);
   the rest is Python (scheduling, inputs, sampling, outputs).
2. The forward's projections replayed as the step calls them (q/k/v, o, gate/up, down per layer, then the
   lm_head), each call timed: per kind and its matrices' formats (a Q4_K_M file mixes Q4_K and Q6_K
   layers), ms per token and GB/s of weight bytes, beside the read bandwidth measured just before. The
   forward minus the replayed projections is everything else (norms, rotary, KV writes, attention,
   activation quantization outside the matmul).
3. The same replay with the kernel pool at one thread: how the projections scale over the threads.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from common import memory_read_bandwidth
from vs_llamacpp import random_ids

from mindie import _C, LLM, SamplingParams, ops
from mindie.engine.request import EngineRequest

KINDS = [("qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")), ("o", ("self_attn.o_proj",)),
         ("gate/up", ("mlp.gate_proj", "mlp.up_proj")), ("down", ("mlp.down_proj",))]


def engine_profile(llm: LLM, tokens: int) -> tuple[float, float]:
    """(median seconds per decode step, median seconds of its forward call) at batch 1."""
    model = llm.engine.runner.model
    forward_times: list[float] = []
    inner = model.forward

    def timed_forward(*args: object) -> torch.Tensor:
        t0 = time.perf_counter()
        out = inner(*args)
        forward_times.append(time.perf_counter() - t0)
        return out

    model.forward = timed_forward
    try:
        engine = llm.engine
        ids = random_ids(16, 7, llm.engine.loaded.config.vocab_size)
        engine.add_request(EngineRequest("profile", ids, SamplingParams(max_tokens=tokens + 1, ignore_eos=True)))
        steps: list[float] = []
        while engine.has_unfinished():
            t0 = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t0)
    finally:
        del model.forward
    return statistics.median(steps[1:]), statistics.median(forward_times[1:])


def replay(calls: list[tuple[str, list, torch.Tensor, torch.Tensor, list, int]], rounds: int) -> dict[str, float]:
    """Per label, the median over `rounds` of the seconds its calls take in one pass in step order."""
    per_round: dict[str, list[float]] = {}
    for _ in range(rounds + 1):  # the first pass warms up
        spent: dict[str, float] = {}
        for label, outs, q, d, specs, _ in calls:
            t0 = time.perf_counter()
            _C.qmatmul_group(outs, q, d, specs)
            spent[label] = spent.get(label, 0.0) + time.perf_counter() - t0
        for label, t in spent.items():
            per_round.setdefault(label, []).append(t)
    return {label: statistics.median(ts[1:]) for label, ts in per_round.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF file (default: the embedded model)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    _C.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, enablePrefixCache=False)
    model = llm.engine.runner.model
    llm.generate({"prompt_token_ids": random_ids(32, 0, model.config.vocab_size)},
                 SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    step, forward = engine_profile(llm, args.tokens)
    print(f"model {args.model or 'embedded'}; kernel variant {_C.get_isa()}, {args.threads} threads")
    print(f"decode step {step * 1e3:.2f} ms ({1 / step:.1f} tok/s): forward {forward * 1e3:.2f} ms, "
          f"Python around it {(step - forward) * 1e3:.2f} ms")

    calls = []
    for i in range(model.config.num_layers):
        for kind, names in KINDS:
            ws = [model.matrices[f"model.layers.{i}.{n}.weight"] for n in names]
            calls.append((f"{kind} {'/'.join(w.format_name for w in ws)}", ws))
    calls.append((f"lm_head {model.lm_head.format_name}", [model.lm_head]))
    prepared = []
    for label, ws in calls:
        q, d = ops.quantize_activations(torch.randn(1, ws[0].cols))
        prepared.append((label, [torch.empty(1, w.rows) for w in ws], q, d, [w.spec() for w in ws],
                         sum(w.nbytes for w in ws)))
    nbytes: dict[str, int] = {}
    for label, *_, b in prepared:
        nbytes[label] = nbytes.get(label, 0) + b
    for threads in sorted({args.threads, 1}, reverse=True):
        _C.set_num_threads(threads)
        bandwidth = memory_read_bandwidth()
        spent = replay(prepared, args.rounds)
        total_t, total_b = sum(spent.values()), sum(nbytes.values())
        print(f"\nprojections replayed, {threads} thread(s); read bandwidth {bandwidth / 1e9:.1f} GB/s")
        width = max(len(label) for label in nbytes)
        print(f"{'kind':<{width}} {'MB':>8} {'ms/token':>9} {'GB/s':>7} {'of bw':>6}")
        for label, b in nbytes.items():
            t = spent[label]
            print(f"{label:<{width}} {b / 1e6:8.1f} {t * 1e3:9.2f} {b / t / 1e9:7.1f} {100 * b / t / bandwidth:5.0f}%")
        print(f"{'all':<{width}} {total_b / 1e6:8.1f} {total_t * 1e3:9.2f} {total_b / total_t / 1e9:7.1f} "
              f"{100 * total_b / total_t / bandwidth:5.0f}%")
        if threads == args.threads:
            print(f"forward minus projections: {(forward - total_t) * 1e3:.2f} ms per token")
    _C.set_num_threads(args.threads)


if __name__ == "__main__":
    main()
