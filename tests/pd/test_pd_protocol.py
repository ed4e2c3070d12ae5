"""The PD wire as the coordinator and the peers see it: roles and their errors, P's header
checks and envelope errors, D's /dresult framing (whole records per chunk, heartbeat, close on a
second GET, a vLLM event's own NUL), the inter-instance token and peer list, the KV layout check,
P's lease when D never pulls, stopInfer on D (also before P hands the request over), and D waiting
for free blocks rather than failing."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from helpers.pd import TOKEN, DResultReader, blocks_back, dmi_settings, envelope, pd_headers, pd_pair_of, set_role
from helpers.server import RunningServer, free_port

from mindie.engine.commands import DropReserved
from mindie.engine.request import RequestOutput
from mindie.pd.http import TOKEN_HEADER
from mindie.pd.params import DecodeParams
from mindie.pd.records import CLOSE_REQ_ID, HEARTBEAT, RecordKind
from mindie.pd.transport import KVHandle
from mindie.server.results import StreamItem

COMPLETION = {"model": "tiny", "prompt": "hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def fresh(tiny_llama_dir):
    """A dmi server with no role yet, a short lease (kv_trans_timeout 0.5 s) and a 0.3 s heartbeat."""
    server = RunningServer(dmi_settings(tiny_llama_dir, kv_trans_timeout_s=0.5, dresult_heartbeat_s=0.3))
    yield server
    server.close()


class _SilentD(BaseHTTPRequestHandler):
    """A decode peer that accepts every request and never pulls."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        body = json.dumps({"isValidDecodeParameters": True, "errorMessage": ""}).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_roles_status_and_unknown_state(fresh):
    r = httpx.post(fresh.url + "/v1/completions", json=COMPLETION)
    assert r.status_code == 503
    assert r.json()["error"]["message"] == "The server cannot process the inference request due to an unknown status."
    status = httpx.get(fresh.management_url + "/v1/status").json()
    assert status["service"] == {"roleStatus": "RoleUnknown", "currentRole": "none"}
    for bad in (b"not json", b'{"local": {}}', b'{"local": {"server_ip": "x"}, "peers": []}',
                b'{"local": {"server_ip": "127.0.0.1"}, "peers": {}}'):
        r = httpx.post(fresh.management_url + "/v1/role/prefill", content=bad)
        assert r.status_code == 422
        assert r.json()["error"] == "Req body converts to json fail. Reset to previous node status."
    assert httpx.post(fresh.management_url + "/v2/role/flex", json={}).status_code == 404
    v2 = {"local": [{"server_ip": "127.0.0.1"}], "peers": [{"server_ip": "127.0.0.7", "dp_inst_list": []}]}
    assert httpx.post(fresh.management_url + "/v2/role/decode", json=v2).status_code == 200
    status = httpx.get(fresh.management_url + "/v2/status").json()
    assert status["service"] == {"roleStatus": "RoleReady", "currentRole": "decode"}
    assert status["linkStatus"]["peers"] == [{"target": "127.0.0.7", "link": "waiting"}]
    r = httpx.post(fresh.url + "/infer", json={"inputs": "x"})
    assert r.status_code == 400 and "only to the prefill node" in r.json()["error"]
    assert set_role(fresh, "prefill", ["127.0.0.1"]).status_code == 200
    assert httpx.get(fresh.url + "/dresult").json()["error"] == \
        "Only the Decode node supports dresult but you send to prefill"


def test_dresult_needs_dmi(single):
    r = httpx.get(single.url + "/dresult")
    assert r.status_code == 400 and r.json()["error"] == "Non DMI does not support dresult request"


@pytest.mark.parametrize("headers, status, needle", [
    ({}, 400, "DMI request must have req-type, req-id, d-target headers"),
    ({"req-id": "12x"}, 400, "Invalid req-id"),
    ({"req-id": "1" * 1025}, 400, "Invalid req-id"),
    ({"req-type": "decode"}, 400, "Parameter req-type must be prefill but got decode"),
    ({"d-target": "host.example"}, 400, "Parameter d-target must be an IPv4 address"),
    ({"d-target": "::1"}, 400, "Parameter d-target must be an IPv4 address"),
    ({"d-target": "127.0.0.1;70000"}, 400, "Parameter d-target must be an IPv4 address"),
    ({"is-recompute": "yes"}, 400, "Parameter is-recompute is an optional parameter"),
    ({"is-recompute": "true"}, 400, "is-recompute: a recompute body needs the mindieContinuation field"),
    ({"d-target": "10.0.0.9"}, 400, "not a decode peer"),
])
def test_p_header_errors_name_the_header(pd_pair, headers, status, needle):
    p, d, _ = pd_pair
    sent = {**pd_headers("5", d), **headers} if headers else {}
    r = httpx.post(p.url + "/infer", json={"inputs": "x"}, headers=sent)
    assert r.status_code == status and needle in r.json()["error"], r.text
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
    r = httpx.post(p.url + "/v1/chat/completions", json=chat, headers=sent)
    assert r.status_code == status and needle in r.json()["error"]["message"]  # the family's error shape


