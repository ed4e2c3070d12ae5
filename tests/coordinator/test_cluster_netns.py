"""A PD cluster on three hosts: the coordinator, P and D each in a network namespace of its own at
10.77.0.x, joined by a bridge in a fourth (pd-disaggregation.md C.4 item 3), with real P and D
processes on a tiny model and MindIE's default ports. Greedy answers through the coordinator equal
one mixed instance's; P's link going down while D pulls the KV ends the request within the pull's
and the release's deadlines, and the cluster serves again once the link is back.

The client runs on a thread inside the coordinator's namespace (`Network.threads`) rather than on a
veth of its own: nothing, not even a route, is added to the root namespace, so nothing there can be
left behind or clash with the machine's own 10/8 networks. Needs root; skips where namespaces
cannot be made. Needs the P and D roles in the server (`mindie.server.dmi`).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.netns import NetnsCluster, NetnsUnavailable, Network, RateLimitUnavailable
from helpers.pd_routes import CASES, events
from helpers.server import RunningServer, local_settings

pytest.importorskip("mindie.server.dmi", reason="needs the P and D roles (inferMode dmi)")

KV_TRANS_TIMEOUT = 3  # s, ModelConfig[0].kv_trans_timeout of P and D
# D's downlink while P's goes down: one block of the tiny model's KV (32 KiB in bf16, 64 KiB in
# float32) then takes about 0.9 s (1.8 s) to reach D: well past the moment the link goes down,
# and within the pull's deadline.
DOWNLINK_KBIT = 300


@pytest.fixture(scope="module")
def network() -> Iterator[Network]:
    if shutil.which("setpriv") is None:
        pytest.skip("no `setpriv` (util-linux), which ties the hosts' processes to this one")
    try:
        net = Network.create(NetnsCluster.host_names(1, 1))
    except NetnsUnavailable as exc:
        pytest.skip(f"cannot create network namespaces: {exc}")
    try:
        yield net
    finally:
        net.remove()


@pytest.fixture(scope="module")
def cluster(network: Network, tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetnsCluster]:
    cluster = NetnsCluster(1, 1, model=str(tiny_llama_dir), model_name="tiny", network=network,
                           kv_trans_timeout=KV_TRANS_TIMEOUT, workdir=tmp_path_factory.mktemp("netns-cluster"))
    try:
        cluster.start()
        with network.threads("coordinator") as coordinator_host:
            coordinator_host.submit(cluster.wait_ready, timeout_s=300).result()
        yield cluster
    finally:
        cluster.stop(grace_s=20)
    killed = [name for name, proc in cluster.processes.items() if proc.returncode == -signal.SIGKILL]
    assert not killed, f"{killed} did not stop within the grace after SIGTERM; logs in {cluster.workdir}"


def _post_all(url: str, cases: list[tuple[str, dict[str, Any], bool]]) -> list[httpx.Response]:
    with httpx.Client(trust_env=False, timeout=120) as client:
        return [client.post(url + path, json=body) for path, body, _ in cases]


def _addresses(config: Any) -> Iterator[ipaddress.IPv4Address]:
    """Every IPv4 address a config holds, however deep."""
    if isinstance(config, dict | list):
        for value in config.values() if isinstance(config, dict) else config:
            yield from _addresses(value)
    elif isinstance(config, str):
        with contextlib.suppress(ValueError):
            yield ipaddress.IPv4Address(config)


def test_hosts_answer_as_one_instance(cluster: NetnsCluster, network: Network, tiny_llama_dir: Path) -> None:
    assert cluster.workdir is not None
    # nothing of LocalCluster's loopback layout is left: every address is a host's
    written = {a for path in cluster.workdir.glob("*.json") for a in _addresses(json.loads(path.read_text()))}
    assert written == {ipaddress.IPv4Address(h.ip) for h in network.hosts.values()}
    single = RunningServer(local_settings(str(tiny_llama_dir), model_name="tiny"))
    try:
        expected = _post_all(single.url, CASES)
    finally:
        single.close()
    with network.threads("coordinator") as coordinator_host:
        got = coordinator_host.submit(_post_all, cluster.url, CASES).result()
    for (path, _, stream), pd, one in zip(CASES, got, expected, strict=True):
        assert pd.status_code == one.status_code == 200, (path, stream, pd.text)
        assert pd.headers["content-type"] == one.headers["content-type"]
        assert events(pd.content, path, stream) == events(one.content, path, stream), (path, stream)


def _read_stream(url: str, body: dict[str, Any], started: threading.Event, timeout_s: float) -> tuple[bytes, float]:
    """The whole stream and when it ended; `started` is set once its headers are in, which the
    coordinator sends after P's reply, and P replies after D has taken the request and begun to
    pull (P's own output may be empty: a tiny model's first token is often no whole character).
    No read waits longer than timeout_s, so a stream that hangs fails here rather than blocking."""
    with httpx.Client(trust_env=False, timeout=timeout_s) as client, client.stream("POST", url, json=body) as reply:
        started.set()
        assert reply.status_code == 200, reply.read()
        return reply.read(), time.monotonic()


def _served(url: str, body: dict[str, Any], timeout_s: float) -> httpx.Response:
    """The first answer other than the coordinator's 503 (not ready). A status poll of P that was
    on its way while P's link was down may fail once the link is back (P closed that idle
    connection meanwhile), and the coordinator counts P out until its next poll answers."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(trust_env=False, timeout=timeout_s) as client:
        while (reply := client.post(url, json=body)).status_code == 503 and time.monotonic() < deadline:
            time.sleep(0.2)
        return reply


