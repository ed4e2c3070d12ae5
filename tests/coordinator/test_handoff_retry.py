"""A request P could not hand to its D, or whose D went away before P answered, against fake P and
D instances: nothing of it had reached the client, so it goes to another pair and the client gets
the whole answer; the D that failed is out of the schedule until its status answers again."""

from __future__ import annotations

import asyncio
import json

import pytest
from fakes import Cluster, FakeInstance, cluster, event, relay_happy_path, until
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mindie.coordinator.config import Role
from mindie.pd.records import RecordKind

SEND_D_FAILED = "[P Node] Send D request failed:connection refused"  # a real P's text for a D that is gone


def _refused_by(dead: set[int], status_too: bool = False):  # type: ignore[no-untyped-def]
    """P's side: the hand-off to a D whose port is in `dead` fails, as a real P answers it;
    `status_too`: that D's status stops answering too (it is down, not only for P)."""

    async def script(p: FakeInstance, request: Request, body: bytes) -> Response:
        if int(request.headers["d-port"]) in dead:
            if status_too:
                p.decode_of(request).status = None
            return JSONResponse({"error": SEND_D_FAILED, "error_type": "Internal Server Error"}, status_code=500)
        return await relay_happy_path(p, request, body)

    return script


def _whole(stream: bool) -> bytes:
    return event("A") + event("B") + event("C") if stream else b'{"whole": "ABC"}'


def _d_ports(c: Cluster) -> list[int]:
    return [int(headers["d-port"]) for _, headers, _ in c.prefills[0].requests]


@pytest.mark.parametrize("stream", [False, True])
def test_a_hand_off_p_could_not_make_goes_to_the_other_pair(stream: bool) -> None:
    async def scenario() -> None:
        async with cluster(n_p=1, n_d=2, algorithm="round_robin") as c:
            bad, good = c.decodes
            c.prefills[0].script = _refused_by({bad.port}, status_too=True)
            for _ in range(3):
                reply = await c.client.post(c.url + "/infer", json={"inputs": "x", "stream": stream})
                assert reply.status_code == 200, reply.text
                assert reply.content == _whole(stream)
            assert _d_ports(c) == [bad.port, good.port, good.port, good.port]  # tried once, then left alone
            first, again = (h["req-id"] for _, h, _ in c.prefills[0].requests[:2])
            assert first != again  # a new req-id: P may hold a lease under the old one
            d_bad = c.coord.registry.of_role(Role.DECODE)[0]
            assert not d_bad.schedulable
            await until(lambda: first in bad.stopped)  # in case it got that far

            bad.status = {"availSlotsNum": 200, "availBlockNum": 1000}  # healthy again
            await until(lambda: d_bad.schedulable, timeout=5)
            c.prefills[0].script = None
            for _ in range(2):
                assert (await c.client.post(c.url + "/infer", json={"inputs": "x"})).status_code == 200
            assert bad.port in _d_ports(c)[-2:]  # back in the schedule
            await until(lambda: len(c.coord.table) == 0)
            assert not any(i.in_flight for i in c.coord.registry.instances.values())

    asyncio.run(scenario())


@pytest.mark.parametrize("stream", [False, True])
def test_past_max_retry_the_client_gets_ps_500(stream: bool) -> None:
    async def scenario() -> None:
        async with cluster(n_p=2, n_d=2, algorithm="round_robin") as c:  # max_retry=2
            for p in c.prefills:
                p.script = _refused_by({d.port for d in c.decodes})
            reply = await c.client.post(c.url + "/v1/completions", json={"prompt": "x", "stream": stream}, timeout=20)
            assert reply.status_code == 500 and reply.json() == {"error": SEND_D_FAILED,
                                                                 "error_type": "Internal Server Error"}
            calls = [h["req-id"] for p in c.prefills for _, h, _ in p.requests]
            assert len(calls) == 3 and len(set(calls)) == 3  # the first try and max_retry more
            await until(lambda: len(c.coord.table) == 0)

    asyncio.run(scenario())


@pytest.mark.parametrize("known", ["faulty", "unlinked"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_d_lost_before_p_answered_goes_to_the_other_pair(stream: bool, known: str) -> None:
    """P handed the request to D, then D went away (its /dresult is refused from then on) before P's
    reply reached the coordinator, which knew by then that D was faulty, or only that its /dresult
    was down: nothing had reached the client, so it starts over."""

    async def scenario() -> None:
        async with cluster(n_p=1, n_d=2, algorithm="round_robin") as c:
            lost, other = c.decodes
            lost_state = c.coord.registry.of_role(Role.DECODE)[0]

            async def d_dies_then_p_answers(p: FakeInstance, request: Request, body: bytes) -> Response:
                rid = request.headers["req-id"]
                if p.decode_of(request) is not lost:
                    return await relay_happy_path(p, request, body)
                lost.refuse_dresult = True
                lost.drop_stream()
                await until(lambda: lost_state.faulty if known == "faulty" else not lost_state.linked)
                return JSONResponse({"reqId": rid, "isStream": stream,
                                     **({"isLastResp": False, "output": event("A").decode()} if stream else {})})

            c.prefills[0].script = d_dies_then_p_answers
            reply = await c.client.post(c.url + "/infer", json={"inputs": "x", "stream": stream})
            assert reply.status_code == 200 and reply.content == _whole(stream)
            assert _d_ports(c) == [lost.port, other.port]
            await until(lambda: len(c.coord.table) == 0)

    asyncio.run(scenario())


def test_a_recompute_whose_hand_off_fails_goes_to_the_other_pair() -> None:
    """D sent the request back (retry:) and the P that recomputes it cannot reach its new D: the
    recompute goes to another pair at once, not to the same one a second later."""

    async def scenario() -> None:
        async with cluster(n_p=1, n_d=2, algorithm="round_robin") as c:
            first_d, second_d = c.decodes
            calls: list[tuple[int, bool]] = []

            async def script(p: FakeInstance, request: Request, body: bytes) -> Response:
                rid, d = request.headers["req-id"], p.decode_of(request)
                recompute = request.headers.get("is-recompute") == "true"
                calls.append((d.port, recompute))
                if not recompute:
                    d.emit(rid, RecordKind.RETRY, json.dumps({"inputs": "1,5,7", "stream": True}))
                    return JSONResponse({"reqId": rid, "isStream": True, "isLastResp": False,
                                         "output": event("A").decode()})
                if len(calls) == 2:  # the recompute's first pair: its D is gone
                    return JSONResponse({"error": SEND_D_FAILED, "error_type": "Internal Server Error"},
                                        status_code=500)
                d.emit(rid, RecordKind.LAST_DATA, event("B"))
                return JSONResponse({"reqId": rid, "isStream": True, "isLastResp": False, "output": ""})

            c.prefills[0].script = script
            reply = await c.client.post(c.url + "/infer", json={"inputs": "x", "stream": True}, timeout=10)
            assert reply.content == event("A") + event("B")
            assert calls == [(first_d.port, False), (second_d.port, True), (first_d.port, True)]

    asyncio.run(scenario())
