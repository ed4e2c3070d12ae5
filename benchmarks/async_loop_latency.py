"""How long the asyncio event loop stalls while the engine thread generates (embedded model, bf16).

    python benchmarks/async_loop_latency.py

A ticker coroutine sleeps 1 ms in a loop and records how late it wakes, while 16 requests of
~128 prompt and 64 output tokens stream through AsyncEngine.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import torch

from mindie.config import EngineConfig
from mindie.engine.async_engine import AsyncEngine
from mindie.engine.engine import LLMEngine
from mindie.engine.request import EngineRequest, SamplingParams
from mindie.model.loader import load_model


async def main() -> None:
    engine = AsyncEngine(LLMEngine(load_model(dtype=torch.bfloat16), EngineConfig()))
    lags: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        while not done.is_set():
            t0 = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - t0 - 0.001)

    async def request(i: int) -> int:
        gen = torch.Generator().manual_seed(i)
        ids = torch.randint(100, 49152, (128,), generator=gen).tolist()
        stream = await engine.add_request(EngineRequest(f"r{i}", ids, SamplingParams(max_tokens=64, ignore_eos=True)))
        return sum([len(o.new_token_ids) async for o in stream])

    tick = asyncio.create_task(ticker())
    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*(request(i) for i in range(16))))
    elapsed = time.perf_counter() - t0
    done.set()
    await tick
    engine.shutdown()
    lags.sort()
    print(f"{tokens} tokens in {elapsed:.1f} s ({tokens / elapsed:.0f} tok/s) with the engine in its own thread")
    print(f"event-loop lag over {len(lags)} ticks: median {statistics.median(lags) * 1e3:.2f} ms, "
          f"p99 {lags[int(len(lags) * 0.99)] * 1e3:.2f} ms, max {lags[-1] * 1e3:.2f} ms")


if __name__ == "__main__":
    asyncio.run(main())
