"""`mindie cluster` with real P and D instances (processes on 127.0.9.x, a tiny model): greedy
answers through the coordinator equal one mixed instance's, stream and not, for each framing; a
client that goes away mid-stream leaves no KV block in use on P or D.
Needs the P and D roles in the server (`mindie.server.dmi`)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from helpers.cluster import log_tails, metric, on_free_ports, running
from helpers.pd import close
from helpers.pd_routes import CASES, events
from helpers.server import RunningServer, local_settings

from mindie.coordinator.cluster import LocalCluster
from mindie.server.dmi import PREEMPT_ENV

pytest.importorskip("mindie.server.dmi", reason="needs the P and D roles (inferMode dmi)")



@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    yield from running(on_free_ports(LocalCluster(1, 1, model=str(tiny_llama_dir), model_name="tiny",
                                                  first_ip="127.0.9.2", workdir=tmp_path_factory.mktemp("cluster"))))


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


@pytest.fixture(scope="module")
def recompute_cluster(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """1P1D whose D sends every request back for recompute once it has 3 outputs (the test hook)."""
    yield from running(on_free_ports(LocalCluster(1, 1, model=str(tiny_llama_dir), model_name="tiny",
                                                  first_ip="127.0.9.22",
                                                  workdir=tmp_path_factory.mktemp("recompute-cluster"),
                                                  role_env={"decode": {PREEMPT_ENV: "3"}})))


def test_a_request_d_sends_back_for_recompute_answers_as_one_instance(recompute_cluster: LocalCluster,
                                                                     tiny_llama_dir: Path) -> None:
    """The coordinator re-dispatches it with is-recompute; the client sees one unbroken answer."""
    cluster = recompute_cluster
    single = RunningServer(local_settings(str(tiny_llama_dir), model_name="tiny"))
    d = cluster.instances[1]
    try:
        with httpx.Client(trust_env=False, timeout=120) as client:
            before = metric(client, d, "num_preemptions_total")
            for path, body, stream in CASES:
                pd = client.post(cluster.url + path, json=body)
                one = client.post(single.url + path, json=body)
                assert pd.status_code == one.status_code == 200, (path, stream, pd.text)
                assert close(events(pd.content, path, stream), events(one.content, path, stream), 1e-4), (
                    path, stream, pd.content, one.content)
            assert metric(client, d, "num_preemptions_total") - before >= len(CASES) - 1
    finally:
        single.close()


LONG = 2000  # tokens: about 10 s of the default model's decoding on two cores


@pytest.fixture(scope="module")
def default_model_cluster(tmp_path_factory: pytest.TempPathFactory):
    """1P1D on the embedded default model: a few ms per token, so a long request is still running
    when a stop arrives (the tiny model writes thousands of tokens in a second)."""
    yield from running(on_free_ports(LocalCluster(1, 1, first_ip="127.0.9.12",
                                                  workdir=tmp_path_factory.mktemp("default-cluster"),
                                                  schedule_config={"maxIterTimes": LONG})))


def test_client_disconnect_frees_every_block_on_p_and_d(default_model_cluster: LocalCluster) -> None:
    cluster = default_model_cluster
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "a b c", "max_tokens": LONG, "temperature": 0,
            "ignore_eos": True, "stream": True}
    p, d = cluster.instances
    with httpx.Client(trust_env=False, timeout=60) as client:
        before = [metric(client, d, f"request_{end}_total") for end in ("failed", "success")]
        with client.stream("POST", cluster.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            lines = r.iter_lines()
            for _ in range(3):  # three tokens: D is decoding it
                while not next(lines).startswith("data: "):
                    pass
        # the client has gone: the coordinator stops the request on P and D
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            usage = [metric(client, i, "npu_cache_usage_perc") for i in (p, d)]
            ends = [metric(client, d, f"request_{end}_total") for end in ("failed", "success")]
            if usage == [0.0, 0.0] and ends != before:
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"KV blocks in use on P, D: {usage}; D's failed, successful requests: {ends}")
        # cancelled on D, long before its LONG tokens (it failed about once in ten while the relay
        # waited for records with asyncio.wait_for, which can swallow a cancel: see relay.within)
        assert ends == [before[0] + 1, before[1]], log_tails(cluster)
