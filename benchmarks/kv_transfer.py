"""KV transfer throughput of the TCP transport (D pulls from P over loopback) against a plain
loopback socket moving the same bytes in one sendall / recv_into loop. P (and the plain
sender) run in a child process, as P and D are separate processes in a deployment.

    python benchmarks/kv_transfer.py

The arenas have SmolLM2-135M's KV shape (30 layers, 3 KV heads, head size 64, bf16, blocks of
128 tokens: 2.9 MB of K and V per block). "contiguous" pulls consecutive blocks into consecutive
blocks (one run); "scattered" pulls every other block into every third (one run per block), the
worst case for coalescing. Each figure is the median of 5 pulls, in GB/s (10^9 bytes).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import time
from multiprocessing.connection import Connection

import numpy as np

from mindie.pd.tcp_transport import TCPTransport
from mindie.pd.transport import KVArena, KVHandle, KVLayout, PullStatus

LAYERS, KV_HEADS, HEAD_DIM, BLOCK, ELEMENT = 30, 3, 64, 128, 2
NUM_BLOCKS = 192
LAYOUT = KVLayout("SmolLM2-135M", "bfloat16", LAYERS, KV_HEADS, HEAD_DIM, BLOCK, "LlamaModel")


def cpu_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")),
                "unknown CPU")


def arena(fill: bool) -> KVArena:
    shape = (NUM_BLOCKS, BLOCK * KV_HEADS * HEAD_DIM * ELEMENT)
    rng = np.random.default_rng(0)
    # D's pages are touched up front, as the server's zero-filled cache is
    make = (lambda: rng.integers(0, 256, shape, dtype=np.uint8)) if fill else (lambda: np.ones(shape, np.uint8))
    return KVArena([(make(), make()) for _ in range(LAYERS)])


CASES = [(f"{n} blocks {name}", src, dst) for n in (8, 32, 64) for name, src, dst in (
    ("contiguous", list(range(n)), list(range(n))),
    ("scattered", list(range(0, 2 * n, 2)), list(range(0, 3 * n, 3))))]
REPEATS = 5


def block_bytes(count: int) -> int:
    return count * 2 * LAYERS * BLOCK * KV_HEADS * HEAD_DIM * ELEMENT


def serve_p(conn: Connection) -> None:
    """The prefill side: every case's blocks published REPEATS times, then serve until told."""
    p = TCPTransport(arena(True), LAYOUT, "bench", "127.0.0.1", 0, timeout_s=60)
    for case, (_, src, _) in enumerate(CASES):
        for i in range(REPEATS):
            p.publish(f"{case}-{i}", src)
    plain = socket.create_server(("127.0.0.1", 0))
    conn.send((p.addr, plain.getsockname()[1]))
    source = np.ones(block_bytes(max(len(src) for _, src, _ in CASES)), np.uint8)
    while True:
        sock, _ = plain.accept()
        with sock:
            size = int.from_bytes(sock.recv(8), "big")
            if size == 0:
                return
            sock.sendall(memoryview(source)[:size])


def plain_rate(port: int, nbytes: int) -> float:
    sink, times = np.zeros(nbytes, np.uint8), []
    for _ in range(REPEATS):
        start = time.perf_counter()
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(nbytes.to_bytes(8, "big"))
            view, got = memoryview(sink), 0
            while got < nbytes:
                got += sock.recv_into(view[got:])
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def main() -> None:
    ours, theirs = mp.Pipe()
    child = mp.get_context("fork").Process(target=serve_p, args=(theirs,), daemon=True)
    child.start()
    p_addr, plain_port = ours.recv()
    d = TCPTransport(arena(False), LAYOUT, "bench", "127.0.0.1", 0, timeout_s=60)
    print(f"CPU: {cpu_name()} ({os.cpu_count()} cores), P and D in separate processes over loopback")
    print(f"{'case':<24}{'MB':>6}{'TCP transport':>16}{'plain socket':>15}")
    for case, (name, src, dst) in enumerate(CASES):
        times = []
        for i in range(REPEATS):
            start = time.perf_counter()
            job = d.pull(KVHandle(f"{case}-{i}", p_addr, src), dst, time.monotonic() + 60)
            assert job.wait() is PullStatus.SUCCESS, job.error
            times.append(time.perf_counter() - start)
        nbytes = block_bytes(len(src))
        rate = nbytes / statistics.median(times) / 1e9
        print(f"{name:<24}{nbytes / 1e6:6.0f}{rate:12.2f} GB/s{plain_rate(plain_port, nbytes):11.2f} GB/s")
    with socket.create_connection(("127.0.0.1", plain_port)) as sock:
        sock.sendall((0).to_bytes(8, "big"))
    child.join(10)
    d.close()


if __name__ == "__main__":
    main()
