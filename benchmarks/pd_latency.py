"""Prefill/decode disaggregation against one mixed instance, on the embedded SmolLM2 and one machine.

    python benchmarks/pd_latency.py [--streams 1 32] [--prompt-tokens 256] [--output-tokens 64] [--rounds 2]
                                    [--instance-threads N]

Starts one mixed instance (`mindie serve`) and a 1P1D cluster (`mindie cluster`: coordinator, one
prefill and one decode instance), then alternates between them: at each stream count, N concurrent
streaming /v1/completions requests (random token-id prompts, fresh per run so no prefix-cache hit
helps either side, ignore_eos). Prints time to first token and inter-token latency (p50 / p99) and
output tokens/s per side. Then the coordinator's own latency: the same one-token request (it ends
on P, so D plays no part) through the coordinator and straight to P with the headers the coordinator
would add, interleaved; the difference of the medians is what the coordinator adds per request.

Both sides share the machine's cores: the cluster runs three processes where the mixed instance runs
one. --instance-threads sets MINDIE_NUM_THREADS and OMP_NUM_THREADS for every instance (default:
each uses every core).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import torch
from pd_common import MODEL, Streamed, free_port, local_cluster, pct, stream_openai

VOCAB = 49152


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(100, VOCAB, (length,), generator=gen).tolist() for _ in range(n)]


async def one_stream(client: httpx.AsyncClient, url: str, ids: list[int], n_out: int) -> Streamed:
    body = {"model": MODEL, "prompt": ids, "max_tokens": n_out, "ignore_eos": True, "temperature": 0}
    return await stream_openai(client, url, "/v1/completions", body)


async def drive(url: str, ids: list[list[int]], n_out: int) -> dict[str, float]:
    limits = httpx.Limits(max_connections=len(ids) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits, trust_env=False) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_stream(client, url, p, n_out) for p in ids))
        wall = time.perf_counter() - t0
    ttfts = [r.ttft for r in results]
    gaps = [g for r in results for g in r.gaps]
    short = sum(r.tokens < n_out for r in results)
    return {"tok_s": sum(r.tokens for r in results) / wall, "ttft50": pct(ttfts, 0.5), "ttft99": pct(ttfts, 0.99),
            "itl50": pct(gaps, 0.5), "itl99": pct(gaps, 0.99), "short": short}


async def one_token_latency(coordinator: str, p_url: str, d_ip: str, n: int) -> tuple[float, float]:
    """Median seconds of a one-token request through the coordinator and straight to P, interleaved."""
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 1, "temperature": 0}
    via, direct = [], []
    async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
        for i in range(n + 2):
            t0 = time.perf_counter()
            r = await client.post(coordinator + "/v1/completions", json=body)
            t1 = time.perf_counter()
            headers = {"req-id": str(random.getrandbits(63)), "req-type": "prefill", "d-target": d_ip}
            s = await client.post(p_url + "/v1/completions", json=body, headers=headers)
            t2 = time.perf_counter()
            if r.status_code != 200 or s.status_code != 200 or not json.loads(s.content).get("isLastResp"):
                raise RuntimeError(f"one-token request failed: {r.status_code} {r.text[:200]} / {s.status_code} "
                                   f"{s.text[:200]}")
            if i >= 2:  # warm-up
                via.append(t1 - t0)
                direct.append(t2 - t1)
    return statistics.median(via), statistics.median(direct)


def wait_http(url: str, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(url)


def line(name: str, n: int, r: dict[str, float]) -> str:
    short = f"  ({r['short']:.0f} streams ended short of their tokens)" if r["short"] else ""
    return (f"{name:18s} {n:2d} stream{'s' if n > 1 else ' '}: TTFT p50 {r['ttft50'] * 1e3:7.1f} ms p99 "
            f"{r['ttft99'] * 1e3:7.1f} ms   ITL p50 {r['itl50'] * 1e3:6.1f} ms p99 {r['itl99'] * 1e3:6.1f} ms   "
            f"{r['tok_s']:6.1f} output tok/s{short}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--one-token-requests", type=int, default=30)
    ap.add_argument("--instance-threads", type=int, default=None)
    args = ap.parse_args()
    if args.instance_threads is not None:
        os.environ["MINDIE_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"] = str(args.instance_threads)
    workdir = tempfile.mkdtemp(prefix="pd-latency-")
    port, mport = free_port("127.0.0.1"), free_port("127.0.0.1")
    config = os.path.join(workdir, "mixed.json")
    with open(config, "w") as f:
        json.dump({"BackendConfig": {"ScheduleConfig": {"enablePrefixCache": False}}}, f)
    with open(os.path.join(workdir, "mixed.log"), "wb") as log:
        mixed = subprocess.Popen([sys.executable, "-P", "-m", "mindie", "serve", "--config", config, "--host",
                                  "127.0.0.1", "--port", str(port), "--management-host", "127.0.0.1",
                                  "--management-port", str(mport), "--metrics-port", str(free_port("127.0.0.1"))],
                                 stdout=log, stderr=subprocess.STDOUT)
    cluster = local_cluster(1, 1, "127.0.8.2")
    cluster.start()
    sides = {"mixed instance": f"http://127.0.0.1:{port}", "1P1D coordinator": cluster.url}
    try:
        wait_http(f"http://127.0.0.1:{mport}/health")
        cluster.wait_ready()
        print(f"logs and configs: {workdir}, {cluster.workdir}; instance threads: "
              f"{args.instance_threads or 'every core'}")
        seed = 0
        for url in sides.values():  # warm-up
            seed += 1
            asyncio.run(drive(url, prompts(2, 32, seed), 4))
        runs: dict[tuple[str, int], list[dict[str, float]]] = {}
        for _ in range(args.rounds):
            for n in args.streams:
                for name, url in sides.items():
                    seed += 1
                    r = asyncio.run(drive(url, prompts(n, args.prompt_tokens, seed), args.output_tokens))
                    runs.setdefault((name, n), []).append(r)
                    print(line(name, n, r), flush=True)
        print(f"\nmedians of {args.rounds} alternating rounds, {args.prompt_tokens} prompt + {args.output_tokens} "
              "output tokens per stream:")
        for n in args.streams:
            for name in sides:
                rs = runs[(name, n)]
                print(line(name, n, {k: statistics.median(r[k] for r in rs) for k in rs[0]}))
        p, d = cluster.instances
        via, direct = asyncio.run(one_token_latency(cluster.url, f"http://{p.ip}:{p.port}", d.ip,
                                                    args.one_token_requests))
        print(f"\none-token request (ends on P), median of {args.one_token_requests}: through the coordinator "
              f"{via * 1e3:.2f} ms, straight to P {direct * 1e3:.2f} ms: the coordinator adds "
              f"{(via - direct) * 1e3:.2f} ms per request")
    finally:
        cluster.stop(grace_s=20)
        mixed.terminate()
        mixed.wait(timeout=60)


if __name__ == "__main__":
    main()
