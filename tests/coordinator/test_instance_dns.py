"""Instances named by DNS in ms_coordinator.json: the coordinator resolves them itself, without
blocking its loop, and sends instances only addresses (`d-target`, the `/v1/role` peers, URLs); a
name that does not resolve keeps its instance out of the schedule until it does; an instance found
at a new address, or one that lost its role, gets its role again and its peers a new peer list."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import uvicorn
from fakes import FakeInstance, RoleAware, free_port, until

from mindie.coordinator import instances
from mindie.coordinator.config import CoordinatorConfig, Role, parse_instances
from mindie.coordinator.launcher import serve
from mindie.coordinator.service import Coordinator

UNRESOLVABLE = "mindie-decode-1.mindie-decode.invalid"  # .invalid never resolves (RFC 6761)


def run(coro: object) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


def entry(fake: FakeInstance, ip: str) -> dict[str, Any]:
    return {**fake.spec_entry, "ip": ip}


@contextlib.asynccontextmanager
async def coordinator(entries: list[dict[str, Any]]) -> AsyncIterator[tuple[Coordinator, httpx.AsyncClient]]:
    predict, manage, external, status = (free_port("127.0.0.1") for _ in range(4))
    config = CoordinatorConfig(predict_ip="127.0.0.1", predict_port=predict, manage_ip="127.0.0.1",
                               manage_port=manage, external_port=external, status_port=status, max_retry=2,
                               instances=parse_instances(entries))
    coord = Coordinator(config)
    stop = asyncio.Event()
    task = asyncio.ensure_future(serve(coord, stop, announce=False))
    client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{predict}", timeout=10, trust_env=False)
    try:
        yield coord, client
    finally:
        await client.aclose()
        stop.set()
        await task


class Fleet:
    """Fake instances, each served on its own address and started or stopped on its own (a pod)."""

    def __init__(self) -> None:
        self.shared: dict[int, FakeInstance] = {}  # port -> fake: P finds its D by d-port
        self.servers: dict[int, tuple[uvicorn.Server, asyncio.Task[None]]] = {}

    async def start(self, role: Role, host: str, port: int = 0) -> RoleAware:
        fake = RoleAware(role, host, port, cluster=self.shared)
        server = uvicorn.Server(uvicorn.Config(fake.app(), host=host, port=fake.port, log_level="warning",
                                               lifespan="off", timeout_graceful_shutdown=1))
        self.servers[id(fake)] = (server, asyncio.ensure_future(server.serve()))
        await until(lambda: server.started)
        return fake

    async def stop(self, fake: FakeInstance) -> None:
        fake.drop_stream()
        server, task = self.servers.pop(id(fake))
        server.should_exit = True
        await task

    async def __aenter__(self) -> Fleet:
        return self

    async def __aexit__(self, *exc: object) -> None:
        for fake in self.shared.values():
            fake.drop_stream()
        for server, _ in self.servers.values():
            server.should_exit = True
        await asyncio.gather(*(task for _, task in self.servers.values()))


def configured_as(name: str, coord: Coordinator) -> instances.Instance:
    return next(i for i in coord.registry.instances.values() if i.configured.ip == name)


def test_resolve_ipv4() -> None:
    async def scenario() -> None:
        assert "127.0.0.1" in await instances.resolve_ipv4("localhost")
        assert await instances.resolve_ipv4(UNRESOLVABLE) == []

    run(scenario())


def test_resolving_never_blocks_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slow resolver (a DNS server that does not answer) holds neither the loop nor the caller
    past RESOLVE_TIMEOUT_S."""
    answered = threading.Event()

    def slow_getaddrinfo(*args: Any, **kwargs: Any) -> Any:
        answered.wait(5)
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", slow_getaddrinfo)
    monkeypatch.setattr(instances, "RESOLVE_TIMEOUT_S", 0.3)

    async def scenario() -> None:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        ticker = asyncio.ensure_future(tick())
        started = time.monotonic()
        assert await instances.resolve_ipv4("slow.example") == []
        assert 0.3 <= time.monotonic() - started < 2
        assert ticks >= 5  # the loop ran on while the lookup waited in a thread
        ticker.cancel()
        answered.set()

    run(scenario())


