"""`cache_affinity` against `load_balance` on multi-turn chats, 2 P + 1 D, the embedded SmolLM2.

    python benchmarks/pd_cache_affinity.py [--conversations 7] [--turns 6] [--document-words 300]
                                           [--answer-tokens 32] [--think-s 0.5] [--rounds 1]
                                           [--instance-threads N]

For each algorithm, starts a fresh cluster (coordinator, two prefill and one decode instance on
127.0.9.60..62) and runs the same conversations concurrently: each opens with a system prompt
shared by all and a long first user message of its own, and every later turn resends the whole
conversation with the previous answer and a new question, greedy, streamed through
`/v1/chat/completions`, after a pause (the user reading, up to --think-s, the same in both runs: it
keeps the conversations out of lockstep, where load_balance's alternation would keep each on one P
by accident). Prints, per algorithm, the P instances' prefix-cache hit rate over the run
(`npu_radix_match_hit_num` / `all_radix_match_num`, summed over both P), the requests each P got,
and the time to first token (mean, p50, p90) of every request and of the turns after the first,
which are the ones a cache can serve. With --rounds N, each algorithm runs N times, alternating which
goes first (the machine's other load drifts), and the figures pool every run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import statistics
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from pd_common import MODEL, local_cluster, pct, stream_openai

from mindie.coordinator.cluster import InstancePlan
from mindie.coordinator.instances import STATUS_POLL_S

FIRST_IP = "127.0.9.60"
ALGORITHMS = ("load_balance", "cache_affinity")
# the prefix-cache figures of mindie/server/metrics.py: prompt tokens looked up, and found
LOOKED_UP, FOUND, RECEIVED = "all_radix_match_num", "npu_radix_match_hit_num", "request_received_total"
SYSTEM = "You are a careful assistant. Answer in one or two short sentences, using the document the user gives."
WORDS = ("river stone market lantern copper harbour winter orchard signal engine meadow ledger canvas thunder "
         "garden silver bridge compass valley archive").split()


@dataclass
class Conversation:
    document: str
    messages: list[dict[str, str]] = field(default_factory=list)

    def turn(self, k: int) -> list[dict[str, str]]:
        question = f"Question {k + 1}: what does the document say about {WORDS[k % len(WORDS)]}?"
        if not self.messages:
            self.messages = [{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": f"Document:\n{self.document}\n\n{question}"}]
        else:
            self.messages.append({"role": "user", "content": question})
        return list(self.messages)


@dataclass
class Run:
    ttfts: list[list[float]]  # per turn
    looked_up: float
    found: float
    per_p: list[float]


def documents(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


def scrape(plan: InstancePlan) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{plan.ip}:{plan.metrics_port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    figures = {}
    for name in (LOOKED_UP, FOUND, RECEIVED):
        match = re.search(rf"^{name}{{[^}}]*}} (\S+)$", text, re.MULTILINE)
        figures[name] = float(match.group(1)) if match else 0.0
    return figures


async def converse(client: httpx.AsyncClient, url: str, conv: Conversation, pauses: list[float], answer_tokens: int,
                   ttfts: list[list[float]]) -> None:
    for k, pause in enumerate(pauses):
        await asyncio.sleep(pause)
        body: dict[str, Any] = {"model": MODEL, "messages": conv.turn(k), "max_tokens": answer_tokens,
                                "temperature": 0, "ignore_eos": True}
        result = await stream_openai(client, url, "/v1/chat/completions", body)
        ttfts[k].append(result.ttft)
        conv.messages.append({"role": "assistant", "content": result.text})


async def drive(url: str, docs: list[str], pauses: list[list[float]], answer_tokens: int) -> list[list[float]]:
    """Each conversation's turns, after its pauses; the TTFTs per turn."""
    ttfts: list[list[float]] = [[] for _ in pauses[0]]
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=len(docs) + 4),
                                 trust_env=False) as client:
        await asyncio.gather(*(converse(client, url, Conversation(d), p, answer_tokens, ttfts)
                               for d, p in zip(docs, pauses)))
    return ttfts


