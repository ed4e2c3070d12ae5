"""Network namespaces as hosts (pd-disaggregation.md C.4 item 3): each host is a namespace with one
interface, `eth0`, whose veth peer sits on a bridge in a namespace of its own. Nothing is created in
the root namespace, so no route or address there changes; a test reaches a host by running its
client on a thread inside that host's namespace (`Network.threads`). Faults are made in the bridge
namespace: a host's uplink set down, or its downlink slowed with a token bucket (tbf; netem is
often missing). Every namespace and link name carries the test process's pid, so concurrent runs
never meet.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mindie
from mindie.coordinator.cluster import InstancePlan, LocalCluster

SUBNET = "10.77.0"  # private, and only ever inside the namespaces made here
_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


class NetnsUnavailable(Exception):
    """This machine or user cannot create network namespaces (a reason to skip, not a failure)."""


class RateLimitUnavailable(Exception):
    """The bridge cannot slow a link here (no `tc`, or no tbf queueing discipline)."""


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, argv, done.stdout, done.stderr)


def _enter(netns: str) -> None:
    """Moves the calling thread (only it: setns is per thread) into the namespace."""
    fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    try:
        if _libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {netns}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _connect_all(addresses: list[tuple[str, int]], deadline: float) -> None:
    for address in addresses:
        while True:
            try:
                socket.create_connection(address, timeout=max(0.1, deadline - time.monotonic())).close()
                break
            except OSError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.1)


@dataclass(frozen=True)
class Host:
    netns: str
    ip: str
    uplink: str  # the bridge's end of its veth, in the bridge namespace


@dataclass
class Network:
    pid: int  # in every name: namespaces mies<pid>-<host>, links veth<i>-<pid> and br<pid>
    hosts: dict[str, Host] = field(default_factory=dict)
    created: list[str] = field(default_factory=list)  # namespaces, to remove

    @property
    def bridge_netns(self) -> str:
        return f"mies{self.pid}-bridge"

    @property
    def bridge(self) -> str:
        return f"br{self.pid}"

    @classmethod
    def create(cls, names: list[str]) -> Network:
        """Hosts `names` on one bridge, at SUBNET.1, .2, ...; NetnsUnavailable when not permitted."""
        if shutil.which("ip") is None:
            raise NetnsUnavailable("no `ip` command (iproute2)")
        net = cls(os.getpid())
        try:
            net._add_netns(net.bridge_netns)
        except subprocess.CalledProcessError as exc:
            raise NetnsUnavailable(f"`ip netns add` failed as euid {os.geteuid()}: {exc.stderr.strip()}") from None
        try:
            net._bridge("link", "add", net.bridge, "type", "bridge")
            net._bridge("link", "set", net.bridge, "up")
            for i, name in enumerate(names, start=1):
                net._add_host(name, f"{SUBNET}.{i}", f"veth{i}-{net.pid}")
        except BaseException:
            net.remove()
            raise
        return net

    def _add_netns(self, netns: str) -> None:
        _run("ip", "netns", "add", netns)
        self.created.append(netns)

    def _bridge(self, *args: str) -> None:
        _run("ip", "-n", self.bridge_netns, *args)

    def _add_host(self, name: str, ip: str, uplink: str) -> None:
        host = Host(f"mies{self.pid}-{name}", ip, uplink)
        self._add_netns(host.netns)
        self._bridge("link", "add", uplink, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
        self._bridge("link", "set", uplink, "master", self.bridge, "up")
        for args in (("addr", "add", f"{ip}/24", "dev", "eth0"), ("link", "set", "eth0", "up"),
                     ("link", "set", "lo", "up")):
            _run("ip", "-n", host.netns, *args)
        self.hosts[name] = host

    def remove(self) -> None:
        """Deletes every namespace made (their veths and the bridge go with them). A namespace
        still holding a process would outlive its name: that is an error, after all are deleted."""
        occupied = {netns: pids for netns in self.created
                    if (pids := subprocess.run(["ip", "netns", "pids", netns], capture_output=True,
                                               text=True).stdout.split())}
        failed = []
        for netns in reversed(self.created):
            if subprocess.run(["ip", "netns", "del", netns], capture_output=True).returncode != 0:
                failed.append(netns)
        self.created.clear()
        if occupied or failed:
            raise RuntimeError(f"processes left in namespaces: {occupied}; namespaces not deleted: {failed}")

    def set_link(self, name: str, up: bool) -> None:
        """The host's uplink on the bridge, up or down (a cable pulled, seen from the host)."""
        self._bridge("link", "set", self.hosts[name].uplink, "up" if up else "down")

    def limit(self, name: str, kbit: int) -> None:
        """Slows all traffic to the host to `kbit` kbit/s. The queue is short (8 KiB, TCP backs off
        from what it drops), so little is still on its way to the host when another link goes down."""
        if shutil.which("tc") is None:
            raise RateLimitUnavailable("no `tc` command")
        try:
            _run("tc", "-n", self.bridge_netns, "qdisc", "replace", "dev", self.hosts[name].uplink, "root", "tbf",
                 "rate", f"{kbit}kbit", "burst", "4kb", "limit", "8kb")
        except subprocess.CalledProcessError as exc:
            raise RateLimitUnavailable(f"tc cannot add a tbf queue: {exc.stderr.strip()}") from None

    def unlimit(self, name: str) -> None:
        _run("tc", "-n", self.bridge_netns, "qdisc", "del", "dev", self.hosts[name].uplink, "root")

    def wait_connected(self, ports: dict[str, int], timeout_s: float) -> None:
        """Until each host opens a TCP connection to every other host's port in `ports`. After a
        link comes back, an address (ARP) resolution begun while it was down can still fail the
        next connection with EHOSTUNREACH; a connection that succeeds leaves the address resolved."""
        deadline = time.monotonic() + timeout_s
        for name in self.hosts:
            others = [(h.ip, ports[other]) for other, h in self.hosts.items() if other != name]
            with self.threads(name) as host:
                host.submit(_connect_all, others, deadline).result()

    def threads(self, name: str) -> ThreadPoolExecutor:
        """A one-thread pool whose thread lives in the host's namespace: what it runs connects as
        that host (no address or route is added to the root namespace for the test to reach in)."""
        return ThreadPoolExecutor(1, thread_name_prefix=name, initializer=_enter, initargs=(self.hosts[name].netns,))


