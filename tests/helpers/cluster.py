"""Real clusters in tests: `mindie.coordinator.cluster.LocalCluster` started and stopped around a
test, and the figures the tests read from its processes."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import httpx

from helpers.server import free_block
from mindie.coordinator.cluster import InstancePlan, LocalCluster

# The coordinator binds its predict port and the four after it (manage, alarm, external, status).
COORDINATOR_PORT_OFFSETS = range(5)


def on_free_ports(cluster: LocalCluster) -> LocalCluster:
    """The cluster on port blocks that are free now on every address it binds (free_block)."""
    plan = InstancePlan("any", "127.0.0.1", 0)
    instance_offsets = (plan.port, plan.mgmt_port, plan.metrics_port, plan.inter_comm_port, plan.inter_comm_port + 1)
    return replace(cluster, port=free_block([cluster.coordinator_ip], COORDINATOR_PORT_OFFSETS),
                   instance_port=free_block(cluster.instance_ips(), instance_offsets))


def running(cluster: LocalCluster) -> Iterator[LocalCluster]:
    """A fixture body: the cluster started, ready, and stopped afterwards."""
    cluster.start()
    try:
        cluster.wait_ready(timeout_s=300)
        yield cluster
    finally:
        cluster.stop(grace_s=20)


def metric(client: httpx.Client, inst: InstancePlan, name: str) -> float:
    """A metric of the instance; 0 for a counter with no sample yet."""
    text = client.get(f"http://{inst.ip}:{inst.metrics_port}/metrics").text
    found = re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def coordinator_info(client: httpx.Client, cluster: LocalCluster) -> dict[str, Any]:
    return client.get(f"http://127.0.0.1:{cluster.port + 1}/v1/coordinator_info").json()


def log_tails(cluster: LocalCluster, lines: int = 30) -> str:
    """The last lines of every process's log, for an assertion message (the logs go with the cluster's
    directory when it stops)."""
    parts = []
    for log in sorted(cluster.workdir.glob("*.log")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"--- {log.name}\n" + "\n".join(tail))
    return "\n".join(parts)
