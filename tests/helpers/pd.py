"""A hand-driven coordinator for the PD tests: dmi settings sharing a token, role assignment, the
PD headers, P's envelope, and a reader of D's /dresult records."""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import httpx

from helpers.server import RunningServer, free_port, local_settings
from mindie.pd.records import Record, RecordDecoder, RecordKind

TOKEN = "test-token"


def dmi_settings(model_dir, **changes):
    base = local_settings(str(model_dir), dtype="float32", model_name="tiny")
    return replace(base, infer_mode="dmi", inter_comm_port=free_port(), kv_transfer_port=0,
                   inter_comm_token=TOKEN, **changes)


def pd_pair_of(p_settings, d_settings) -> Iterator[tuple[RunningServer, RunningServer, DResultReader]]:
    """A prefill and a decode server with their roles set, and a reader of D's /dresult (a fixture body)."""
    p, d = RunningServer(p_settings), RunningServer(d_settings)
    assert set_role(p, "prefill", ["127.0.0.1"]).status_code == 200
    assert set_role(d, "decode", ["127.0.0.1"]).status_code == 200
    reader = DResultReader(d)
    yield p, d, reader
    reader.close()
    p.close()
    d.close()


def set_role(server: RunningServer, role: str, peers: list[str]) -> httpx.Response:
    body = {"local": {"server_ip": "127.0.0.1", "device": []},
            "peers": [{"server_ip": ip, "device": []} for ip in peers]}
    return httpx.post(f"{server.management_url}/v1/role/{role}", json=body)


class DResultReader:
    """Reads one D's /dresult stream on a thread, keeping every record and each raw HTTP chunk."""

    def __init__(self, server: RunningServer) -> None:
        self.records: list[Record] = []
        self.chunks: list[bytes] = []
        self._cond = threading.Condition()
        self._client = httpx.Client(timeout=None)
        self._response = self._client.send(self._client.build_request("GET", f"{server.url}/dresult"), stream=True)
        assert self._response.status_code == 200
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        decoder = RecordDecoder()
        try:
            for chunk in self._response.iter_raw():
                with self._cond:
                    self.chunks.append(chunk)
                    self.records += list(decoder.feed(chunk))
                    self._cond.notify_all()
        except (httpx.HTTPError, RuntimeError):
            pass

    def until(self, req_id: str, timeout: float = 30, skip: int = 0) -> list[Record]:
        """The records of req_id, past the first `skip` of them, up to its lastData, error or retry."""
        ends = (RecordKind.LAST_DATA, RecordKind.ERROR, RecordKind.RETRY)

        def mine() -> list[Record]:
            return [r for r in self.records if r.req_id == req_id][skip:]

        with self._cond:
            assert self._cond.wait_for(lambda: any(r.kind in ends for r in mine()), timeout), \
                f"no end for {req_id}: {self.records[-5:]}"
            return mine()

    def close(self) -> None:
        self._response.close()
        self._client.close()


def pd_headers(req_id: str, d: RunningServer) -> dict[str, str]:
    return {"req-id": req_id, "req-type": "prefill", "d-target": f"127.0.0.1;{d.settings.inter_comm_port}",
            "d-port": str(d.settings.port)}


def envelope(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return json.loads(response.text)


def close(a: Any, b: Any, tol: float) -> bool:
    """Equal, but for floats within `tol`: a recompute computes the KV of tokens that decode steps
    made as prompt rows, which round differently, so a logprob may differ in its last digits."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= tol
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k], tol) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(close(x, y, tol) for x, y in zip(a, b))
    return a == b


def blocks_back(*servers: RunningServer, timeout: float = 5) -> None:
    """Waits until no KV block is in use on any of the servers (in-process ones)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if all(s.ctx.engine.stats.used_blocks == 0 for s in servers):
            return
        time.sleep(0.02)
    raise AssertionError([s.ctx.engine.stats for s in servers])


_ids = itertools.count(1000)


def next_req_id() -> str:
    """A request id no other test request of this process has."""
    return str(next(_ids))


def through_pd(p, d, reader, path: str, body: dict, stream: bool) -> tuple[bytes, bool]:
    """P's output and D's record bodies joined, a D's retry: sent back to P with is-recompute as
    the coordinator does; and whether the request went to D at all."""
    req_id = next_req_id()
    headers = {**pd_headers(req_id, d), "content-type": "application/json"}
    payload, output, went_to_d, seen = json.dumps(body).encode(), b"", False, 0
    while True:
        env = envelope(httpx.post(p.url + path, content=payload, headers=headers, timeout=60))
        assert env["reqId"] == req_id and env["isStream"] is stream
        if env.get("isLastResp"):
            return output + env["output"].encode(), went_to_d
        assert env == ({"reqId": req_id, "isStream": True, "isLastResp": False, "output": env["output"]} if stream
                       else {"reqId": req_id, "isStream": False})
        output += env.get("output", "").encode()
        records = reader.until(req_id, skip=seen)
        seen += len(records)
        went_to_d = True
        kinds = [r.kind for r in records]
        assert set(kinds[:-1]) <= {RecordKind.DATA} and kinds[-1] is not RecordKind.ERROR, records
        if not stream:
            assert len(records) == 1
        output += b"".join(r.body for r in records[:-1] if stream)
        if kinds[-1] is RecordKind.RETRY:
            payload, headers = records[-1].body, {**headers, "is-recompute": "true"}
            continue
        return output + records[-1].body, True