def test_names_are_resolved_and_only_addresses_go_to_instances(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(instances, "STATUS_POLL_S", 0.05)

    async def scenario() -> None:
        async with Fleet() as f:
            p = await f.start(Role.PREFILL, "127.0.0.2")
            d = await f.start(Role.DECODE, "127.0.0.1")
            nowhere = {"role": "decode", "ip": UNRESOLVABLE, "port": 1025, "mgmt_port": 1026}
            async with coordinator([entry(p, "127.0.0.2"), entry(d, "localhost"), nowhere]) as (coord, client):
                await until(lambda: coord.registry.ready)
                assert [b["local"]["server_ip"] for b in d.role_bodies] == ["127.0.0.1"]
                # P's peers: the D that resolved, never a name, never the one that does not resolve
                assert {peer["server_ip"] for b in p.role_bodies for peer in b["peers"]} == {"127.0.0.1"}
                for _ in range(3):
                    assert (await client.post("/infer", json={"inputs": "x"})).status_code == 200
                assert {h["d-target"] for _, h, _ in p.requests} == {"127.0.0.1;1121"}
                assert d.dresult_gets == 1
                unresolved = configured_as(UNRESOLVABLE, coord)
                assert not (unresolved.reachable or unresolved.role_assigned or unresolved.schedulable)
                info = {i["host"]: i for i in
                        (await client.get(f"http://127.0.0.1:{coord.config.manage_port}/v1/coordinator_info")
                         ).json()["schedule_info"]}
                assert info["localhost"]["ip"] == "127.0.0.1" and not info[UNRESOLVABLE]["reachable"]

    run(scenario())


def test_a_name_that_resolves_later_or_moves(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pod behind a name comes up late, then is replaced by one at a new address: each time the
    coordinator follows the name, gives the new process its role and P the new peer list."""
    monkeypatch.setattr(instances, "STATUS_POLL_S", 0.05)
    name = "mindie-decode-0.mindie-decode.invalid"
    dns: dict[str, str] = {}
    real = instances.resolve_ipv4

    async def resolve(host: str) -> list[str]:
        return [dns[host]] if host in dns else await real(host)

    monkeypatch.setattr(instances, "resolve_ipv4", resolve)

    async def scenario() -> None:
        async with Fleet() as f:
            p = await f.start(Role.PREFILL, "127.0.0.2")
            d = await f.start(Role.DECODE, "127.0.0.3")
            async with coordinator([entry(p, "127.0.0.2"), entry(d, name)]) as (coord, client):
                await until(lambda: p.current_role == "prefill")
                await asyncio.sleep(0.3)
                assert not coord.registry.ready and not d.role_bodies
                assert p.role_bodies[-1]["peers"] == []

                dns[name] = "127.0.0.3"  # the pod's record appears
                await until(lambda: coord.registry.ready)
                assert [peer["server_ip"] for peer in p.role_bodies[-1]["peers"]] == ["127.0.0.3"]
                assert (await client.post("/infer", json={"inputs": "x"})).status_code == 200
                assert p.requests[-1][1]["d-target"] == "127.0.0.3;1121"

                # the pod is replaced: same name and ports, another address
                moved = await f.start(Role.DECODE, "127.0.0.4", port=d.port)
                dns[name] = "127.0.0.4"
                await f.stop(d)
                await until(lambda: moved.current_role == "decode" and moved.linked and coord.registry.ready)
                await until(lambda: [peer["server_ip"] for peer in p.role_bodies[-1]["peers"]] == ["127.0.0.4"])
                assert moved.role_bodies[-1]["local"]["server_ip"] == "127.0.0.4"
                assert (await client.post("/infer", json={"inputs": "x"})).status_code == 200
                assert p.requests[-1][1]["d-target"] == "127.0.0.4;1121"

                del dns[name]  # the pod is gone and its record with it
                await until(lambda: not coord.registry.ready)
                assert not configured_as(name, coord).reachable

    run(scenario())


def test_an_instance_that_lost_its_role_gets_it_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(instances, "STATUS_POLL_S", 0.05)

    async def scenario() -> None:
        async with Fleet() as f:
            p = await f.start(Role.PREFILL, "127.0.0.2")
            d = await f.start(Role.DECODE, "127.0.0.3")
            async with coordinator([entry(p, "127.0.0.2"), entry(d, "127.0.0.3")]) as (coord, _):
                await until(lambda: coord.registry.ready)
                assert len(p.role_bodies) == 1
                p.current_role = "none"  # its process restarted in place
                await until(lambda: len(p.role_bodies) == 2 and p.current_role == "prefill")
                await until(lambda: coord.registry.ready)
                assert len(d.role_bodies) == 1  # its peers did not move

    run(scenario())
