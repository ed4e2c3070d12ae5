"""`mindie cluster` with real P and D instances (processes on 127.0.9.x, a tiny model): greedy
answers through the coordinator equal one mixed instance's, stream and not, for each framing; a
client that goes away mid-stream leaves no KV block in use on P or D.
Needs the P and D roles in the server (`mindie.server.dmi`)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fakes import free_port
from helpers.pd_routes import CASES, events
from helpers.server import RunningServer, local_settings

from mindie.coordinator.cluster import InstancePlan, LocalCluster

pytest.importorskip("mindie.server.dmi", reason="needs the P and D roles (inferMode dmi)")

def _running(cluster: LocalCluster) -> Iterator[LocalCluster]:
    """A fixture body: the cluster started, ready, and stopped afterwards."""
    cluster.start()
    try:
        cluster.wait_ready(timeout_s=300)
        yield cluster
    finally:
        cluster.stop(grace_s=20)


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    yield from _running(LocalCluster(1, 1, model=str(tiny_llama_dir), model_name="tiny", port=free_port("127.0.0.1"),
                                     instance_port=free_port("127.0.9.2"), first_ip="127.0.9.2",
                                     workdir=tmp_path_factory.mktemp("cluster")))


def test_pd_cluster_answers_as_one_instance(cluster: LocalCluster, tiny_llama_dir: Path) -> None:
    single = RunningServer(local_settings(str(tiny_llama_dir), model_name="tiny"))
    try:
        with httpx.Client(trust_env=False, timeout=120) as client:
            for path, body, stream in CASES:
                pd = client.post(cluster.url + path, json=body)
                one = client.post(single.url + path, json=body)
                assert pd.status_code == one.status_code == 200, (path, stream, pd.text)
                assert pd.headers["content-type"] == one.headers["content-type"]
                assert events(pd.content, path, stream) == events(one.content, path, stream), (path, stream)
    finally:
        single.close()


def _metric(client: httpx.Client, inst: InstancePlan, name: str) -> float:
    """A metric of the instance; 0 for a counter with no sample yet."""
    text = client.get(f"http://{inst.ip}:{inst.metrics_port}/metrics").text
    found = re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


@pytest.fixture(scope="module")
def default_model_cluster(tmp_path_factory: pytest.TempPathFactory):
    """1P1D on the embedded default model: a few ms per token, so a long request is still running
    when a stop arrives (the tiny model writes 480 tokens in about 0.1 s)."""
    yield from _running(LocalCluster(1, 1, port=free_port("127.0.0.1"), instance_port=free_port("127.0.9.12"),
                                     first_ip="127.0.9.12", workdir=tmp_path_factory.mktemp("default-cluster")))


def test_client_disconnect_frees_every_block_on_p_and_d(default_model_cluster: LocalCluster) -> None:
    cluster = default_model_cluster
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "a b c", "max_tokens": 480, "temperature": 0,
            "ignore_eos": True, "stream": True}
    p, d = cluster.instances
    with httpx.Client(trust_env=False, timeout=60) as client:
        with client.stream("POST", cluster.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            lines = r.iter_lines()
            for _ in range(3):  # three tokens: D is decoding it
                while not next(lines).startswith("data: "):
                    pass
            assert _metric(client, d, "npu_cache_usage_perc") > 0
            before = [_metric(client, d, f"request_{end}_total") for end in ("failed", "success")]
        # the client has gone: the coordinator stops the request on P and D
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            usage = [_metric(client, i, "npu_cache_usage_perc") for i in (p, d)]
            ends = [_metric(client, d, f"request_{end}_total") for end in ("failed", "success")]
            if usage == [0.0, 0.0] and ends != before:
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"KV blocks in use on P, D: {usage}; D's failed, successful requests: {ends}")
        # Usually D counts it as cancelled ([+1, +0]); in about 1 run in 9 of this module the
        # coordinator noticed the disconnect only when the stream ended (D had finished), so the
        # request's end is not asserted here: what is, is that no block stays held.
        assert sum(ends) == sum(before) + 1
