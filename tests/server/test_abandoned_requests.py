"""Bursts of requests whose clients give up, against a real server: they leave the engine at once
and in one batch, every KV block comes back, and the next request is served about as fast as on an
idle server. Steps cost a fixed time per computed token (helpers.held_steps), as on a CPU that
computes a real model, so that running an abandoned request costs what it would there."""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import httpx
import pytest
from helpers.held_steps import HeldSteps
from helpers.server import RunningServer, local_settings

PROMPT = "x" * 40  # 41 tokens with the tiny model's byte tokenizer
LONG = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "temperature": 0}  # vLLM /generate
ONE = {"prompt": "hi", "max_tokens": 8, "ignore_eos": True, "temperature": 0}
BURST = 100


@pytest.fixture(scope="module")
def served(tiny_llama_dir):
    settings = local_settings(str(tiny_llama_dir), dtype="float32", model_name="tiny")
    server = RunningServer(replace(settings, engine=replace(settings.engine, num_kv_blocks=800)))
    held = HeldSteps(server.ctx.engine.engine)
    yield server, held
    held.release()
    server.close()


def latency(server: RunningServer, body: dict[str, object] = ONE) -> float:
    t = time.monotonic()
    r = httpx.post(server.url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return time.monotonic() - t


def idle_latency(server: RunningServer) -> float:
    latency(server)
    return statistics.median(latency(server) for _ in range(3))


def wait_until(condition: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


def open_server_connections(port: int) -> int:
    """TCP connections whose server end is on `port` and not yet closed by the server (established, or
    closed by the client only), from /proc/net/tcp."""
    with open("/proc/net/tcp") as table:
        rows = [line.split() for line in table.readlines()[1:]]
    return sum(int(row[1].split(":")[1], 16) == port and row[3] in ("01", "08") for row in rows)


def assert_all_back(server: RunningServer) -> None:
    """Nothing runs or waits, every KV block is back in the pool and no request is in flight."""
    engine = server.ctx.engine.engine
    assert wait_until(lambda: not engine.has_unfinished() and not server.ctx.in_flight), (
        engine.stats(), len(server.ctx.in_flight))
    stats = server.ctx.engine.stats
    assert (stats.running, stats.waiting, stats.free_blocks) == (0, 0, stats.total_blocks)
    engine.blocks.check_invariants()
    assert not engine.requests


async def give_up(url: str, n: int, timeout: float) -> int:
    """n clients, half of them streaming, that each give up after `timeout`; how many did."""
    async def one(k: int) -> bool:
        try:
            if k % 2:
                async with client.stream("POST", url, json={**LONG, "stream": True}, timeout=timeout) as r:
                    async for _ in r.aiter_bytes():
                        break
            else:
                await client.post(url, json=LONG, timeout=timeout)
        except httpx.TimeoutException:
            return True
        return False

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=n)) as client:
        return sum(await asyncio.gather(*(one(k) for k in range(n))))


def test_clients_that_give_up_while_queued_never_reach_a_step(served):
    server, held = served
    held.cost_s_per_token = 0.002
    idle = idle_latency(server)
    received = server.ctx.metrics.received_count
    held.hold()
    blocker = threading.Thread(target=latency, args=(server, {**ONE, "max_tokens": 1}))  # ends in the held step
    blocker.start()
    held.wait_held()  # a long step runs; the burst arrives and gives up behind it
    gave_up = asyncio.run(give_up(server.url + "/generate", BURST, timeout=0.5))
    # The server has seen every client of the burst go and closed its connection: it may have read a
    # request only after its client gave up (a loaded machine), and then either started and aborted
    # it or, the body unread, never started it; only the blocker is left in flight.
    dropped = wait_until(lambda: open_server_connections(server.settings.port) == 1
                         and len(server.ctx.in_flight) == 1, timeout=30)
    assert received + 1 <= server.ctx.metrics.received_count <= received + 1 + BURST
    first_after = len(held.steps)
    held.release()
    after = latency(server)
    blocker.join()
    print(f"idle {idle * 1e3:.0f} ms, after {BURST} abandoned {after * 1e3:.0f} ms")
    assert gave_up == BURST and dropped
    # No step after the held one ran any of them: only the one request sent afterwards ran.
    assert len(held.ran_since(first_after)) == 1
    assert after < 5 * idle + 1.0
    assert_all_back(server)


def test_streams_closed_after_their_first_chunk(served):
    server, held = served
    held.cost_s_per_token = 0.0005
    idle = idle_latency(server)

    async def burst() -> int:
        async def one() -> bool:
            async with client.stream("POST", server.url + "/generate", json={**LONG, "stream": True}) as r:
                async for chunk in r.aiter_bytes():
                    return bool(chunk)  # the client closes after its first chunk
            return False

        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=BURST), timeout=60) as client:
            return sum(await asyncio.gather(*(one() for _ in range(BURST))))

    assert asyncio.run(burst()) == BURST
    steps_at_last_close = len(held.steps)
    engine = server.ctx.engine.engine
    assert wait_until(lambda: not engine.has_unfinished(), timeout=10)
    steps_to_empty = len(held.steps) - steps_at_last_close
    after = latency(server)
    print(f"idle {idle * 1e3:.0f} ms, after {BURST} closed streams {after * 1e3:.0f} ms, "
          f"{steps_to_empty} step(s) to empty")
    assert steps_to_empty <= 2
    assert after < 5 * idle + 1.0
    assert_all_back(server)
