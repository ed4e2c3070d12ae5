"""`mindie cluster --prefill N --decode M`: a whole PD cluster on one machine.

The coordinator listens on 127.0.0.1 and the instances on 127.0.0.2, 127.0.0.3, ... (every
127.0.0.0/8 address is the loopback: no root needed), each instance with MindIE's default ports
on its own address, so `d-target` stays a bare IP as in MindIE. Each instance gets a `config.json`
(`inferMode: "dmi"`, its ports, `interCommPort`, the cluster's shared `interCommToken`) and the
coordinator an `ms_coordinator.json` listing them, all in a fresh directory next to their logs.
The coordinator assigns the roles itself once the instances answer; the cluster is ready when its
`/v1/readiness` says so. A process that exits before then stops the cluster (at start an exit is a
configuration to fix: a port taken, a model missing); once it is ready, one that exits is restarted
while the rest keep serving (supervisor.py). Ctrl-C or SIGTERM stops every process (a second one
kills them).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mindie.coordinator.supervisor import Supervisor

READY_TIMEOUT_S = 900  # instances load their model first
STOP_GRACE_S = 30
InstanceCommand = Callable[[Path], list[str]]


# -P: the children import the installed mindie, as this process did, never a source tree that
# happens to be the working directory.
def serve_command(config: Path) -> list[str]:
    return [sys.executable, "-P", "-m", "mindie", "serve", "--config", str(config)]


@dataclass(frozen=True)
class InstancePlan:
    role: str
    ip: str
    port: int

    @property
    def mgmt_port(self) -> int:
        return self.port + 1

    @property
    def metrics_port(self) -> int:
        return self.port + 2

    @property
    def inter_comm_port(self) -> int:
        return self.port + 96  # 1121 beside MindIE's default 1025 (the KV transfer port is the next one)

    @property
    def name(self) -> str:
        return f"{self.role}-{self.ip}"


@dataclass
class LocalCluster:
    n_prefill: int
    n_decode: int
    model: str | None = None
    model_name: str | None = None
    port: int = 1025  # the coordinator's predict port; manage, external and status follow it
    instance_port: int = 1025
    first_ip: str = "127.0.0.2"
    workdir: Path | None = None
    instance_command: InstanceCommand = serve_command
    coordinator_overrides: dict[str, Any] = field(default_factory=dict)  # ms_coordinator.json sections
    model_config: dict[str, Any] = field(default_factory=dict)  # each instance's ModelConfig[0] keys
    schedule_config: dict[str, Any] = field(default_factory=dict)  # each instance's ScheduleConfig keys
    role_env: dict[str, dict[str, str]] = field(default_factory=dict)  # role -> extra environment variables
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    started_at: dict[str, float] = field(default_factory=dict)  # time.monotonic() when each was (re)started

    def __post_init__(self) -> None:
        if self.n_prefill < 1 or self.n_decode < 1:
            raise ValueError("a PD cluster needs at least one prefill and one decode instance")
        roles = ["prefill"] * self.n_prefill + ["decode"] * self.n_decode
        self.instances = [InstancePlan(role, ip, self.instance_port)
                          for role, ip in zip(roles, self.instance_ips(), strict=True)]
        self.token = secrets.token_hex(24)

    def instance_ips(self) -> list[str]:
        """Consecutive addresses from first_ip, all in 127.0.0.0/8: any of them binds without root.
        A subclass that places the processes on other hosts gives their addresses instead."""
        count = self.n_prefill + self.n_decode
        first = [int(x) for x in self.first_ip.split(".")]
        if len(first) != 4 or first[0] != 127 or first[3] + count > 255:
            raise ValueError(f"instances need {count} addresses from {self.first_ip} in 127.0.0.0/8")
        return [".".join(map(str, [*first[:3], first[3] + i])) for i in range(count)]

    @property
    def coordinator_ip(self) -> str:
        return "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.coordinator_ip}:{self.port}"

    @property
    def status_url(self) -> str:
        return f"http://{self.coordinator_ip}:{self.port + 4}"

    def instance_config(self, inst: InstancePlan) -> dict[str, Any]:
        model: dict[str, Any] = dict(self.model_config)
        if self.model:
            model["modelWeightPath"] = os.path.abspath(self.model)
        if self.model_name:
            model["modelName"] = self.model_name
        return {
            "ServerConfig": {
                "ipAddress": inst.ip, "managementIpAddress": inst.ip, "port": inst.port,
                "managementPort": inst.mgmt_port, "metricsPort": inst.metrics_port, "httpsEnabled": False,
                "inferMode": "dmi", "interCommTLSEnabled": False, "interCommPort": inst.inter_comm_port,
                "interCommToken": self.token,
            },
            "BackendConfig": {"ModelDeployConfig": {"ModelConfig": [model]},
                              **({"ScheduleConfig": self.schedule_config} if self.schedule_config else {})},
        }

    def coordinator_config(self) -> dict[str, Any]:
        http = {"predict_ip": self.coordinator_ip, "predict_port": str(self.port), "manage_ip": self.coordinator_ip,
                "manage_port": str(self.port + 1), "alarm_port": str(self.port + 2),
                "external_port": str(self.port + 3), "status_port": str(self.port + 4)}
        config: dict[str, Any] = {
            "http_config": http,
            "tls_config": {f"{part}_tls_enable": False for part in (
                "controller_server", "request_server", "mindie_client", "mindie_mangment", "external", "status",
                "etcd_server", "alarm_client")},
            "instances": [{"role": i.role, "ip": i.ip, "port": i.port, "mgmt_port": i.mgmt_port,
                           "metrics_port": i.metrics_port, "inter_comm_port": i.inter_comm_port}
                          for i in self.instances],
        }
        for section, values in self.coordinator_overrides.items():
            config[section] = {**config.get(section, {}), **values}
        return config

    def write(self) -> Path:
        """Writes every config into the work directory (a fresh one unless given)."""
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="mindie-cluster-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        for inst in self.instances:
            path = self.workdir / f"{inst.name}.json"
            path.write_text(json.dumps(self.instance_config(inst), indent=2))
            path.chmod(0o600)  # it holds the inter-instance token
        (self.workdir / "ms_coordinator.json").write_text(json.dumps(self.coordinator_config(), indent=2))
        return self.workdir

    def start(self) -> None:
        self.write()
        for name in [i.name for i in self.instances] + ["coordinator"]:
            self.restart(name)

    def restart(self, name: str) -> None:
        """Starts process `name` (an instance's name, or "coordinator"), killing it first if it runs."""
        assert self.workdir is not None
        old = self.processes.get(name)
        if old is not None and old.poll() is None:
            old.kill()
            old.wait()
        if name == "coordinator":
            self._spawn(name, [sys.executable, "-P", "-m", "mindie", "coordinator", "--config",
                               str(self.workdir / "ms_coordinator.json")])
            return
        inst = next(i for i in self.instances if i.name == name)
        self._spawn(name, self.instance_command(self.workdir / f"{name}.json"), self.role_env.get(inst.role))

    def command(self, name: str, argv: list[str]) -> list[str]:
        """The command line that starts process `name` (argv itself; a subclass that places the
        processes on other hosts wraps it)."""
        return argv

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        assert self.workdir is not None
        with open(self.workdir / f"{name}.log", "ab") as log:
            # its own process group: a Ctrl-C at the terminal reaches the launcher only, which
            # then stops every process in order
            self.processes[name] = subprocess.Popen(self.command(name, argv), stdout=log, stderr=subprocess.STDOUT,
                                                    start_new_session=True, env={**os.environ, **(env or {})})
        self.started_at[name] = time.monotonic()

    def note(self, name: str, message: str) -> None:
        """Appends a line of the launcher's own to process `name`'s log."""
        assert self.workdir is not None
        with open(self.workdir / f"{name}.log", "a") as log:
            log.write(f"[mindie cluster {time.strftime('%Y-%m-%d %H:%M:%S')}] {message}\n")

    def dead(self) -> str | None:
        """The name of a process that has exited, if any."""
        return next((name for name, proc in self.processes.items() if proc.poll() is not None), None)

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S, should_stop: Callable[[], bool] = lambda: False) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not should_stop():
            if (name := self.dead()) is not None:
                raise RuntimeError(f"{name} exited with {self.processes[name].returncode}; see "
                                   f"{self.workdir}/{name}.log")
            try:
                with urllib.request.urlopen(f"{self.status_url}/v1/readiness", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        if not should_stop():
            raise TimeoutError(f"the cluster was not ready within {timeout_s:.0f} s; logs in {self.workdir}")

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """The coordinator first (no new requests), then the instances; SIGKILL after the grace."""
        order = ["coordinator", *[i.name for i in self.instances]]
        for name in order:
            proc = self.processes.get(name)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for name in order:
            proc = self.processes.get(name)
            if proc is None:
                continue
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", type=int, default=1, help="prefill instances (default 1)")
    parser.add_argument("--decode", type=int, default=1, help="decode instances (default 1)")
    parser.add_argument("--model", help="a GGUF file or a Hugging Face directory (default: the embedded model)")
    parser.add_argument("--model-name", help="the name clients use in `model` and in /v2/models/{name}")
    parser.add_argument("--port", type=int, default=1025,
                        help="the coordinator's predict port on 127.0.0.1 (default 1025; manage, external and "
                        "status use the next ones)")
    parser.add_argument("--instance-port", type=int, default=1025,
                        help="each instance's business port on its own address (management +1, metrics +2, "
                        "P<->D +96 and +97; default 1025)")
    parser.add_argument("--first-ip", default="127.0.0.2", help="the first instance's address (default 127.0.0.2)")
    parser.add_argument("--workdir", help="where configs and logs go (default: a new temporary directory)")


def main(args: argparse.Namespace) -> None:
    try:
        cluster = LocalCluster(args.prefill, args.decode, model=args.model, model_name=args.model_name,
                               port=args.port, instance_port=args.instance_port, first_ip=args.first_ip,
                               workdir=Path(args.workdir) if args.workdir else None)
    except ValueError as exc:
        sys.exit(f"mindie cluster: {exc}")
    stopping: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        if stopping:  # a second one: no more grace
            for proc in cluster.processes.values():
                proc.kill()
        stopping.append(signum)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    cluster.start()
    print(f"starting {args.prefill} prefill + {args.decode} decode instance(s) on {cluster.instances[0].ip}.. and "
          f"the coordinator; configs and logs in {cluster.workdir}", file=sys.stderr, flush=True)
    try:
        cluster.wait_ready(should_stop=lambda: bool(stopping))
        if not stopping:
            print(f"cluster ready: send requests to {cluster.url} (metrics on http://127.0.0.1:{args.port + 3}"
                  "/metrics); Ctrl-C to stop", flush=True)
        Supervisor(cluster).run(should_stop=lambda: bool(stopping))
    except (RuntimeError, TimeoutError) as exc:
        print(f"mindie cluster: {exc}", file=sys.stderr)
    finally:
        print("stopping the cluster", file=sys.stderr, flush=True)
        cluster.stop()
