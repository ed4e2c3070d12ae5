"""Helpers the PD benchmarks share (pd_latency.py, pd_soak.py)."""

from __future__ import annotations

import socket
from typing import Any

from mindie.coordinator.cluster import LocalCluster

MODEL = "SmolLM2-135M-Instruct"  # the embedded default model's name


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def local_cluster(n_prefill: int, n_decode: int, first_ip: str, **fields: Any) -> LocalCluster:
    """A LocalCluster on free ports: the coordinator's on 127.0.0.1, the instances' on first_ip.."""
    return LocalCluster(n_prefill, n_decode, port=free_port("127.0.0.1"), instance_port=free_port(first_ip),
                        first_ip=first_ip, **fields)
