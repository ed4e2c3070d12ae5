"""Requests whose clients went away leave the engine in one batch: every abort that arrives during
a step is applied before the next one, whatever the request's phase (running, waiting, or still in
the inbox, not yet taken by the engine), with every KV block back and no sink left behind."""

from __future__ import annotations

import asyncio
import threading

import pytest
from helpers.held_steps import HeldSteps

from mindie.config import EngineConfig
from mindie.engine.async_engine import AsyncEngine
from mindie.engine.engine import LLMEngine
from mindie.engine.request import EngineRequest, RequestOutput, SamplingParams

LONG = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
BATCH = 20  # maxBatchSize: of the requests taken before the held step, 20 run and the rest wait
TAKEN = 60
QUEUED = 40  # sent while the step is held: still in the inbox when their clients go


def prompt(k: int) -> list[int]:
    return [1 + (k * 7 + i) % 300 for i in range(12)]


def test_aborts_that_arrive_during_a_step_are_applied_together_before_the_next(tiny_llama):
    core = LLMEngine(tiny_llama, EngineConfig(block_size=4, num_kv_blocks=1200, max_batch_size=BATCH, max_seq_len=256))
    held = HeldSteps(core)
    engine = AsyncEngine(core, queue_delay_s=0)
    applied_at: list[tuple[str, int]] = []  # (request id, steps run so far) per abort the engine applied
    abort = core.abort

    def recording_abort(request_id: str) -> list[RequestOutput]:
        applied_at.append((request_id, len(held.steps)))
        return abort(request_id)

    core.abort = recording_abort  # type: ignore[method-assign]

    async def main() -> tuple[tuple[int, int], int]:
        held.hold()
        first = await engine.add_request(EngineRequest("t0", prompt(0), LONG))
        await asyncio.to_thread(held.wait_held)  # step 1 (t0's prompt) runs, held
        rest = [asyncio.ensure_future(engine.add_request(EngineRequest(f"t{k}", prompt(k), LONG)))
                for k in range(1, TAKEN)]
        await asyncio.sleep(0.05)
        held.release()
        held.hold()
        await asyncio.to_thread(held.wait_held)  # step 2 runs, held: the rest were taken before it
        taken = [first, *await asyncio.gather(*rest)]
        phases = (len(core.scheduler.running), len(core.scheduler.waiting))
        queued = [asyncio.ensure_future(engine.add_request(EngineRequest(f"q{k}", prompt(TAKEN + k), LONG)))
                  for k in range(QUEUED)]
        await asyncio.sleep(0.05)  # every one submitted, none taken: the engine is inside the held step
        assert not any(q.done() for q in queued)
        for q in queued:  # their clients go away while they wait to be taken
            q.cancel()
        for stream in taken:  # and those of every request taken, running or waiting
            await stream.aclose()
        steps_when_released = len(held.steps)
        held.release()
        for _ in range(500):
            if not core.has_unfinished() and not core.requests:
                break
            await asyncio.sleep(0.01)
        return phases, steps_when_released

    try:
        phases, released = asyncio.run(main())
    finally:
        engine.shutdown()
    assert phases == (BATCH, TAKEN - BATCH)  # when their clients go, 20 run and 40 wait
    # Every abort was applied in the one pass between the held step and the next, and that next
    # step never came: nothing was left to run.
    assert sorted(applied_at) == sorted([(f"t{k}", released) for k in range(TAKEN)]
                                        + [(f"q{k}", released) for k in range(QUEUED)])
    assert len(held.steps) == released
    assert not any(rid.startswith("q") for rid in held.ran_since(0))
    assert not core.requests and not core.has_unfinished() and not engine._sinks
    core.blocks.check_invariants()
    assert core.blocks.num_used_blocks() == 0
    assert (engine.stats.running, engine.stats.waiting, engine.stats.used_blocks) == (0, 0, 0)


def test_a_cancelled_add_request_never_reaches_a_step(tiny_llama):
    """The abort follows the request in the inbox: the engine takes both in one pass."""
    core = LLMEngine(tiny_llama, EngineConfig(block_size=4, num_kv_blocks=200, max_seq_len=256))
    held = HeldSteps(core)
    engine = AsyncEngine(core, queue_delay_s=0)

    async def main() -> None:
        first = await engine.add_request(EngineRequest("running", prompt(0), LONG))
        held.hold()
        await asyncio.to_thread(held.wait_held)
        gone = asyncio.ensure_future(engine.add_request(EngineRequest("gone", prompt(1), LONG)))
        await asyncio.sleep(0.05)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        held.release()
        outputs = [await anext(first) for _ in range(3)]  # the survivor goes on, alone
        assert all(o.request_id == "running" and len(o.new_token_ids) == 1 for o in outputs)
        await first.aclose()

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    assert all(step == {"running"} for step in held.steps)
    assert "gone" not in core.requests and not engine._sinks
    core.blocks.check_invariants()


def test_a_closed_event_loop_aborts_its_requests_and_the_engine_serves_on(tiny_llama):
    """A caller's event loop that closes while its request runs (nothing reads the request any more) is
    an abort: the engine thread, which can no longer hand it outputs, lives on and frees its blocks."""
    core = LLMEngine(tiny_llama, EngineConfig(block_size=4, num_kv_blocks=200, max_seq_len=256))
    engine = AsyncEngine(core, queue_delay_s=0)

    async def start() -> None:
        await engine.add_request(EngineRequest("orphan", prompt(0), LONG))

    async def serve() -> list[RequestOutput]:
        stream = await engine.add_request(EngineRequest("next", prompt(1), SamplingParams(max_tokens=3, temperature=0)))
        return [out async for out in stream]

    try:
        asyncio.run(start())  # returns with the request running; the loop closes
        for _ in range(3000):
            if not core.requests and not engine._sinks:
                break
            threading.Event().wait(0.01)
        assert engine.healthy and not core.requests and not engine._sinks
        outputs = asyncio.run(serve())
    finally:
        engine.shutdown()
    assert outputs[-1].request_done and sum(len(o.new_token_ids) for o in outputs) == 3
    core.blocks.check_invariants()
    assert core.blocks.num_used_blocks() == 0
