"""Shared timing helpers for the benchmark scripts (printed figures, not tests)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import torch


def bench(fn: Callable[[], object], min_time: float = 0.5, warmup: int = 3) -> float:
    """Median seconds per call over at least `min_time` seconds of calls."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while time.perf_counter() - start < min_time or len(times) < 5:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def memory_read_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes per second torch reaches summing a buffer far larger than the last-level cache."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    best = min(bench(lambda: x.sum(), min_time=0.0, warmup=1) for _ in range(repeats))
    return nbytes / best


def cpu_summary() -> str:
    """The CPU's model name and which of the ISA extensions our kernels use it has."""
    info = Path("/proc/cpuinfo").read_text()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    isa: list[str] = [f for f in ("avx2", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16") if f in flags]
    isa += sorted(f for f in flags if f.startswith("amx"))
    return f"{name}; ISA: {' '.join(isa) or 'none of avx2/avx_vnni/avx512f/avx512_vnni/avx512_bf16/amx'}"


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.3f} ms"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*options: str) -> tuple[subprocess.Popen, str, str]:
    """`mindie serve` with `options` in a subprocess on free loopback ports, once healthy: the
    process, the business URL and the management URL. The caller terminates it."""
    port, mport = free_port(), free_port()
    server = subprocess.Popen([sys.executable, "-m", "mindie", "serve", *options, "--host", "127.0.0.1",
                               "--port", str(port), "--management-host", "127.0.0.1", "--management-port", str(mport),
                               "--metrics-port", str(free_port())], stderr=subprocess.DEVNULL, env={**os.environ})
    url, mgmt = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{mport}"
    for _ in range(1200):
        try:
            if httpx.get(mgmt + "/health").status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    return server, url, mgmt