def _chat(content: str) -> dict[str, Any]:
    return {"model": "tiny", "max_tokens": 32, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": content}]}


def test_p_link_down_during_the_pull_ends_the_request(cluster: NetnsCluster, network: Network) -> None:
    # D's pull must outlast the moment the client sees the stream start, so D's downlink is slowed.
    try:
        network.limit("decode0", DOWNLINK_KBIT)
    except RateLimitUnavailable as exc:
        pytest.skip(f"cannot slow D's link to take P's down during the pull: {exc}")
    # D's pull, begun before the link went down, gives up at its deadline (kv_trans_timeout); then
    # D's release to P gives up at its own (kv_trans_timeout); then the error record crosses the
    # healthy D-coordinator link, for which 3 s is ample even on a busy machine.
    bound = 2 * KV_TRANS_TIMEOUT + 3
    url = cluster.url + "/v1/chat/completions"
    started = threading.Event()
    with network.threads("coordinator") as coordinator_host:
        try:
            # with every link up the slowed pull completes: what fails below is the link's doing
            control = coordinator_host.submit(_served, url, _chat("a short story"), bound).result()
            assert events(control.content, "/v1/chat/completions", True)[-1] == "[DONE]", control.text
            reading = coordinator_host.submit(_read_stream, url, _chat("a long story"), started, bound)
            assert started.wait(30), "the stream did not start"
            network.set_link("prefill0", up=False)
            down_at = time.monotonic()
            raw, ended_at = reading.result(timeout=bound + 5)
        finally:
            network.set_link("prefill0", up=True)
            network.unlimit("decode0")
        assert ended_at - down_at <= bound, f"the stream ended {ended_at - down_at:.1f} s after the link went down"
        last = events(raw, "/v1/chat/completions", True)[-1]
        assert isinstance(last, dict) and "Pull kv failed" in json.dumps(last), last

        # the link is back: once the hosts reach one another again, the cluster serves again
        network.wait_connected(cluster.business_ports(), timeout_s=30)
        again = coordinator_host.submit(_served, url, _chat("a long story"), 30).result()
    assert again.status_code == 200, again.text
    assert events(again.content, "/v1/chat/completions", True)[-1] == "[DONE]", again.text
