"""`mindie cluster`: the configs it writes, and a whole cluster of processes (the real coordinator,
fake instances) started, used and stopped."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest
from helpers.cluster import on_free_ports

from mindie.coordinator.cluster import LocalCluster
from mindie.coordinator.config import CoordinatorConfig, Role

FAKE_MAIN = Path(__file__).with_name("fake_instance_main.py")


def test_configs(tmp_path: Path) -> None:
    cluster = LocalCluster(2, 1, model="/models/m.gguf", workdir=tmp_path)
    cluster.write()
    coordinator = CoordinatorConfig.from_file(str(tmp_path / "ms_coordinator.json"))
    assert (coordinator.predict_ip, coordinator.predict_port, coordinator.status_port) == ("127.0.0.1", 1025, 1029)
    assert [(i.role, i.ip, i.port, i.mgmt_port, i.d_target) for i in coordinator.instances] == [
        (Role.PREFILL, "127.0.0.2", 1025, 1026, "127.0.0.2;1121"),
        (Role.PREFILL, "127.0.0.3", 1025, 1026, "127.0.0.3;1121"),
        (Role.DECODE, "127.0.0.4", 1025, 1026, "127.0.0.4;1121")]
    configs = [json.loads((tmp_path / f"{i.name}.json").read_text()) for i in cluster.instances]
    servers = [c["ServerConfig"] for c in configs]
    assert [s["ipAddress"] for s in servers] == ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    assert all(s["inferMode"] == "dmi" and s["interCommPort"] == 1121 and not s["interCommTLSEnabled"]
               for s in servers)
    assert len({s["interCommToken"] for s in servers}) == 1 and len(servers[0]["interCommToken"]) >= 32
    assert configs[0]["BackendConfig"]["ModelDeployConfig"]["ModelConfig"] == [{"modelWeightPath": "/models/m.gguf"}]
    assert (tmp_path / "prefill-127.0.0.2.json").stat().st_mode & 0o077 == 0


@pytest.mark.parametrize("n_p,n_d,first", [(0, 1, "127.0.0.2"), (1, 0, "127.0.0.2"), (1, 1, "10.0.0.2"),
                                          (1, 1, "127.0.0.254")])
def test_bad_shapes(n_p: int, n_d: int, first: str) -> None:
    with pytest.raises(ValueError):
        LocalCluster(n_p, n_d, first_ip=first)


def test_a_cluster_of_processes(tmp_path: Path) -> None:
    cluster = on_free_ports(LocalCluster(1, 2, first_ip="127.0.7.2", workdir=tmp_path,
                                         instance_command=lambda cfg: [sys.executable, str(FAKE_MAIN), str(cfg)]))
    cluster.start()
    try:
        cluster.wait_ready(timeout_s=60)
        with httpx.Client(trust_env=False, timeout=10) as client:
            whole = client.post(cluster.url + "/infer", json={"inputs": "x"})
            assert whole.status_code == 200 and whole.json() == {"whole": "ABC"}
            for _ in range(2):  # both D instances
                stream = client.post(cluster.url + "/v1/chat/completions", json={"messages": [], "stream": True})
                assert stream.content == b'data: {"text": "A"}\n\ndata: {"text": "B"}\n\ndata: {"text": "C"}\n\n'
    finally:
        cluster.stop(grace_s=10)
    assert all(proc.returncode is not None for proc in cluster.processes.values())