@dataclass
class NetnsCluster(LocalCluster):
    """`LocalCluster`'s processes and configs, with the coordinator and each instance on its own
    host of `network` (hosts named "coordinator", "prefill0", ..., "decode0", ...), all on MindIE's
    default ports since no two share an address. `kv_trans_timeout` goes into each instance's config."""

    network: Network = field(kw_only=True)
    kv_trans_timeout: int | None = field(default=None, kw_only=True)

    @staticmethod
    def host_names(n_prefill: int, n_decode: int) -> list[str]:
        return ["coordinator", *(f"prefill{i}" for i in range(n_prefill)), *(f"decode{i}" for i in range(n_decode))]

    def instance_ips(self) -> list[str]:
        return [self.network.hosts[name].ip for name in self.host_names(self.n_prefill, self.n_decode)[1:]]

    @property
    def coordinator_ip(self) -> str:
        return self.network.hosts["coordinator"].ip

    def instance_config(self, inst: InstancePlan) -> dict[str, Any]:
        config = super().instance_config(inst)
        if self.kv_trans_timeout is not None:
            config["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["kv_trans_timeout"] = self.kv_trans_timeout
        return config

    def business_ports(self) -> dict[str, int]:
        """Host name -> the port its inference requests go to."""
        return {name: self.port if name == "coordinator" else self.instance_port for name in self.network.hosts}

    def command(self, name: str, argv: list[str]) -> list[str]:
        ip = self.coordinator_ip if name == "coordinator" else next(i.ip for i in self.instances if i.name == name)
        netns = next(h.netns for h in self.network.hosts.values() if h.ip == ip)
        # The children run the mindie this test imported (-P keeps the working directory out).
        # They get SIGTERM if this process dies without stopping them.
        source = str(Path(mindie.__file__).resolve().parents[1])
        path = os.pathsep.join(p for p in (source, os.environ.get("PYTHONPATH")) if p)
        return ["setpriv", "--pdeathsig", "TERM", "ip", "netns", "exec", netns, "env", f"PYTHONPATH={path}", *argv]
