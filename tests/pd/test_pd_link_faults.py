"""The KV link between P and D under faults, with a fault proxy standing between D and P's KV
transfer listener: a link that stops moving bytes (not closed) is caught by kv_trans_timeout, not
by TCP; a link cut mid-pull fails at once; a slow one still delivers. Either way D answers an
error record for the request, frees its blocks and P's, and marks the link; the next request on a
healthy link succeeds and marks it good again."""

from __future__ import annotations

import time

import httpx
import pytest
from helpers.fault_proxy import FaultProxy, Mode
from helpers.pd import blocks_back, dmi_settings, envelope, pd_headers, pd_pair_of

from mindie.pd.records import RecordKind

KV_TIMEOUT_S = 1.0
BODY = {"model": "tiny", "prompt": "a link under test", "max_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def faulty_link(tiny_llama_dir):
    settings = dmi_settings(tiny_llama_dir, kv_trans_timeout_s=KV_TIMEOUT_S)
    for p, d, reader in pd_pair_of(settings, dmi_settings(tiny_llama_dir, kv_trans_timeout_s=KV_TIMEOUT_S)):
        transport = p.ctx.pd.transport
        host, _, port = transport.addr.rpartition(":")
        proxy = FaultProxy((host, int(port)))
        real, transport.addr = transport.addr, proxy.addr  # D is told to pull through the proxy
        yield p, d, reader, proxy
        transport.addr = real
        proxy.close()


_ids = iter(range(5000, 6000))


def send(p, d, reader) -> tuple[list, float]:
    """D's records for one request P handed off, and the seconds from P's answer to D's last record."""
    req_id = str(next(_ids))
    envelope(httpx.post(p.url + "/v1/completions", json=BODY, headers=pd_headers(req_id, d), timeout=30))
    handed = time.monotonic()
    records = reader.until(req_id, timeout=10 * KV_TIMEOUT_S)
    return records, time.monotonic() - handed


def link_state(server) -> str:
    return httpx.get(server.management_url + "/v1/status").json()["linkStatus"]["peers"][0]["link"]


def test_a_stalled_link_is_caught_by_the_deadline_then_recovers(faulty_link):
    p, d, reader, proxy = faulty_link
    proxy.set(Mode.STALL)
    records, took = send(p, d, reader)
    assert [r.kind for r in records] == [RecordKind.ERROR] and records[0].body == b"Pull kv failed reversibly."
    assert KV_TIMEOUT_S * 0.9 <= took < KV_TIMEOUT_S + 2  # the deadline, not TCP's minutes
    blocks_back(p, d)
    assert link_state(d) == "failed"
    proxy.set(Mode.PASS)
    records, _ = send(p, d, reader)
    assert records[-1].kind is RecordKind.LAST_DATA
    blocks_back(p, d)
    assert link_state(d) == "success"


def test_a_link_cut_mid_pull_fails_at_once(faulty_link):
    p, d, reader, proxy = faulty_link
    proxy.set(Mode.STALL)
    before = proxy.connections
    req_id = str(next(_ids))
    envelope(httpx.post(p.url + "/v1/completions", json=BODY, headers=pd_headers(req_id, d), timeout=30))
    while proxy.connections == before:  # D is pulling
        time.sleep(0.01)
    cut = time.monotonic()
    proxy.set(Mode.CUT)
    records = reader.until(req_id, timeout=10 * KV_TIMEOUT_S)
    assert [r.kind for r in records] == [RecordKind.ERROR] and records[0].body.startswith(b"Pull kv failed")
    assert time.monotonic() - cut < KV_TIMEOUT_S * 0.9  # the reset, not the deadline
    blocks_back(p, d)
    proxy.set(Mode.PASS)


def test_a_slow_link_still_delivers(faulty_link):
    p, d, reader, proxy = faulty_link
    proxy.set(Mode.PASS)
    proxy.delay_s = 0.05
    try:
        records, _ = send(p, d, reader)
    finally:
        proxy.delay_s = 0.0
    assert [r.kind for r in records][-1] is RecordKind.LAST_DATA
    blocks_back(p, d)
