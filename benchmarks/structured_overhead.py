"""What constrained decoding costs: decode throughput of 16 concurrent requests on the embedded
SmolLM2 (bf16), free against constrained by a JSON schema (llguidance masks + the bitmask kernel).

    python benchmarks/structured_overhead.py [--requests 16] [--tokens 96] [--rounds 3]

Both runs sample at temperature 1 with the same seeds and ignore EOS where they can; the figure is
generated tokens per second over the decode steps (prefill excluded), medians of rounds that
alternate free and constrained.
"""

from __future__ import annotations

import argparse
import statistics
import time

from mindie import LLM
from mindie.engine.request import EngineRequest, SamplingParams
from mindie.sampling import sampler
from mindie.structured.grammar import GrammarCompiler

SCHEMA = {"type": "array", "minItems": 200, "items": {"type": "object", "properties": {
    "id": {"type": "integer"}, "name": {"type": "string", "maxLength": 12},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "maxItems": 3}},
    "required": ["id", "name", "tags"]}}


MASK_TIME: list[float] = []  # seconds spent masking, per constrained step


def _timed_masking() -> None:
    """Records the time of every masking call (grammar masks + bitmask kernel)."""
    masking = sampler._apply_grammars

    def timed(logits, seqs):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        masking(logits, seqs)
        if any(s.matcher is not None for s in seqs):
            MASK_TIME.append(time.perf_counter() - t0)

    sampler._apply_grammars = timed


def run(llm: LLM, requests: int, tokens: int, grammar, tag: str) -> tuple[float, float]:
    """Decode tokens/s and seconds per decode step."""
    engine = llm.engine
    messages = [{"role": "user", "content": "List items as JSON."}]
    prompt = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(messages), add_special_tokens=False)
    for i in range(requests):
        params = SamplingParams(max_tokens=tokens, temperature=1.0, seed=i, ignore_eos=True)
        engine.add_request(EngineRequest(f"{tag}{i}", prompt, params, grammar=grammar))
    engine.step()  # the prefill step
    generated, steps, t0 = 0, 0, time.perf_counter()
    while engine.has_unfinished():
        generated += sum(len(o.new_token_ids) for o in engine.step())
        steps += 1
    elapsed = time.perf_counter() - t0
    return generated / elapsed, elapsed / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    _timed_masking()
    llm = LLM(enablePrefixCache=False)
    grammar = GrammarCompiler(llm.tokenizer).json_schema(SCHEMA)
    run(llm, 2, 8, None, "warm")
    free, constrained, steps = [], [], []
    for r in range(args.rounds):
        free.append(run(llm, args.requests, args.tokens, None, f"f{r}-")[0])
        tok_s, step_s = run(llm, args.requests, args.tokens, grammar, f"c{r}-")
        constrained.append(tok_s)
        steps.append(step_s)
    f, c = statistics.median(free), statistics.median(constrained)
    print(f"{args.requests} concurrent requests, decode: free {f:.1f} tok/s, JSON-schema constrained {c:.1f} tok/s "
          f"(cost {1 - c / f:.1%}); per round free {[round(x) for x in free]}, constrained "
          f"{[round(x) for x in constrained]}")
    print(f"masking (llguidance masks + bitmask kernel) per constrained step: median "
          f"{statistics.median(MASK_TIME) * 1e3:.2f} ms of a {statistics.median(steps) * 1e3:.1f} ms step "
          f"({statistics.median(MASK_TIME) / statistics.median(steps):.1%})")


if __name__ == "__main__":
    main()