def test_send_to_d_fails_frees_the_blocks(pd_pair):
    p, d, _ = pd_pair
    headers = {**pd_headers("6", d), "d-target": f"127.0.0.1;{free_port()}"}
    r = httpx.post(p.url + "/v1/completions", json=COMPLETION, headers=headers, timeout=30)
    message = r.json()["error"]["message"]
    assert r.status_code == 500 and message == "[P Node] Send D request failed:connection refused"  # no address
    blocks_back(p)


def test_lease_expiry_frees_blocks_when_d_never_pulls(fresh):
    silent = ThreadingHTTPServer(("127.0.0.1", 0), _SilentD)
    threading.Thread(target=silent.serve_forever, daemon=True).start()
    try:
        assert set_role(fresh, "prefill", ["127.0.0.1"]).status_code == 200
        headers = {"req-id": "99", "req-type": "prefill", "d-target": f"127.0.0.1;{silent.server_address[1]}"}
        env = envelope(httpx.post(fresh.url + "/v1/completions", json={**COMPLETION, "stream": True},
                                  headers=headers, timeout=30))
        assert env["isLastResp"] is False
        assert fresh.ctx.engine.stats.used_blocks > 0  # pinned for D
        again = httpx.post(fresh.url + "/v1/completions", json=COMPLETION, headers=headers, timeout=30)
        assert again.status_code == 400 and "still held" in again.json()["error"]["message"]
        blocks_back(fresh, timeout=5)  # the lease is 2 x 0.5 s
        assert "99" not in fresh.ctx.pd.leases
    finally:
        silent.shutdown()


def _decode_body(layout, **changes) -> dict:
    out = RequestOutput("1", 0, [7], "a", [], None, 3, 1, -0.5, 1, [1], [0.0], 0.01)
    params = DecodeParams(req_id="1", msg_type="/infer", path="/infer", body='{"inputs":"abc"}', is_stream=False,
                          tokens=[1, 2, 3], first_token=[7], first_items=[StreamItem(out, 10.0, None)], seed=1,
                          cumulative_logprob=-0.5, renderer_state={}, kv=KVHandle("1", "127.0.0.1:1", [0]),
                          layout=layout, p_node_addr="127.0.0.1:1", metrics={})
    return {**params.to_json(), **changes}


def test_decode_call_needs_token_peer_and_a_matching_layout(pd_pair):
    p, d, _ = pd_pair
    url = f"http://127.0.0.1:{d.settings.inter_comm_port}/pd/v1/decode"
    layout = d.ctx.pd.layout
    r = httpx.post(url, json=_decode_body(layout))
    assert r.status_code == 401 and r.json()["isValidDecodeParameters"] is False
    assert "token" in r.json()["errorMessage"]
    r = httpx.post(url, json=_decode_body(layout), headers={TOKEN_HEADER: "wrong"})
    assert r.status_code == 401
    other = dataclasses.replace(layout, num_layers=layout.num_layers + 1)
    r = httpx.post(url, json=_decode_body(other), headers={TOKEN_HEADER: TOKEN})
    assert r.status_code == 409 and r.json() == {"isValidDecodeParameters": False, "errorMessage":
                        f"KV layout mismatch: num_layers is {layout.num_layers} here but {layout.num_layers + 1} "
                        "on the peer"}
    r = httpx.post(url, json=_decode_body(layout, tokens="x"), headers={TOKEN_HEADER: TOKEN})
    assert r.json()["isValidDecodeParameters"] is False and "tokens" in r.json()["errorMessage"]
    release = f"http://127.0.0.1:{p.settings.inter_comm_port}/pd/v1/release"
    assert httpx.post(release, json={"reqId": "1"}).status_code == 401
    assert httpx.post(release, json={"reqId": "1"}, headers={TOKEN_HEADER: TOKEN}).json() == \
        {"reqId": "1", "released": False}
    blocks_back(d)


def test_pull_failure_is_an_error_record_and_frees_d(pd_pair):
    p, d, reader = pd_pair
    body = _decode_body(d.ctx.pd.layout, reqId="4242")
    body["kvAddr"] = f"127.0.0.1:{free_port()}"  # nobody serves the KV there
    r = httpx.post(f"http://127.0.0.1:{d.settings.inter_comm_port}/pd/v1/decode", json=body,
                   headers={TOKEN_HEADER: TOKEN})
    assert r.json() == {"isValidDecodeParameters": True, "errorMessage": ""}
    [record] = reader.until("4242")
    assert record.kind is RecordKind.ERROR and record.body == b"Pull kv failed reversibly."
    blocks_back(d)


def push(server: RunningServer, records: bytes) -> None:
    """Pushes records on the server's own event loop, as its decode tasks do."""
    server.call_soon(server.ctx.pd.dispatcher.push, records)


