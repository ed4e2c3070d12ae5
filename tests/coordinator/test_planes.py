"""Scheduling (round_robin, load_balance, offline instances), the `/dresult` link (re-link after a
drop, after silence, after a `close:`; faulty after max_retry) and the manage, status and external
planes, against fake instances on 127.0.0.x."""

from __future__ import annotations

import asyncio

from fakes import cluster, until

from mindie.pd.records import RecordKind


def run(coro: object) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


def _p_hosts(c) -> list[str]:  # type: ignore[no-untyped-def]
    return [p.host for p in c.prefills for _ in p.requests]


def test_round_robin_alternates_p_and_d() -> None:
    async def scenario() -> None:
        async with cluster(n_p=2, n_d=2, algorithm="round_robin") as c:
            for _ in range(4):
                assert (await c.client.post(c.url + "/infer", json={"inputs": "x"})).status_code == 200
            targets = [h["d-target"] for p in c.prefills for _, h, _ in p.requests]
            assert [len(p.requests) for p in c.prefills] == [2, 2]
            assert sorted(targets) == sorted([f"{d.host};1121" for d in c.decodes] * 2)

    run(scenario())


def test_load_balance_prefers_free_slots_then_blocks(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr("mindie.coordinator.instances.STATUS_POLL_S", 60)  # the test polls by itself

    async def scenario() -> None:
        async with cluster(n_p=2, n_d=2, algorithm="load_balance") as c:
            (p0, p1), (d0, d1) = c.prefills, c.decodes
            p0.status = {"availSlotsNum": 2, "availBlockNum": 500}
            p1.status = {"availSlotsNum": 10, "availBlockNum": 10}
            d0.status = {"availSlotsNum": 5, "availBlockNum": 100}
            d1.status = {"availSlotsNum": 5, "availBlockNum": 900}
            for inst in c.coord.registry.instances.values():
                await c.coord.registry.poll(inst)
            reply = await c.client.post(c.url + "/infer", json={"inputs": "x"})
            assert reply.status_code == 200
            [(_, headers, _)] = p1.requests
            assert not p0.requests and headers["d-target"] == f"{d1.host};1121"
            # requests sent since the poll count against an instance until the next poll
            for _ in range(7):
                await c.client.post(c.url + "/infer", json={"inputs": "x"})
            assert (len(p0.requests), len(p1.requests)) == (0, 8)  # p1 now (2 slots, 2 blocks), p0 (2, 500)
            await c.client.post(c.url + "/infer", json={"inputs": "x"})
            assert (len(p0.requests), len(p1.requests)) == (1, 8)

    run(scenario())


def test_offline_instances_are_not_scheduled() -> None:
    async def scenario() -> None:
        async with cluster(n_p=2, n_d=1) as c:
            manage = c.plane(c.coord.config.manage_port)
            p0 = next(i for i in c.coord.registry.instances.values() if i.spec.ip == c.prefills[0].host)
            assert (await c.client.post(manage + "/v1/instances/offline", json={"ids": [p0.id]})).status_code == 200
            for _ in range(3):
                await c.client.post(c.url + "/infer", json={"inputs": "x"})
            assert _p_hosts(c) == [c.prefills[1].host] * 3
            assert (await c.client.post(manage + "/v1/instances/online", json={"ids": [p0.id]})).status_code == 200
            for _ in range(2):
                await c.client.post(c.url + "/infer", json={"inputs": "x"})
            assert c.prefills[0].requests
            bad = await c.client.post(manage + "/v1/instances/offline", json={"ids": ["p0"]})
            assert bad.status_code == 400 and bad.json()["field"] == "ids"
            unknown = await c.client.post(manage + "/v1/instances/offline", json={"ids": [99]})
            assert unknown.status_code == 400 and "99" in unknown.json()["error"]

    run(scenario())


def test_dresult_is_relinked_after_the_stream_drops() -> None:
    async def scenario() -> None:
        async with cluster() as c:
            d = c.decodes[0]
            d.drop_stream()
            await until(lambda: d.dresult_gets == 2 and c.coord.registry.ready)
            reply = await c.client.post(c.url + "/infer", json={"inputs": "x", "stream": True})
            assert reply.status_code == 200 and reply.content.count(b"data: ") == 3

    run(scenario())


def test_a_silent_dresult_is_relinked() -> None:
    async def scenario() -> None:
        async with cluster(silence_limit_s=0.3) as c:
            d = c.decodes[0]
            d.emit_raw(b"ka:heartbeat\0")  # a heartbeat is not silence ...
            await asyncio.sleep(0.2)
            d.emit_raw(b"ka:heartbeat\0")
            await asyncio.sleep(0.2)
            assert d.dresult_gets == 1
            await until(lambda: d.dresult_gets == 2)  # ... but nothing for longer than the limit is

    run(scenario())


def test_a_superseded_dresult_is_relinked() -> None:
    async def scenario() -> None:
        async with cluster() as c:
            d = c.decodes[0]
            from mindie.pd.records import close_record

            d.emit_raw(close_record())
            await until(lambda: d.dresult_gets == 2)

    run(scenario())


def test_a_d_that_cannot_be_relinked_is_faulty_and_its_requests_end() -> None:
    async def endless(p, request, body):  # type: ignore[no-untyped-def]
        from fakes import event
        from starlette.responses import JSONResponse

        rid, d = request.headers["req-id"], p.decode_of(request)
        d.emit(rid, RecordKind.DATA, event("B"))
        return JSONResponse({"reqId": rid, "isStream": True, "isLastResp": False, "output": event("A").decode()})

    async def scenario() -> None:
        async with cluster(max_retry=1) as c:
            d = c.decodes[0]
            c.prefills[0].script = endless
            request = asyncio.ensure_future(c.client.post(c.url + "/infer", json={"inputs": "x", "stream": True}))
            await until(lambda: len(c.prefills[0].requests) == 1)
            await asyncio.sleep(0.1)
            d.refuse_dresult = True
            d.drop_stream()
            reply = await request
            assert reply.content.endswith(b"is unreachable\",\"error_type\":\"Incomplete Generation\"}\n\n")
            [inst] = c.coord.registry.of_role(d.role)
            assert inst.faulty and not c.coord.registry.ready
            d.refuse_dresult = False
            await until(lambda: c.coord.registry.ready, timeout=10)  # re-linking goes on, and D comes back

    run(scenario())


def test_status_plane() -> None:
    async def scenario() -> None:
        async with cluster(wait_ready=False) as c:
            status = c.plane(c.coord.config.status_port)
            c.decodes[0].refuse_dresult = True
            await asyncio.sleep(0.2)
            for path in ("/v1/startup", "/v1/health", "/v2/health/live"):
                reply = await c.client.get(status + path)
                assert reply.status_code == 200 and reply.content == b""
            for path in ("/v1/readiness", "/v2/health/ready", "/v2/models/m/ready"):
                assert (await c.client.get(status + path)).status_code == 503
            c.decodes[0].refuse_dresult = False
            await until(lambda: c.coord.registry.ready, timeout=10)
            for path in ("/v1/readiness", "/v2/health/ready"):
                assert (await c.client.get(status + path)).status_code == 200

    run(scenario())


def test_coordinator_info_and_query_tasks() -> None:
    async def scenario() -> None:
        async with cluster() as c:
            manage = c.plane(c.coord.config.manage_port)
            info = (await c.client.get(manage + "/v1/coordinator_info")).json()
            assert info["request_num"] == 0 and info["ready"] is True
            assert sorted(i["role"] for i in info["schedule_info"]) == ["decode", "prefill"]
            p_id = next(i["id"] for i in info["schedule_info"] if i["role"] == "prefill")
            d_id = next(i["id"] for i in info["schedule_info"] if i["role"] == "decode")
            reply = await c.client.post(manage + "/v1/instances/query_tasks", json={"p_id": p_id, "d_id": d_id})
            assert reply.json() == {"is_end": True}
            wrong = await c.client.post(manage + "/v1/instances/query_tasks", json={"p_id": d_id, "d_id": d_id})
            assert wrong.status_code == 400 and wrong.json()["field"] == "p_id"
            refresh = await c.client.post(manage + "/v1/instances/refresh", json={"ids": [p_id, d_id], "instances": [
                {"id": p_id, "dynamic_info": {"avail_slots_num": 7, "avail_block_num": 70}}]})
            assert refresh.status_code == 200
            assert c.coord.registry.instances[p_id].avail_slots == 7
            foreign = await c.client.post(manage + "/v1/instances/refresh", json={"ids": [42], "instances": []})
            assert foreign.status_code == 400

    run(scenario())


def test_metrics_are_labelled_by_instance() -> None:
    async def scenario() -> None:
        async with cluster(n_p=1, n_d=1) as c:
            reply = await c.client.get(c.plane(c.coord.config.external_port) + "/metrics")
            assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
            text = reply.text
            assert text.count("# TYPE request_received_total counter") == 1
            for role, fake in (("prefill", c.prefills[0]), ("decode", c.decodes[0])):
                assert (f'request_received_total{{instance="{fake.host}:{fake.port}",model_name="fake-model",'
                        f'role="{role}"}} 3.0') in text

    run(scenario())
