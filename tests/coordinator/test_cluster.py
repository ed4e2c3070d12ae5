"""`mindie cluster`: the configs it writes, a whole cluster of processes (the real coordinator,
fake instances) started, used and stopped, and its supervisor restarting the one that exits."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from helpers.cluster import coordinator_info, on_free_ports

from mindie.coordinator.cluster import LocalCluster
from mindie.coordinator.config import CoordinatorConfig, Role
from mindie.coordinator.supervisor import RestartPolicy, Supervisor, describe_exit

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


def _until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.05)


def _schedulable(client: httpx.Client, cluster: LocalCluster, index: int) -> bool:
    info = coordinator_info(client, cluster)["schedule_info"][index]
    return bool(info["role_assigned"] and info["reachable"] and info["linked"] is not False and not info["faulty"])


def test_the_supervisor_restarts_what_exits_and_the_coordinator_gives_the_role_again(tmp_path: Path) -> None:
    cluster = on_free_ports(LocalCluster(1, 2, first_ip="127.0.7.12", workdir=tmp_path,
                                         instance_command=lambda cfg: [sys.executable, str(FAKE_MAIN), str(cfg)]))
    reports: list[str] = []
    supervisor = Supervisor(cluster, RestartPolicy(first_delay_s=0.2, max_delay_s=0.4), report=reports.append)
    stop = threading.Event()
    watch = threading.Thread(target=supervisor.run, args=(stop.is_set, 0.05))
    cluster.start()
    try:
        cluster.wait_ready(timeout_s=60)
        watch.start()
        client = httpx.Client(trust_env=False, timeout=10)
        d = cluster.instances[1]
        for restart, delay in ((1, "0.2"), (2, "0.4")):  # a quick second exit waits longer
            cluster.processes[d.name].send_signal(signal.SIGKILL)
            _until(lambda: supervisor.restarts(d.name) == restart, 10, f"{d.name} restarted")  # noqa: B023
            assert reports[-2] == f"{d.name} was killed by SIGKILL after " + reports[-2].split(" after ")[1]
            assert reports[-2].endswith(f"; restarting it in {delay} s")
            assert reports[-1].startswith(f"{d.name} restarted (pid {cluster.processes[d.name].pid}")
        assert "was killed by SIGKILL" in (tmp_path / f"{d.name}.log").read_text()  # its own log says it too
        _until(lambda: _schedulable(client, cluster, 1), 20, "the restarted D back in the schedule")
        for _ in range(4):  # both D serve (the other pair's ties go round robin)
            stream = client.post(cluster.url + "/v1/chat/completions", json={"messages": [], "stream": True})
            assert stream.content == b'data: {"text": "A"}\n\ndata: {"text": "B"}\n\ndata: {"text": "C"}\n\n'

        pids = {i.name: cluster.processes[i.name].pid for i in cluster.instances}
        cluster.processes["coordinator"].send_signal(signal.SIGKILL)
        _until(lambda: supervisor.restarts("coordinator") == 1, 10, "the coordinator restarted")
        cluster.wait_ready(timeout_s=30)
        assert client.post(cluster.url + "/infer", json={"inputs": "x"}).json() == {"whole": "ABC"}
        assert {i.name: cluster.processes[i.name].pid for i in cluster.instances} == pids  # instances kept running
    finally:
        stop.set()
        if watch.is_alive():
            watch.join()
        cluster.stop(grace_s=10)


@dataclass
class _Exited:
    returncode: int | None = None
    pid: int = 1

    def poll(self) -> int | None:
        return self.returncode


@dataclass
class _Processes:
    """What a Supervisor needs of a LocalCluster: its processes, restart and note."""

    processes: dict[str, _Exited]
    clock: Callable[[], float]
    started_at: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def restart(self, name: str) -> None:
        self.processes[name] = _Exited()
        self.started_at[name] = self.clock()

    def note(self, name: str, message: str) -> None:
        self.notes.append(message)


def test_restarts_back_off_while_a_process_keeps_failing_and_not_once_it_stayed_up() -> None:
    now = [0.0]
    procs = _Processes({"decode-x": _Exited()}, lambda: now[0], {"decode-x": 0.0})
    supervisor = Supervisor(procs, RestartPolicy(first_delay_s=1, max_delay_s=4, stable_after_s=60),
                            report=lambda message: None, clock=lambda: now[0])
    supervisor.check()
    waits = []
    for up in (5, 5, 5, 5, 100, 5):
        now[0] += up
        procs.processes["decode-x"].returncode = 1
        supervisor.check()  # seen to have exited
        waits.append(procs.notes[-1].rsplit(" in ", 1)[1])
        now[0] += 10
        supervisor.check()  # restarted
    assert waits == ["1 s", "2 s", "4 s", "4 s", "1 s", "2 s"]
    assert supervisor.restarts("decode-x") == 6
    assert procs.notes[0] == "decode-x exited with code 1 after 5.0 s up; restarting it in 1 s"


def test_describe_exit() -> None:
    assert describe_exit(-9) == "was killed by SIGKILL"
    assert describe_exit(3) == "exited with code 3"
    assert describe_exit(-200) == "was killed by signal 200"