def run(algorithm: str, docs: list[str], pauses: list[list[float]], args: argparse.Namespace, workdir: Path) -> Run:
    cluster = local_cluster(2, 1, FIRST_IP, workdir=workdir,
                            coordinator_overrides={"digs_scheduler_config": {"algorithm_type": algorithm}})
    cluster.start()
    try:
        cluster.wait_ready(timeout_s=600)
        prefills = [i for i in cluster.instances if i.role == "prefill"]
        # warm-up: a chat on each P, unrelated to the measured ones; then a status poll, so that the
        # load figures start even
        asyncio.run(drive(cluster.url, documents(len(prefills), 100, args.seed + 1), [[0.0]] * len(prefills), 4))
        time.sleep(2 * STATUS_POLL_S)
        before = [scrape(p) for p in prefills]
        ttfts = asyncio.run(drive(cluster.url, docs, pauses, args.answer_tokens))
        after = [scrape(p) for p in prefills]
    finally:
        cluster.stop(grace_s=20)
    delta = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]
    return Run(ttfts, sum(d[LOOKED_UP] for d in delta), sum(d[FOUND] for d in delta), [d[RECEIVED] for d in delta])


def ttft_line(label: str, xs: list[float]) -> str:
    return (f"  TTFT {label:9s} n={len(xs):3d}  mean {statistics.fmean(xs) * 1e3:7.1f} ms  p50 "
            f"{pct(xs, 0.5) * 1e3:7.1f} ms  p90 {pct(xs, 0.9) * 1e3:7.1f} ms")


def report(name: str, runs: list[Run]) -> None:
    looked_up, found = sum(r.looked_up for r in runs), sum(r.found for r in runs)
    hit = found / looked_up if looked_up else float("nan")
    per_p = " / ".join(f"{sum(n):.0f}" for n in zip(*(r.per_p for r in runs)))
    print(f"{name}: prefix-cache hit rate {hit:6.1%} ({found:.0f} of {looked_up:.0f} prompt tokens on P); "
          f"requests per P {per_p}")
    print(ttft_line("all turns", [t for r in runs for turn in r.ttfts for t in turn]))
    print(ttft_line("turns 2..", [t for r in runs for turn in r.ttfts[1:] for t in turn]), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=7)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--document-words", type=int, default=300)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--think-s", type=float, default=0.5, help="the longest pause before a turn")
    ap.add_argument("--rounds", type=int, default=1, help="runs of each algorithm, alternating which goes first")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--instance-threads", type=int, default=None)
    args = ap.parse_args()
    if args.instance_threads is not None:
        os.environ["MINDIE_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"] = str(args.instance_threads)
    workdir = Path(tempfile.mkdtemp(prefix="pd-cache-affinity-"))
    docs = documents(args.conversations, args.document_words, args.seed)
    rng = random.Random(args.seed)
    pauses = [[rng.uniform(0, args.think_s) for _ in range(args.turns)] for _ in docs]
    print(f"{args.conversations} conversations x {args.turns} turns, {args.document_words}-word documents, "
          f"{args.answer_tokens}-token answers, pauses up to {args.think_s} s; 2 P + 1 D on {FIRST_IP}..; "
          f"instance threads: {args.instance_threads or 'every core'}; logs in {workdir}", flush=True)
    runs: dict[str, list[Run]] = {a: [] for a in ALGORITHMS}
    for k in range(args.rounds):
        for algorithm in ALGORITHMS if k % 2 == 0 else ALGORITHMS[::-1]:  # neither always runs first
            runs[algorithm].append(run(algorithm, docs, pauses, args, workdir / f"{algorithm}-{k}"))
            if args.rounds > 1:
                report(f"round {k + 1} {algorithm}", runs[algorithm][-1:])
    print(f"\nall {args.rounds} round(s):")
    for algorithm, rs in runs.items():
        report(algorithm, rs)


if __name__ == "__main__":
    main()
