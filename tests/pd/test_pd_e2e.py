"""Prefill and decode servers driven by hand, as the coordinator drives them: for every API
family, stream and not, greedy and seeded, P's output followed by D's /dresult bodies is the
single instance's response, byte for byte but for the fields that differ per request anyway (ids,
timestamps, timings, the seed an unseeded request drew). Blocks come back on both sides."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from helpers.pd import (
    DResultReader,
    blocks_back,
    close,
    dmi_settings,
    envelope,
    next_req_id,
    pd_headers,
    pd_pair_of,
    set_role,
    through_pd,
)
from helpers.server import RunningServer

from mindie.pd.records import RecordKind
from mindie.server.dmi import ForcedPreemption

PER_REQUEST = {"id", "created", "seed", "queue_wait_time", "prefill_time", "decode_time", "prefillTime",
               "decodeTime", "first_token_cost", "decode_cost",
               "cached_tokens"}  # prefix-cache hits depend on what each server served before
GREEDY_MINDIE = {"do_sample": False, "max_new_tokens": 7}
SEEDED_MINDIE = {"do_sample": True, "temperature": 0.8, "top_k": 30, "seed": 77, "max_new_tokens": 7,
                 "repetition_penalty": 1.2}
CHAT = [{"role": "user", "content": "tell me"}]


def cases(mindie_params: dict, openai_params: dict) -> list[tuple[str, dict, bool]]:
    """(path, body, stream) for the 11 routes, each stream and non-stream where it has both."""
    out = []
    for stream in (False, True):
        out += [
            ("/infer", {"inputs": "hello world", "stream": stream, "parameters": {**mindie_params, "details": True}},
             stream),
            ("/infer_token", {"input_id": [5, 6, 7, 8], "stream": stream, "parameters": mindie_params}, stream),
            ("/", {"inputs": "abc def", "stream": stream, "parameters": mindie_params}, stream),
            ("/generate", {"prompt": "the cat", "stream": stream, "max_tokens": 7, **openai_params}, stream),
            ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "stream": stream, "max_tokens": 7,
                                      **openai_params}, stream),
            ("/v1/completions", {"model": "tiny", "prompt": "once upon", "stream": stream, "max_tokens": 7,
                                 **openai_params}, stream),
        ]
    out += [
        ("/generate", {"inputs": "abc def", "parameters": {**mindie_params, "details": True}}, False),
        ("/generate_stream", {"inputs": "abc def", "parameters": mindie_params}, True),
        ("/v2/models/tiny/generate", {"text_input": "hi there", "parameters": mindie_params}, False),
        ("/v2/models/tiny/generate_stream", {"text_input": "hi there", "parameters": mindie_params}, True),
        ("/v2/models/tiny/infer", {"inputs": [{"name": "input0", "shape": [1, 4], "datatype": "UINT32",
                                               "data": [3, 4, 5, 6]}], "parameters": mindie_params}, False),
    ]
    return out


def normalize(obj):
    if isinstance(obj, dict):
        return {k: normalize(v) for k, v in obj.items() if k not in PER_REQUEST}
    if isinstance(obj, list):
        return [normalize(v) for v in obj]
    return obj


def same(got: bytes, expected: bytes, path: str, stream: bool, pair: str) -> bool:
    tol = 1e-4 if pair == "recompute_pair" else 0.0
    return close(events(got, path, stream), events(expected, path, stream), tol)


def events(raw: bytes, path: str, stream: bool) -> list:
    """The response as normalized JSON events (stream) or one normalized body."""
    if not stream:
        return [normalize(json.loads(raw))]
    if path == "/generate":  # vLLM: JSON objects each ended by NUL
        return [normalize(json.loads(e)) for e in raw.split(b"\0") if e]
    out = []
    for e in re.split(rb"\n\n", raw):
        if not e:
            continue
        assert e.startswith(b"data:"), e
        payload = e[5:].strip()
        out.append(payload.decode() if payload == b"[DONE]" else normalize(json.loads(payload)))
    return out


PREEMPT_AT = 3


@pytest.fixture(scope="module")
def recompute_pair(tiny_llama_dir):
    """A P/D pair whose D preempts every request handed to it once it has 3 outputs and sends
    it back for recompute (the test hook MINDIE_PD_PREEMPT_AT=3)."""
    for p, d, reader in pd_pair_of(dmi_settings(tiny_llama_dir), dmi_settings(tiny_llama_dir)):
        d.ctx.pd.preemption = ForcedPreemption(PREEMPT_AT)
        yield p, d, reader


def retries(reader) -> int:
    return sum(r.kind is RecordKind.RETRY for r in reader.records)


PAIRS = ["pd_pair", "recompute_pair"]


@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_every_family_through_pd_equals_one_instance(request, pair, single, mode):
    """Through a D that sends every request back for recompute too: the client's answer is the
    same, no token duplicated, lost or reordered."""
    p, d, reader = request.getfixturevalue(pair)
    retried = retries(reader)
    mindie_params, openai_params = (GREEDY_MINDIE, {"temperature": 0}) if mode == "greedy" else (
        SEEDED_MINDIE, {"temperature": 0.8, "top_k": 30, "seed": 77, "frequency_penalty": 0.4})
    handed_off = 0
    for path, body, stream in cases(mindie_params, openai_params):
        expected = httpx.post(single.url + path, json=body, timeout=60)
        assert expected.status_code == 200, (path, expected.text)
        got, went_to_d = through_pd(p, d, reader, path, body, stream)
        handed_off += went_to_d
        assert same(got, expected.content, path, stream, pair), (path, stream, got, expected.content)
        blocks_back(p, d)
    assert handed_off >= 12  # most requests run on both sides, not just on P
    if pair == "recompute_pair":
        assert retries(reader) - retried >= 12  # and were sent back once


def test_token_ids_and_text_equal_greedy(pd_pair, single):
    p, d, reader = pd_pair
    body = {"inputs": [{"name": "input0", "shape": [1, 5], "datatype": "UINT32", "data": [9, 8, 7, 6, 5]}],
            "parameters": {"do_sample": False, "max_new_tokens": 12}}
    expected = httpx.post(single.url + "/v2/models/tiny/infer", json=body, timeout=60).json()
    got, went_to_d = through_pd(p, d, reader, "/v2/models/tiny/infer", body, False)
    assert went_to_d and json.loads(got)["outputs"][0]["data"] == expected["outputs"][0]["data"]
    blocks_back(p, d)


def test_request_that_ends_on_p_goes_nowhere_else(pd_pair, single):
    p, d, reader = pd_pair
    for stream in (False, True):
        body = {"model": "tiny", "prompt": "x y", "max_tokens": 1, "temperature": 0, "stream": stream}
        req_id = next_req_id()
        env = envelope(httpx.post(p.url + "/v1/completions", json=body, headers=pd_headers(req_id, d), timeout=60))
        assert env["isLastResp"] is True and env["isStream"] is stream
        expected = httpx.post(single.url + "/v1/completions", json=body, timeout=60).content
        assert events(env["output"].encode(), "/v1/completions", stream) == events(expected, "/v1/completions", stream)
        if stream:
            assert env["output"].endswith("data: [DONE]\n\n")
        assert all(r.req_id != req_id for r in reader.records)
    blocks_back(p, d)


def test_several_samples_run_whole_on_p(pd_pair, single):
    p, d, reader = pd_pair
    body = {"model": "tiny", "prompt": "ab", "max_tokens": 4, "n": 2, "temperature": 0.7, "seed": 5}
    env = envelope(httpx.post(p.url + "/v1/completions", json=body, headers=pd_headers("77", d), timeout=60))
    expected = httpx.post(single.url + "/v1/completions", json=body, timeout=60).content
    assert env["isLastResp"] is True
    assert events(env["output"].encode(), "/v1/completions", False) == events(expected, "/v1/completions", False)
    blocks_back(p, d)


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"]}}}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "p", "schema": {
    "type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}}


@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_features_mindie_refuses_in_pd_work_here(request, pair, single, stream):
    """Stop strings (with and without include_stop_str_in_output), logprobs, structured output
    and tool calls (the grammar and the tool-call parser continue on D, and after a recompute
    on P and the next D), n > 1 (runs on P)."""
    p, d, reader = request.getfixturevalue(pair)
    base = {"model": "tiny", "prompt": "stop here", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    text = httpx.post(single.url + "/v1/completions", json=base, timeout=60).json()["choices"][0]["text"]
    stop = text[4:6]
    assert stop.strip() and text.find(stop) >= 3  # the stop string ends the request on D
    bodies = [
        ("/v1/completions", {**base, "stop": [stop]}),
        ("/v1/completions", {**base, "stop": [stop], "include_stop_str_in_output": True}),
        ("/v1/completions", {**base, "logprobs": 3}),
        ("/v1/completions", {**base, "n": 2, "temperature": 0.9, "seed": 4}),
        ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 40, "temperature": 0.9,
                                  "seed": 11, "logprobs": True, "top_logprobs": 2}),
        ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 40, "temperature": 1.0,
                                  "seed": 3, "response_format": SCHEMA}),
        ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 200, "temperature": 1.0,
                                  "seed": 5, "tools": [TOOL], "tool_choice": "required"}),
    ]
    for path, body in bodies:
        body = {**body, "stream": stream}
        expected = httpx.post(single.url + path, json=body, timeout=60)
        assert expected.status_code == 200, expected.text
        got, _ = through_pd(p, d, reader, path, body, stream)
        assert same(got, expected.content, path, stream, pair), (body, got, expected.content)
        blocks_back(p, d)


def test_link_status_after_a_handoff(pd_pair):
    p, d, reader = pd_pair
    body = {"model": "tiny", "prompt": "link", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    assert through_pd(p, d, reader, "/v1/completions", body, False)[1]
    for server in (p, d):
        peers = httpx.get(server.management_url + "/v1/status").json()["linkStatus"]["peers"]
        assert peers == [{"target": "127.0.0.1", "link": "success"}]


def test_two_prefills_and_two_decodes(pd_pair, single, tiny_llama_dir):
    """2P1D and 1P2D: each P sends to the D its d-target names, each D pulls from the P that
    sent it, and every /dresult stream carries only its own requests."""
    p1, d1, reader1 = pd_pair
    p2, d2 = RunningServer(dmi_settings(tiny_llama_dir)), RunningServer(dmi_settings(tiny_llama_dir))
    reader2 = None
    try:
        assert set_role(p2, "prefill", ["127.0.0.1"]).status_code == 200
        assert set_role(d2, "decode", ["127.0.0.1"]).status_code == 200
        reader2 = DResultReader(d2)
        body = {"model": "tiny", "prompt": "two by two", "max_tokens": 9, "temperature": 0, "stream": True}
        expected = events(httpx.post(single.url + "/v1/completions", json=body, timeout=60).content,
                          "/v1/completions", True)
        for p, d, reader in ((p1, d1, reader1), (p1, d2, reader2), (p2, d1, reader1), (p2, d2, reader2)):
            got, went_to_d = through_pd(p, d, reader, "/v1/completions", body, True)
            assert went_to_d and events(got, "/v1/completions", True) == expected
        own = {r.req_id for r in reader2.records if r.req_id is not None}
        assert own and not own & {r.req_id for r in reader1.records}
        blocks_back(p1, p2, d1, d2)
    finally:
        if reader2 is not None:
            reader2.close()
        p2.close()
        d2.close()
