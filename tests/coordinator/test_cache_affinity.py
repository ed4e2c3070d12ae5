"""`cache_affinity`: every family's prompt is read, prompts hash into chained prefixes, the index is
bounded and forgets a P that leaves; the scheduler sends a conversation back to the P that holds
it, an unrelated prompt by load, and falls back to load when that P is busy. Scheduling is tested
on instances in memory; the relay's part, and forgetting a P that goes offline or stops answering,
through a coordinator in front of fake instances."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from fakes import cluster

from mindie.coordinator.affinity import CHUNK_CHARS, CHUNK_TOKENS, PrefixIndex, prefixes
from mindie.coordinator.config import Role, parse_instances
from mindie.coordinator.instances import Instance, Registry
from mindie.coordinator.requests import RequestTable, State
from mindie.coordinator.scheduler import BUSY_MARGIN, Scheduler
from mindie.server.protocols import native, openai_family, tgi, triton, vllm
from mindie.server.protocols.family import ChatPrompt, Family, TextPrompt, TokenPrompt

NATIVE, TGI, VLLM, OPENAI, TRITON = native.FAMILY, tgi.FAMILY, vllm.FAMILY, openai_family.FAMILY, triton.FAMILY

PARTS = [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def _canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@pytest.mark.parametrize("family,body,prompt", [
    (NATIVE, {"inputs": "hello"}, TextPrompt("hello")),
    (NATIVE, {"inputs": PARTS}, TextPrompt("hello world")),
    (NATIVE, {"input_id": [1, 2, 3]}, TokenPrompt((1, 2, 3))),
    (TGI, {"inputs": "hello", "parameters": {}}, TextPrompt("hello")),
    (VLLM, {"prompt": "hello"}, TextPrompt("hello")),
    (VLLM, {"prompt": PARTS}, TextPrompt("hello world")),
    (OPENAI, {"messages": MESSAGES}, ChatPrompt("{}", tuple(_canon(m) for m in MESSAGES))),
    (OPENAI, {"messages": MESSAGES, "tools": [{"type": "function"}], "tool_choice": "auto"},
     ChatPrompt(_canon({"tools": [{"type": "function"}]}), tuple(_canon(m) for m in MESSAGES))),
    (OPENAI, {"prompt": "hello"}, TextPrompt("hello")),
    (OPENAI, {"prompt": ["hello", "other"]}, TextPrompt("hello")),
    (OPENAI, {"prompt": [5, 6]}, TokenPrompt((5, 6))),
    (OPENAI, {"prompt": [[5, 6], [7]]}, TokenPrompt((5, 6))),
    (TRITON, {"id": "a", "text_input": "hello"}, TextPrompt("hello")),
    (TRITON, {"inputs": [{"name": "input0", "shape": [2], "datatype": "UINT32", "data": [7, 8]}]},
     TokenPrompt((7, 8))),
])
def test_every_family_prompt_is_read(family: Family, body: dict[str, Any], prompt: object) -> None:
    assert family.prompt(json.dumps(body).encode()) == prompt


@pytest.mark.parametrize("family,body", [
    (NATIVE, b"not json"), (NATIVE, b"[1]"), (TGI, b"{}"), (OPENAI, b'{"messages": "hi"}'),
    (OPENAI, b'{"prompt": []}'), (TRITON, b'{"inputs": []}'), (VLLM, b'{"prompt": [{"type": "image_url"}]}'),
])
def test_a_body_without_a_readable_prompt_has_none(family: Family, body: bytes) -> None:
    assert family.prompt(body) is None
    assert prefixes(family.prompt(body)).hashes == []


def _hashes(prompt: ChatPrompt | TextPrompt | TokenPrompt) -> list[int]:
    return prefixes(prompt).hashes


def test_prompts_hash_into_chained_prefixes() -> None:
    turn1 = ChatPrompt("{}", ("a", "b"))
    turn2 = ChatPrompt("{}", ("a", "b", "answer", "c"))
    assert _hashes(turn2)[:2] == _hashes(turn1) and len(_hashes(turn2)) == 4
    assert prefixes(turn2).ends == [1, 2, 8, 9] and prefixes(turn2).share(2) == 2 / 9
    assert _hashes(ChatPrompt('{"tools":[]}', ("a", "b")))[0] != _hashes(turn1)[0]
    assert _hashes(ChatPrompt("{}", ("x", "b")))[1] != _hashes(turn1)[1]  # chained, not per segment
    text = "t" * (2 * CHUNK_CHARS + 5)
    assert len(_hashes(TextPrompt(text))) == 2  # whole chunks only
    assert prefixes(TextPrompt(text)).share(2) == 2 * CHUNK_CHARS / len(text)
    assert _hashes(TextPrompt(text + "more" * CHUNK_CHARS))[:2] == _hashes(TextPrompt(text))
    assert _hashes(TextPrompt("short")) == []
    ids = tuple(range(3 * CHUNK_TOKENS))
    assert len(_hashes(TokenPrompt(ids))) == 3 and prefixes(TokenPrompt(ids)).share(3) == 1.0
    assert not set(_hashes(TokenPrompt(ids))) & set(_hashes(TextPrompt("x" * 3 * CHUNK_CHARS)))


def test_the_index_is_bounded_and_forgets() -> None:
    index = PrefixIndex(capacity=8)
    first, second, third = ([k * 100 + i for i in range(4)] for k in range(3))
    index.record(0, first)
    index.record(0, second)
    assert index.longest(0, first) == 4 and index.longest(0, [*second[:2], 999]) == 2
    index.record(0, third)
    assert index.size(0) == 8 and index.longest(0, first) == 0  # the least recently sent went first
    assert index.longest(0, second) == 4 and index.longest(1, second) == 0
    index.record(1, first)
    index.forget(0)
    assert index.size(0) == 0 and index.longest(0, third) == 0 and index.longest(1, first) == 4


class InMemory:
    """A scheduler over instances in memory, all in service with the same free slots and blocks."""

    def __init__(self, algorithm: str = "cache_affinity", n_p: int = 2) -> None:
        entries = [{"role": "prefill", "ip": f"127.0.0.{2 + i}", "port": 1025, "mgmt_port": 1026} for i in range(n_p)]
        entries.append({"role": "decode", "ip": f"127.0.0.{2 + n_p}", "port": 1025, "mgmt_port": 1026})
        self.registry = Registry(parse_instances(entries), None, lambda: None)  # type: ignore[arg-type]  # no polls
        for inst in self.registry.instances.values():
            inst.role_assigned = inst.reachable = inst.linked = True
            inst.avail_slots, inst.avail_blocks = 200, 1000
        self.table = RequestTable()
        self.scheduler = Scheduler(self.registry, self.table, algorithm, 1000)
        self.prefills = self.registry.of_role(Role.PREFILL)

    def send(self, family: Family, body: dict[str, Any]) -> Instance:
        """The P the request went to; it was answered at once, so it leaves nothing in flight."""
        pair = self.scheduler.pick(family, json.dumps(body).encode())
        assert pair is not None
        return pair[0]

    def wait_on(self, p: Instance, n: int) -> None:
        """n more requests sent to P that P has not answered yet."""
        for _ in range(n):
            tracked = self.table.add()
            tracked.p, tracked.state = p, State.REPEATED
            p.in_flight.add(tracked.req_id)

    def settle(self) -> None:
        """A status poll: its figures now count what was sent since the last one."""
        for inst in self.registry.instances.values():
            inst.assigned_since_poll = 0


class Chat:
    """A conversation: a system prompt every chat shares, then a long document of its own."""

    def __init__(self, name: str) -> None:
        self.messages = [{"role": "system", "content": "You are a helpful assistant."},
                         {"role": "user", "content": f"Read {name}'s document: " + f"{name} lorem ipsum " * 30}]
        self.turns = 0

    def next_turn(self) -> dict[str, Any]:
        """The next request: the previous answer (as the client got it back) and a new question."""
        if self.turns:
            self.messages.append({"role": "assistant", "content": f"answer {self.turns}"})
        self.turns += 1
        self.messages.append({"role": "user", "content": f"question {self.turns}"})
        return {"model": "m", "messages": list(self.messages), "max_tokens": 8}


def _unrelated(k: int) -> dict[str, Any]:
    return {"prompt": f"unrelated prompt {k} " * 20, "max_tokens": 8}


def test_each_turn_of_a_chat_goes_back_to_its_p() -> None:
    def run(algorithm: str) -> dict[str, set[int]]:
        c = InMemory(algorithm)
        chats, went = {"a": Chat("a"), "b": Chat("b")}, {"a": set(), "b": set()}
        for turn in range(5):
            for name, chat in chats.items():
                went[name].add(c.send(OPENAI, chat.next_turn()).id)
            c.send(VLLM, _unrelated(turn))
        return went

    went = run("cache_affinity")
    assert all(len(ps) == 1 for ps in went.values()) and went["a"] != went["b"]  # the first turns went by load
    assert any(len(ps) > 1 for ps in run("load_balance").values())  # what affinity changes


def test_an_unrelated_prompt_goes_by_load() -> None:
    c = InMemory()
    chat = Chat("a")
    p = c.send(OPENAI, chat.next_turn())
    other = next(i for i in c.prefills if i is not p)
    c.settle()
    p.avail_slots = 150  # busier, but not busy: the conversation stays
    assert c.send(OPENAI, chat.next_turn()) is p
    assert c.send(VLLM, _unrelated(0)) is other
    assert c.send(OPENAI, Chat("b").next_turn()) is other  # it shares the system prompt only: too little


def test_a_p_must_hold_at_least_half_of_the_prompt() -> None:
    c = InMemory()
    first = Chat("a").next_turn()
    p = c.send(OPENAI, first)
    other = next(i for i in c.prefills if i is not p)
    p.avail_slots = 150
    history = sum(len(json.dumps(m)) for m in first["messages"])
    longer = {**first, "messages": [*first["messages"], {"role": "user", "content": "x" * history}]}
    assert c.send(OPENAI, longer) is other  # what p holds is under half of it
    assert c.send(OPENAI, first) is other  # both hold all of it now: the tie goes by load


def test_a_p_with_no_free_slot_is_left_for_load_and_the_chat_follows_its_longest_prefix() -> None:
    c = InMemory()
    chat = Chat("a")
    p = c.send(OPENAI, chat.next_turn())
    other = next(i for i in c.prefills if i is not p)
    p.avail_slots = 0
    assert c.send(OPENAI, chat.next_turn()) is other
    p.avail_slots = 200
    c.settle()
    assert c.send(OPENAI, chat.next_turn()) is other  # it holds the longer prefix now


def test_a_p_with_too_many_requests_waiting_is_left_for_load() -> None:
    c = InMemory()
    chat = Chat("a")
    p = c.send(OPENAI, chat.next_turn())
    other = next(i for i in c.prefills if i is not p)
    other.avail_slots = 300  # load_balance's choice from now on
    c.wait_on(p, BUSY_MARGIN)
    assert c.send(OPENAI, chat.next_turn()) is p  # within the margin: the hit is worth the wait
    c.wait_on(other, 1)
    c.wait_on(p, 1)
    assert c.send(OPENAI, chat.next_turn()) is p  # the margin is over what load_balance's choice has waiting
    c.wait_on(p, 1)
    assert c.send(OPENAI, chat.next_turn()) is other


def test_a_p_that_leaves_the_schedule_is_forgotten() -> None:
    c = InMemory()
    chat = Chat("a")
    p = c.send(OPENAI, chat.next_turn())
    other = next(i for i in c.prefills if i is not p)
    c.send(VLLM, _unrelated(0))
    assert c.scheduler.index.size(p.id) and c.scheduler.index.size(other.id)
    p.reachable = False
    c.scheduler.forget_departed()
    assert c.scheduler.index.size(p.id) == 0 and c.scheduler.index.size(other.id)
    p.reachable = True
    assert c.send(OPENAI, chat.next_turn()) in c.prefills  # by load: nothing is known of the chat


def test_the_relay_routes_a_chat_through_the_coordinator_and_forgets_an_offline_p() -> None:
    async def scenario() -> None:
        async with cluster(n_p=2, n_d=1, algorithm="cache_affinity") as c:
            chat = Chat("a")
            for turn in range(4):
                reply = await c.client.post(c.url + "/v1/chat/completions", json=chat.next_turn())
                assert reply.status_code == 200
                assert (await c.client.post(c.url + "/generate", json=_unrelated(turn))).status_code == 200
            turns = [sum("messages" in json.loads(body) for _, _, body in f.requests) for f in c.prefills]
            assert sorted(turns) == [0, 4]
            assert all(f.requests for f in c.prefills)  # the unrelated prompts went by load
            holder = c.prefills[turns.index(4)]
            p = next(i for i in c.coord.registry.of_role(Role.PREFILL) if i.spec.ip == holder.host)
            manage = c.plane(c.coord.config.manage_port)
            assert c.coord.scheduler.index.size(p.id)
            assert (await c.client.post(manage + "/v1/instances/offline", json={"ids": [p.id]})).status_code == 200
            assert c.coord.scheduler.index.size(p.id) == 0

    asyncio.run(scenario())


def test_a_p_that_stops_answering_its_status_poll_is_forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("mindie.coordinator.instances.STATUS_POLL_S", 60)  # the test polls by itself

    async def scenario() -> None:
        async with cluster(n_p=2, n_d=1, algorithm="cache_affinity") as c:
            assert (await c.client.post(c.url + "/infer", json={"inputs": "restart me " * 20})).status_code == 200
            k, fake = next((k, f) for k, f in enumerate(c.prefills) if f.requests)
            p = next(i for i in c.coord.registry.of_role(Role.PREFILL) if i.spec.ip == fake.host)
            assert c.coord.scheduler.index.size(p.id)
            c.servers[k].should_exit = True
            while p.reachable:
                await c.coord.registry.poll(p)
                await asyncio.sleep(0.01)
            assert c.coord.scheduler.index.size(p.id) == 0

    asyncio.run(scenario())


@pytest.mark.parametrize("algorithm", ["round_robin", "load_balance", "cache_affinity"])
def test_a_preferred_p_is_picked_while_it_has_room(algorithm: str) -> None:
    """A recompute whose media one P holds goes back to it, whatever the algorithm would choose."""
    m = InMemory(algorithm)
    body = json.dumps({"inputs": "x" * 3 * CHUNK_CHARS}).encode()
    chosen = m.send(NATIVE, json.loads(body))
    other = next(p for p in m.prefills if p is not chosen)
    for _ in range(3):
        pair = m.scheduler.pick(NATIVE, body, prefer_p=other)
        assert pair is not None and pair[0] is other
    m.scheduler.limit = 2
    m.wait_on(other, 2)
    pair = m.scheduler.pick(NATIVE, body, prefer_p=other)
    assert pair is not None and pair[0] is chosen  # full: another P (which answers 410 if it must)
