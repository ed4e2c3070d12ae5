"""Serving throughput over HTTP against the offline engine, on the embedded SmolLM2 (bf16).

    python benchmarks/http_serving.py [--requests 32] [--prompt-tokens 256] [--output-tokens 128]

Starts `mindie serve` in a subprocess and drives /v1/completions with 1 and N concurrent streaming
clients (random token-id prompts, ignore_eos), alternating with the same N requests through the
offline engine in this process (the reference). Prints output tokens/s, time to first token and inter-token latency
p50/p99, the HTTP/offline throughput ratio, and /health latency measured while saturated.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time

import httpx
import torch
from common import start_server

MODEL = "SmolLM2-135M-Instruct"


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(100, vocab, (length,), generator=gen).tolist() for _ in range(n)]


class Offline:
    """The same workload through mindie.LLM in this process: the reference figure."""

    def __init__(self) -> None:
        from mindie import LLM

        self.llm = LLM(enablePrefixCache=False)

    def run(self, ids: list[list[int]], output_tokens: int) -> float:
        from mindie import SamplingParams

        params = SamplingParams(max_tokens=output_tokens, ignore_eos=True, temperature=0)
        t0 = time.perf_counter()
        self.llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
        return len(ids) * output_tokens / (time.perf_counter() - t0)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def one_stream(client: httpx.AsyncClient, url: str, ids: list[int], n_out: int) -> tuple[float, list[float], int]:
    body = {"model": MODEL, "prompt": ids, "max_tokens": n_out, "ignore_eos": True, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    ttft, gaps, last, tokens = None, [], None, 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            if not json.loads(line[6:])["choices"][0]["text"]:
                continue
            tokens += 1
            if ttft is None:
                ttft = now - t0
            else:
                gaps.append(now - last)
            last = now
    return ttft or float("nan"), gaps, tokens


async def health_probe(url: str, stop: asyncio.Event, out: list[float]) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            await client.get(url + "/health")
            out.append(time.perf_counter() - t0)
            await asyncio.sleep(0.05)


async def drive(url: str, mgmt: str, ids: list[list[int]], n_out: int) -> dict[str, float]:
    stop, health = asyncio.Event(), []
    probe = asyncio.ensure_future(health_probe(mgmt, stop, health))
    limits = httpx.Limits(max_connections=len(ids) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0, cpu0 = time.perf_counter(), time.process_time()
        results = await asyncio.gather(*(one_stream(client, url, p, n_out) for p in ids))
        wall, client_cpu = time.perf_counter() - t0, time.process_time() - cpu0
    stop.set()
    await probe
    ttfts = [r[0] for r in results]
    gaps = [g for r in results for g in r[1]]
    total = sum(r[2] for r in results)
    return {"tok_s": total / wall, "ttft50": pct(ttfts, 0.5), "ttft99": pct(ttfts, 0.99), "itl50": pct(gaps, 0.5),
            "itl99": pct(gaps, 0.99), "health99": pct(health, 0.99), "health_n": len(health),
            "client_cpu": client_cpu / wall}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    ids = prompts(args.requests, args.prompt_tokens, 49152)
    offline = Offline()
    offline.run(ids[:1], 4)
    # prefix caching off on both sides: the rounds repeat the same prompts, and the work must be the same
    config = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    json.dump({"BackendConfig": {"ScheduleConfig": {"enablePrefixCache": False}}}, config)
    config.close()
    server, url, mgmt = start_server("--config", config.name)
    try:
        asyncio.run(drive(url, mgmt, ids[:1], 8))  # warm-up
        r = asyncio.run(drive(url, mgmt, ids[:1], args.output_tokens))
        print(f"HTTP  1 stream : {r['tok_s']:6.1f} output tok/s  TTFT {r['ttft50'] * 1e3:7.1f} ms  ITL p50 "
              f"{r['itl50'] * 1e3:6.1f} ms p99 {r['itl99'] * 1e3:6.1f} ms  /health p99 {r['health99'] * 1e3:5.1f} ms")
        # offline and HTTP alternate, so a noisy stretch of this shared machine hits both
        ref, http = [], []
        for _ in range(args.rounds):
            ref.append(offline.run(ids, args.output_tokens))
            r = asyncio.run(drive(url, mgmt, ids, args.output_tokens))
            http.append(r["tok_s"])
            print(f"HTTP {args.requests} streams: {r['tok_s']:6.1f} output tok/s (offline engine {ref[-1]:6.1f})  "
                  f"TTFT p50 {r['ttft50'] * 1e3:7.1f} ms p99 {r['ttft99'] * 1e3:7.1f} ms  ITL p50 "
                  f"{r['itl50'] * 1e3:6.1f} ms p99 {r['itl99'] * 1e3:6.1f} ms  /health p99 {r['health99'] * 1e3:5.1f} "
                  f"ms ({r['health_n']} probes); the client used {r['client_cpu']:.0%} of a core")
        print(f"HTTP/offline at {args.requests} streams, {args.prompt_tokens}+{args.output_tokens} tokens each: "
              f"{statistics.median(http) / statistics.median(ref):.1%} (medians of {args.rounds} alternating rounds)")
    finally:
        server.terminate()
        server.wait(timeout=60)
        os.unlink(config.name)


if __name__ == "__main__":
    main()
