"""Shared timing helpers for the benchmark scripts (printed figures, not tests)."""

from __future__ import annotations

import time
from collections.abc import Callable

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


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.3f} ms"
