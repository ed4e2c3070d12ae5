"""Shared by the PD benchmarks (pd_latency.py, pd_cache_affinity.py, pd_soak.py): free ports,
percentiles, a LocalCluster on free ports, and one streamed OpenAI request timed from the client's
side (completions or chat)."""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass
from typing import Any

import httpx

from mindie.coordinator.cluster import LocalCluster

MODEL = "SmolLM2-135M-Instruct"  # the embedded default model


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


@dataclass(frozen=True)
class Streamed:
    ttft: float  # seconds to the first event that carries text
    gaps: list[float]  # seconds between the later events with text
    tokens: int  # what the last chunk's usage says was generated
    text: str


async def stream_openai(client: httpx.AsyncClient, url: str, path: str, body: dict[str, Any]) -> Streamed:
    """POSTs a streaming `/v1/completions` or `/v1/chat/completions` request (usage included)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, gaps, last, tokens, text = None, [], 0.0, 0, []
    async with client.stream("POST", url + path, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}{path}: HTTP {r.status_code} {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            event = json.loads(line[6:])
            if event.get("usage"):  # the last chunk: how many tokens the request really produced
                tokens = event["usage"]["completion_tokens"]
            choice = event["choices"][0] if event["choices"] else {}
            piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            if not piece:
                continue  # a token whose text waits for the next one (part of a UTF-8 sequence), or a role
            text.append(piece)
            if ttft is None:
                ttft = now - t0
            else:
                gaps.append(now - last)
            last = now
    return Streamed(ttft if ttft is not None else float("nan"), gaps, tokens, "".join(text))
