"""The async engine: streams per request from the engine thread, errors, early exit aborts."""

from __future__ import annotations

import asyncio

import pytest

from mindie.config import EngineConfig
from mindie.engine.async_engine import AsyncEngine
from mindie.engine.commands import AbortRequest
from mindie.engine.engine import LLMEngine
from mindie.engine.request import EngineRequest, FinishReason, SamplingParams

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


def make(loaded) -> LLMEngine:
    return LLMEngine(loaded, EngineConfig.from_mindie({"cacheBlockSize": 4, "maxSeqLen": 256, "maxIterTimes": 64}))


def sync_tokens(loaded, prompt: list[int]) -> list[int]:
    engine = make(loaded)
    engine.add_request(EngineRequest("x", prompt, GREEDY))
    out: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            out += o.new_token_ids
    return out


def test_concurrent_streams_match_the_sync_engine(tiny_llama):
    prompts = [[1, 2, 3], list(range(10, 40)), [7] * 5, list(range(100, 117))]
    expected = [sync_tokens(tiny_llama, p) for p in prompts]
    engine = AsyncEngine(make(tiny_llama))

    async def one(i: int, prompt: list[int]) -> tuple[list[int], FinishReason | None]:
        stream = await engine.add_request(EngineRequest(f"r{i}", prompt, GREEDY))
        tokens: list[int] = []
        reason = None
        async for out in stream:
            tokens += out.new_token_ids
            reason = out.finish_reason
        return tokens, reason

    async def main():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    try:
        results = asyncio.run(main())
    finally:
        engine.shutdown()
    assert [r[0] for r in results] == expected
    assert all(r[1] is FinishReason.LENGTH for r in results)


def test_rejected_request_raises_and_early_exit_aborts(tiny_llama):
    core = make(tiny_llama)
    engine = AsyncEngine(core)

    async def main():
        with pytest.raises(ValueError, match="out of range"):
            await engine.add_request(EngineRequest("bad", [10**6], GREEDY))
        stream = await engine.add_request(EngineRequest("quit", [1, 2, 3], SamplingParams(max_tokens=60,
                                                                                          ignore_eos=True)))
        async for _ in stream:
            break  # the client goes away after its first token
        await stream.aclose()
        for _ in range(200):
            if not core.has_unfinished():
                break
            await asyncio.sleep(0.01)

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    assert not core.has_unfinished()
    assert core.blocks.num_used_blocks() == 0


def test_stats_snapshot_follows_the_steps_and_aborts(tiny_llama):
    core = make(tiny_llama)
    engine = AsyncEngine(core)
    idle = engine.stats
    assert (idle.running, idle.waiting, idle.used_blocks) == (0, 0, 0) and idle.free_blocks == core.blocks.num_blocks

    async def main():
        long = SamplingParams(max_tokens=60, ignore_eos=True)
        stream = await engine.add_request(EngineRequest("live", list(range(1, 20)), long))
        await anext(stream)
        busy = engine.stats  # published before the output that was just read
        engine.submit(AbortRequest("live"))
        last = [out async for out in stream][-1]
        return busy, last

    try:
        busy, last = asyncio.run(main())
        done = engine.stats
    finally:
        engine.shutdown()
    assert busy.running == 1 and busy.used_blocks > 0 and busy.total_blocks == idle.total_blocks
    assert last.finish_reason is FinishReason.ABORT and last.request_done
    assert (done.running, done.waiting, done.used_blocks) == (0, 0, 0)
    with pytest.raises(RuntimeError, match="shut down"):
        engine.submit(AbortRequest("live"))