def test_dresult_framing_heartbeat_and_close(fresh):
    assert set_role(fresh, "decode", ["127.0.0.1"]).status_code == 200
    first = DResultReader(fresh)
    try:
        time.sleep(0.8)
        assert first.chunks and all(c == HEARTBEAT for c in first.chunks)  # silence: keep-alives only
        # records pushed by a request: each chunk holds whole records, a vLLM event keeps its NUL
        vllm_event = b'{"text":["a"]}\0'
        push(fresh, b"reqId:5\0data:" + vllm_event + b"\0")
        push(fresh, b"reqId:5\0lastData:" + vllm_event + b"\0")
        records = first.until("5")
        assert [(r.kind, r.body) for r in records] == [(RecordKind.DATA, vllm_event),
                                                       (RecordKind.LAST_DATA, vllm_event)]
        assert all(c.endswith(b"\0") for c in first.chunks)
        second = DResultReader(fresh)
        try:
            deadline = time.monotonic() + 5
            while not any(r.kind is RecordKind.CLOSE for r in first.records) and time.monotonic() < deadline:
                time.sleep(0.02)
            close = [r for r in first.records if r.kind is RecordKind.CLOSE]
            assert close and close[0].req_id == CLOSE_REQ_ID
            assert close[0].body == b"new connection is to established, close the old one."
            push(fresh, b"reqId:6\0lastData:x\0")
            assert [r.body for r in second.until("6")] == [b"x"]
        finally:
            second.close()
    finally:
        first.close()


def test_records_wait_for_a_stream(fresh):
    assert set_role(fresh, "decode", ["127.0.0.1"]).status_code == 200
    deadline = time.monotonic() + 5
    while fresh.ctx.pd.dispatcher.connected and time.monotonic() < deadline:
        time.sleep(0.02)  # the earlier readers' streams notice they are gone
    assert not fresh.ctx.pd.dispatcher.connected
    push(fresh, b"reqId:8\0lastData:queued\0")
    reader = DResultReader(fresh)
    try:
        assert [r.body for r in reader.until("8")] == [b"queued"]
    finally:
        reader.close()


def test_stop_infer_on_d_aborts_the_request(pd_pair):
    p, d, reader = pd_pair
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    envelope(httpx.post(p.url + "/v1/completions", json=body, headers=pd_headers("31337", d), timeout=30))
    r = httpx.post(d.url + "/v2/models/tiny/stopInfer", json={"id": "31337"})
    assert r.status_code == 200, r.text
    records = reader.until("31337")
    last, tail = (json.loads(r.body.removeprefix(b"data: ")) for r in records[-3:-1])
    assert records[-1].body == b"data: [DONE]\n\n" and last["choices"][0]["finish_reason"] == "stop"
    assert tail["choices"] == [] and tail["usage"]["completion_tokens"] < 200
    blocks_back(p, d)


def test_stop_before_the_handoff_refuses_it(pd_pair):
    # The coordinator stops P and D at once; D may hear of the request only afterwards.
    p, d, _ = pd_pair
    assert httpx.post(d.url + "/v2/models/tiny/stopInfer", json={"id": "5150"}).status_code == 404
    r = httpx.post(p.url + "/v1/completions", json=COMPLETION, headers=pd_headers("5150", d), timeout=30)
    assert r.status_code == 500 and "stopped (stopInfer) before it reached this node" in r.json()["error"]["message"]
    blocks_back(p, d)
    envelope(httpx.post(p.url + "/v1/completions", json=COMPLETION, headers=pd_headers("5151", d), timeout=30))


@pytest.fixture(scope="module")
def small_d(tiny_llama_dir):
    """P and a decode node with 8 blocks of 16 positions."""
    base = dmi_settings(tiny_llama_dir)
    small = dataclasses.replace(base, engine=dataclasses.replace(base.engine, num_kv_blocks=8))
    yield from pd_pair_of(dmi_settings(tiny_llama_dir), small)


def test_decode_waits_for_free_blocks(small_d):
    p, d, reader = small_d
    hog = d.run(d.ctx.engine.reserve_kv("hog", list(range(8 * 16)), 8 * 16))  # every block
    assert hog is not None and d.ctx.engine.stats.free_blocks == 0
    try:
        env = envelope(httpx.post(p.url + "/v1/completions", json={**COMPLETION, "stream": True},
                                  headers=pd_headers("808", d), timeout=30))
        assert env["isLastResp"] is False  # D took the request though it has no block free now
        time.sleep(0.3)
        assert not any(r.req_id == "808" for r in reader.records)
    finally:
        d.ctx.engine.submit(DropReserved("hog"))
    records = reader.until("808")
    assert [r.kind for r in records][-1] is RecordKind.LAST_DATA and records[-1].body == b"data: [DONE]\n\n"
    blocks_back(p, d)


def test_decode_refuses_what_its_pool_can_never_hold(small_d):
    p, d, _ = small_d
    long = {**COMPLETION, "prompt": [5] * 200}  # 13 blocks of 16 for the prompt alone
    r = httpx.post(p.url + "/v1/completions", json=long, headers=pd_headers("909", d), timeout=30)
    assert r.status_code == 500 and "this instance has 8 in all" in r.json()["error"]["message"], r.text
    blocks_back(p, d)
