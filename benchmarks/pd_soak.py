"""Soak: a PD cluster at saturation for a while, then a check that nothing leaked.

    PYTHONPATH=$PWD python benchmarks/pd_soak.py [--minutes 10] [--prefill 1] [--decode 1] [--streams 32]
                                                 [--abort-rate 0.1] [--preempt-at 8/5] [--seed 0]

Starts a LocalCluster on the embedded default model whose decode nodes send every E-th request
back for recompute once it has K outputs (MINDIE_PD_PREEMPT_AT="K/E"), and keeps `--streams`
clients busy: each sends one request after another, a random API family (OpenAI chat and
completions, native /infer, TGI /generate(_stream), vLLM /generate, Triton generate(_stream)),
stream or not, with a random prompt and output length, greedy or sampled. A share of them
(`--abort-rate`) is closed by the client mid-way: a stream after a random number of events, a
non-stream request after a random delay. Every CHECK_EVERY-th request is one of a few fixed greedy
prompts whose answer must equal, token for token, the answer it got alone before the load.

Prints a progress line every PROGRESS_S, and at the end: requests sent, completed, aborted by the
client, recomputed (the decode nodes' num_preemptions), failed (a non-200 or an error event, each
listed), lost (sent but none of those: must be 0), output tokens/s, TTFT, peak KV cache usage,
each process's RSS over time (start, max, end, slope over the second half), and once the load has
stopped whether every KV block is back in every pool and the coordinator's table
(/v1/coordinator_info on its manage port) is empty; then each process's exit status and any error
or traceback in its log. A cluster process that exits stops the load. Exits 1 if anything was lost,
failed, mismatched or stayed held, or a process crashed or logged an error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Any

import httpx
from pd_common import MODEL, local_cluster, pct
from prometheus_client.parser import text_string_to_metric_families

from mindie.coordinator.cluster import InstancePlan, LocalCluster
from mindie.server.dmi import PREEMPT_ENV

PROGRESS_S = 30
RSS_EVERY_S = 2
DRAIN_S = 120  # after the load: how long requests still running may take before they count as lost
SETTLE_S = 10  # after the drain: how long KV blocks and the coordinator's table may take to empty
CHECK_EVERY = 8
CHECK_TOKENS = 32  # past K of the default 8/5, so some checks go through a recompute
MAX_PROMPT_WORDS = 300
MAX_OUTPUT_TOKENS = 128
NONSTREAM_ABORT_MAX_S = 3.0
SAMPLING_TEMPERATURE = 0.8
WORDS = ("the of and to in is was for on are with as his they at one have this from or had by word but what some "
         "we can out other were all there when up use your how said each she which do their time if will way about "
         "many then them write would like so these her long make thing see him two has look more day could go come "
         "did number sound no most people my over know water than call first who may down side been now find").split()


@dataclass(frozen=True)
class Gen:
    """What a request asks for, whatever its API family."""

    prompt: str
    max_tokens: int
    greedy: bool
    tag: str  # unique per request: a Triton client's `id`


@dataclass
class Reply:
    deltas: list[str] = field(default_factory=list)
    whole_text: str | None = None  # where the family's last event carries the whole answer
    tokens: int = 0
    done: bool = False  # the family's last event (or whole body) arrived

    @property
    def text(self) -> str:
        return self.whole_text if self.whole_text is not None else "".join(self.deltas)


class Framing(Enum):
    SSE = "sse"  # `data: {...}` (Triton: `data:{...}`)
    NUL = "nul"  # vLLM: JSON objects each ended by a NUL byte, the stream's end is the connection's


@dataclass(frozen=True)
class Api:
    name: str
    path: str
    stream: bool
    body: Callable[[Gen, bool], dict[str, Any]]
    whole: Callable[[dict[str, Any], Gen, Reply], None]  # a non-stream answer into the reply
    event: Callable[[dict[str, Any], Reply], None]  # one stream event into the reply
    framing: Framing = Framing.SSE


def _openai(g: Gen, stream: bool) -> dict[str, Any]:
    # ignore_eos: the output length is the one drawn
    return {"model": MODEL, "max_tokens": g.max_tokens, "temperature": 0 if g.greedy else SAMPLING_TEMPERATURE,
            "ignore_eos": True, "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}


def _mindie_parameters(g: Gen) -> dict[str, Any]:
    sampling = {} if g.greedy else {"temperature": SAMPLING_TEMPERATURE}
    return {"max_new_tokens": g.max_tokens, "do_sample": not g.greedy, "details": True, **sampling}


def _openai_usage(obj: dict[str, Any], reply: Reply) -> None:
    if obj.get("usage"):
        reply.tokens = obj["usage"]["completion_tokens"]


def chat_body(g: Gen, stream: bool) -> dict[str, Any]:
    return {**_openai(g, stream), "messages": [{"role": "user", "content": g.prompt}]}


def chat_whole(obj: dict[str, Any], g: Gen, reply: Reply) -> None:
    reply.deltas.append(obj["choices"][0]["message"]["content"])
    _openai_usage(obj, reply)


def chat_event(obj: dict[str, Any], reply: Reply) -> None:
    reply.deltas += [c["delta"].get("content") or "" for c in obj["choices"]]
    _openai_usage(obj, reply)


def completions_body(g: Gen, stream: bool) -> dict[str, Any]:
    return {**_openai(g, stream), "prompt": g.prompt}


def completions_whole(obj: dict[str, Any], g: Gen, reply: Reply) -> None:
    reply.deltas.append(obj["choices"][0]["text"])
    _openai_usage(obj, reply)


def completions_event(obj: dict[str, Any], reply: Reply) -> None:
    reply.deltas += [c["text"] for c in obj["choices"]]
    _openai_usage(obj, reply)


def infer_body(g: Gen, stream: bool) -> dict[str, Any]:
    return {"inputs": g.prompt, "stream": stream, "parameters": _mindie_parameters(g)}


def _generated(obj: dict[str, Any], reply: Reply) -> None:
    """Native and TGI: `generated_text` and details.generated_tokens."""
    reply.whole_text = obj["generated_text"]
    reply.tokens = obj["details"]["generated_tokens"]


def generated_whole(obj: dict[str, Any], g: Gen, reply: Reply) -> None:
    _generated(obj, reply)


def generated_event(obj: dict[str, Any], reply: Reply) -> None:
    # the native last event carries no token text, only the whole answer: take that one
    if obj.get("generated_text") is not None:
        _generated(obj, reply)
        reply.done = True


def tgi_body(g: Gen, stream: bool) -> dict[str, Any]:
    return {"inputs": g.prompt, "parameters": _mindie_parameters(g)}


def vllm_body(g: Gen, stream: bool) -> dict[str, Any]:
    return {"prompt": g.prompt, "max_tokens": g.max_tokens, "temperature": 0 if g.greedy else SAMPLING_TEMPERATURE,
            "ignore_eos": True, "stream": stream}


def vllm_whole(obj: dict[str, Any], g: Gen, reply: Reply) -> None:
    reply.deltas.append(obj["text"][0].removeprefix(f"{g.prompt} "))  # vLLM 0.2.6 answers prompt + " " + text
    reply.tokens = g.max_tokens  # no count in the answer; ignore_eos makes it the one asked for


def vllm_event(obj: dict[str, Any], reply: Reply) -> None:
    reply.deltas.append(obj["text"][0])
    reply.tokens += 1  # one event per engine step, one token each


def triton_body(g: Gen, stream: bool) -> dict[str, Any]:
    return {"id": g.tag, "text_input": g.prompt, "parameters": _mindie_parameters(g)}


def triton_whole(obj: dict[str, Any], g: Gen, reply: Reply) -> None:
    reply.deltas.append(obj["text_output"])
    reply.tokens = obj["details"]["generated_tokens"]


def triton_event(obj: dict[str, Any], reply: Reply) -> None:
    reply.deltas.append(obj["text_output"])
    details = obj.get("details") or {}
    if "finish_reason" in details:
        reply.tokens = details["generated_tokens"]
        reply.done = True


TRITON = f"/v2/models/{MODEL}"
APIS = [api for stream in (False, True) for api in (
    Api("chat", "/v1/chat/completions", stream, chat_body, chat_whole, chat_event),
    Api("completions", "/v1/completions", stream, completions_body, completions_whole, completions_event),
    Api("infer", "/infer", stream, infer_body, generated_whole, generated_event),
    Api("tgi", "/generate_stream" if stream else "/generate", stream, tgi_body, generated_whole, generated_event),
    Api("vllm", "/generate", stream, vllm_body, vllm_whole, vllm_event, Framing.NUL),
    Api("triton", f"{TRITON}/generate_stream" if stream else f"{TRITON}/generate", stream, triton_body,
        triton_whole, triton_event),
)]


def api(name: str, stream: bool) -> Api:
    return next(a for a in APIS if a.name == name and a.stream == stream)


@dataclass(frozen=True)
class Check:
    """A fixed greedy request whose answer under load must equal its answer alone."""

    api: Api
    gen: Gen

    @property
    def name(self) -> str:
        return f"{self.api.name}{' stream' if self.api.stream else ''} {self.gen.prompt!r}"


CHECKS = [Check(api(name, stream), Gen(prompt, CHECK_TOKENS, True, "check")) for name, stream, prompt in (
    ("chat", True, "What is the capital of France? Answer in one sentence."),
    ("completions", False, "The three primary colours are"),
    ("infer", True, "Write a haiku about the sea."),
    ("tgi", True, "List three fruits:"),
    ("vllm", False, "Once upon a time"),
    ("triton", True, "The quick brown fox"),
)]


class End(Enum):
    COMPLETED = "completed"
    ABORTED = "aborted"  # by the client, on purpose
    FAILED = "failed"


@dataclass(frozen=True)
class Job:
    api: Api
    gen: Gen
    cut_events: int | None = None  # a stream: the client closes it after this many events
    cut_after_s: float | None = None  # not a stream: the client gives up after this long
    check: Check | None = None

    def describe(self) -> str:
        cut = f", cut after {self.cut_events} events" if self.cut_events is not None else (
            f", cut after {self.cut_after_s:.2f} s" if self.cut_after_s is not None else "")
        return (f"{self.api.name}{' stream' if self.api.stream else ''} {self.api.path}: {len(self.gen.prompt)} "
                f"prompt chars, {self.gen.max_tokens} tokens, {'greedy' if self.gen.greedy else 'sampled'}{cut}")


@dataclass
class Outcome:
    end: End
    reply: Reply
    ttft_s: float | None = None
    detail: str = ""


async def _events(response: httpx.Response, framing: Framing) -> AsyncIterator[dict[str, Any] | str]:
    if framing is Framing.NUL:
        pending = b""
        async for chunk in response.aiter_bytes():
            *whole, pending = (pending + chunk).split(b"\0")
            for raw in whole:
                yield json.loads(raw)
        if pending:
            raise ValueError(f"the stream ended inside an event: {pending[:300]!r}")
        return
    async for line in response.aiter_lines():
        if line.startswith("data:"):
            payload = line[5:].strip()
            yield payload if payload == "[DONE]" else json.loads(payload)


async def _stream(client: httpx.AsyncClient, url: str, job: Job, t0: float) -> Outcome:
    reply, ttft, seen = Reply(), None, 0
    async with client.stream("POST", url + job.api.path, json=job.api.body(job.gen, True)) as r:
        if r.status_code != 200:
            return Outcome(End.FAILED, reply, detail=f"HTTP {r.status_code}: {(await r.aread())[:500]!r}")
        if job.cut_events == 0:
            return Outcome(End.ABORTED, reply)  # leaving the block closes the connection
        async for event in _events(r, job.api.framing):
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            if event == "[DONE]":
                reply.done = True
                continue
            assert isinstance(event, dict)
            if "error" in event:
                return Outcome(End.FAILED, reply, detail=f"error event after {seen} events: {json.dumps(event)}")
            try:
                job.api.event(event, reply)
            except (KeyError, IndexError, TypeError) as exc:
                return Outcome(End.FAILED, reply, detail=f"unexpected event ({exc!r}): {json.dumps(event)[:500]}")
            seen += 1
            if job.cut_events is not None and seen >= job.cut_events and not reply.done:
                return Outcome(End.ABORTED, reply)
    if job.api.framing is Framing.NUL:
        reply.done = True
    if not reply.done:
        return Outcome(End.FAILED, reply, detail=f"the stream ended without its last event after {seen} events")
    return Outcome(End.COMPLETED, reply, ttft)


async def _whole(client: httpx.AsyncClient, url: str, job: Job) -> Outcome:
    reply = Reply()
    post = client.post(url + job.api.path, json=job.api.body(job.gen, False))
    try:
        r = await asyncio.wait_for(post, job.cut_after_s)
    except TimeoutError:
        return Outcome(End.ABORTED, reply)  # the cancelled request closed its connection
    obj = r.json() if r.headers.get("content-type", "").startswith("application/json") else None
    if r.status_code != 200 or not isinstance(obj, dict) or "error" in obj:
        return Outcome(End.FAILED, reply, detail=f"HTTP {r.status_code}: {r.content[:500]!r}")
    try:
        job.api.whole(obj, job.gen, reply)
    except (KeyError, IndexError, TypeError) as exc:
        return Outcome(End.FAILED, reply, detail=f"unexpected body ({exc!r}): {r.content[:500]!r}")
    reply.done = True
    return Outcome(End.COMPLETED, reply)


async def call(client: httpx.AsyncClient, url: str, job: Job) -> Outcome:
    """One request; a request that hangs stays here until the drain gives up on it (lost)."""
    try:
        return await (_stream(client, url, job, time.perf_counter()) if job.api.stream else _whole(client, url, job))
    except (httpx.HTTPError, ValueError) as exc:  # ValueError: a body or event that is not JSON
        return Outcome(End.FAILED, Reply(), detail=f"{type(exc).__name__}: {exc}")


@dataclass
class Tally:
    sent: int = 0
    ends: Counter[End] = field(default_factory=Counter)
    by_api: dict[str, Counter[End]] = field(default_factory=lambda: defaultdict(Counter))
    failures: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    checks: int = 0
    tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    in_flight: dict[int, str] = field(default_factory=dict)  # request number -> its job, for the lost

    @property
    def lost(self) -> int:
        return self.sent - sum(self.ends.values())

    def record(self, job: Job, out: Outcome) -> None:
        self.ends[out.end] += 1
        self.by_api[f"{job.api.name}{' stream' if job.api.stream else ''}"][out.end] += 1
        if out.end is End.FAILED:
            self.failures.append(f"{job.describe()}: {out.detail}")
        if out.end is End.COMPLETED:
            self.tokens += out.reply.tokens
            if out.ttft_s is not None:
                self.ttfts.append(out.ttft_s)


@dataclass
class RssTrace:
    pids: dict[str, int]
    samples: list[tuple[float, dict[str, float]]] = field(default_factory=list)

    def sample(self) -> None:
        self.samples.append((time.monotonic(), {name: rss_mib(pid) for name, pid in self.pids.items()}))

    def latest(self) -> dict[str, float]:
        return self.samples[-1][1] if self.samples else {}

    def summary(self, name: str) -> tuple[float, float, float, float]:
        """Start, max and end MiB, and the least-squares slope over the second half in MiB/min."""
        xs = [(t, s[name]) for t, s in self.samples if s[name] == s[name]]  # NaN once it has gone
        half = [(t, v) for t, v in xs if t >= (xs[0][0] + xs[-1][0]) / 2]
        mt, mv = sum(t for t, _ in half) / len(half), sum(v for _, v in half) / len(half)
        var = sum((t - mt) ** 2 for t, _ in half)
        slope = sum((t - mt) * (v - mv) for t, v in half) / var * 60 if var else 0.0
        return xs[0][1], max(v for _, v in xs), xs[-1][1], slope


def rss_mib(pid: int) -> float:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return float("nan")
    found = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
    return int(found.group(1)) / 1024 if found else float("nan")


def random_words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choices(WORDS, k=n))


@dataclass
class Soak:
    cluster: LocalCluster
    abort_rate: float
    rng: random.Random
    client: httpx.AsyncClient  # the load
    control: httpx.AsyncClient  # metrics and the coordinator's table, kept off the load's connections
    tally: Tally = field(default_factory=Tally)
    references: dict[Check, str] = field(default_factory=dict)
    died: str | None = None  # a cluster process that exited under load, and when: the load stops
    kv_peak: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # instance -> max cache usage
    rss: RssTrace = field(init=False)

    def __post_init__(self) -> None:
        self.rss = RssTrace({name: proc.pid for name, proc in self.cluster.processes.items()})

    def next_job(self, n: int) -> Job:
        if n % CHECK_EVERY == CHECK_EVERY - 1:
            check = CHECKS[n // CHECK_EVERY % len(CHECKS)]
            return Job(check.api, replace(check.gen, tag=f"soak-{n}"), check=check)
        rng = self.rng
        gen = Gen(random_words(rng, rng.randint(1, MAX_PROMPT_WORDS)), rng.randint(1, MAX_OUTPUT_TOKENS),
                  rng.random() < 0.5, f"soak-{n}")
        job = Job(rng.choice(APIS), gen)
        if rng.random() >= self.abort_rate:
            return job
        if job.api.stream:
            return replace(job, cut_events=rng.randrange(gen.max_tokens))
        return replace(job, cut_after_s=rng.uniform(0, NONSTREAM_ABORT_MAX_S))

    async def run(self, job: Job) -> Outcome:
        n = self.tally.sent
        self.tally.sent += 1
        self.tally.in_flight[n] = job.describe()
        out = await call(self.client, self.cluster.url, job)
        del self.tally.in_flight[n]
        self.tally.record(job, out)
        return out

    async def references_alone(self) -> None:
        for check in CHECKS:
            out = await self.run(Job(check.api, replace(check.gen, tag="reference"), check=check))
            if out.end is not End.COMPLETED:
                raise RuntimeError(f"the reference of {check.name} failed: {out.detail}")
            self.references[check] = out.reply.text

    async def worker(self, deadline: float) -> None:
        while time.monotonic() < deadline and self.died is None:
            n = self.tally.sent
            job = self.next_job(n)
            out = await self.run(job)
            if job.check is not None and out.end is End.COMPLETED:
                self.tally.checks += 1
                if out.reply.text != self.references[job.check]:
                    self.tally.mismatches.append(f"{job.check.name}: alone {self.references[job.check]!r}, under "
                                                 f"load {out.reply.text!r}")

    async def metrics(self, inst: InstancePlan) -> dict[str, float] | None:
        """The instance's metrics, each summed over its labels; None when it does not answer."""
        try:
            text = (await self.control.get(f"http://{inst.ip}:{inst.metrics_port}/metrics")).text
        except httpx.HTTPError:
            return None
        sums: dict[str, float] = defaultdict(float)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                sums[sample.name] += sample.value
        return sums

    async def preemptions(self) -> float:
        found = [await self.metrics(i) for i in self.cluster.instances if i.role == "decode"]
        return sum(m["num_preemptions_total"] if m is not None else float("nan") for m in found)

    async def coordinator_requests(self) -> int | None:
        try:
            info = await self.control.get(f"http://127.0.0.1:{self.cluster.port + 1}/v1/coordinator_info")
        except httpx.HTTPError:
            return None
        return info.json()["request_num"]

    async def watch(self, t0: float, preempted_before: float) -> None:
        """RSS and KV usage every RSS_EVERY_S, a progress line every PROGRESS_S, until cancelled."""
        next_line = t0 + PROGRESS_S
        while True:
            self.rss.sample()
            for inst in self.cluster.instances:
                if (m := await self.metrics(inst)) is not None:
                    self.kv_peak[inst.name] = max(self.kv_peak[inst.name], m["npu_cache_usage_perc"])
            if self.died is None and (dead := self.cluster.dead()) is not None:
                self.died = (f"{dead} exited with {self.cluster.processes[dead].returncode} after "
                             f"{time.monotonic() - t0:.0f} s of load (-9 is SIGKILL: the kernel's OOM killer?)")
                print(f"{self.died}: stopping the load", flush=True)
            if (now := time.monotonic()) >= next_line:
                next_line += PROGRESS_S
                t, ends = self.tally, self.tally.ends
                rss = " ".join(f"{name} {mib:.0f}" for name, mib in self.rss.latest().items())
                recomputed = await self.preemptions() - preempted_before
                print(f"[{now - t0:5.0f} s] sent {t.sent} completed {ends[End.COMPLETED]} aborted "
                      f"{ends[End.ABORTED]} failed {ends[End.FAILED]} in flight {len(t.in_flight)} | "
                      f"{t.tokens / (now - t0):.0f} tok/s | recomputed {recomputed:.0f} | RSS MiB {rss}", flush=True)
            await asyncio.sleep(RSS_EVERY_S)

    async def settle(self) -> tuple[float, dict[str, dict[str, float] | None], int | None]:
        """Polls until every pool is empty and the coordinator holds nothing, or SETTLE_S passes."""
        t0 = time.monotonic()
        while True:
            held = {i.name: await self.metrics(i) for i in self.cluster.instances}
            table = await self.coordinator_requests()
            busy = any(m is None or m["npu_cache_usage_perc"] or m["num_requests_running"] or
                       m["num_requests_waiting"] for m in held.values())
            if (not busy and table == 0) or time.monotonic() - t0 > SETTLE_S:
                return time.monotonic() - t0, held, table
            await asyncio.sleep(0.25)


@dataclass(frozen=True)
class Aftermath:
    """What the run left behind, measured once the load stopped."""

    load_s: float  # the load and its drain
    recomputed: float
    lost: dict[int, str]
    settle_s: float
    held: dict[str, dict[str, float] | None]  # per instance; None when it did not answer
    table: int | None  # requests in the coordinator's table; None when it did not answer


async def soak(cluster: LocalCluster, args: argparse.Namespace) -> list[str]:
    """The load, then the report; returns why the run failed (empty when it passed)."""
    limits = httpx.Limits(max_connections=args.streams + 8)
    timeout = httpx.Timeout(30, read=None)  # a hang is the drain's to catch, and then it is lost
    async with (httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client,
                httpx.AsyncClient(timeout=10, trust_env=False) as control):
        s = Soak(cluster, args.abort_rate, random.Random(args.seed), client, control)
        await s.references_alone()
        preempted_before = await s.preemptions()
        t0 = time.monotonic()
        deadline = t0 + args.minutes * 60
        watcher = asyncio.create_task(s.watch(t0, preempted_before))
        workers = [asyncio.create_task(s.worker(deadline)) for _ in range(args.streams)]
        await asyncio.wait(workers, timeout=deadline - t0 + DRAIN_S)
        load_s = time.monotonic() - t0
        for w in workers:
            w.cancel()  # still running after the drain: their requests are lost
        await asyncio.gather(*workers, return_exceptions=True)
        lost = dict(s.tally.in_flight)
        recomputed = await s.preemptions() - preempted_before
        settle_s, held, table = await s.settle()
        s.rss.sample()
        watcher.cancel()
        return report(s, args, Aftermath(load_s, recomputed, lost, settle_s, held, table))


def report(s: Soak, args: argparse.Namespace, after: Aftermath) -> list[str]:
    t, ends = s.tally, s.tally.ends
    print(f"\n=== soak: {args.prefill}P{args.decode}D, {args.streams} streams, {args.minutes:g} min of load "
          f"({after.load_s:.0f} s with the drain), abort rate {args.abort_rate:g}, {PREEMPT_ENV}={args.preempt_at}")
    print(f"requests: sent {t.sent} (of which {len(CHECKS)} references alone), completed {ends[End.COMPLETED]}, "
          f"aborted by the client {ends[End.ABORTED]}, failed {ends[End.FAILED]}, lost {t.lost}")
    for name, c in sorted(t.by_api.items()):
        print(f"  {name:19s} completed {c[End.COMPLETED]:4d} aborted {c[End.ABORTED]:3d} failed {c[End.FAILED]:3d}")
    print(f"recomputed (decode nodes' num_preemptions): {after.recomputed:.0f}")
    print(f"output tokens served: {t.tokens} in {after.load_s:.0f} s = {t.tokens / after.load_s:.1f} tok/s")
    print(f"TTFT of completed streams ({len(t.ttfts)}): p50 {pct(t.ttfts, 0.5) * 1e3:.0f} ms, "
          f"p90 {pct(t.ttfts, 0.9) * 1e3:.0f} ms")
    peaks = ", ".join(f"{name} {peak:.1%}" for name, peak in s.kv_peak.items())
    print(f"KV cache usage peak (npu_cache_usage_perc, sampled every {RSS_EVERY_S} s): {peaks}")
    print(f"greedy checks under load: {t.checks} compared with their answer alone, {len(t.mismatches)} mismatched")
    print(f"RSS (MiB), sampled every {RSS_EVERY_S} s: start / max / end, slope over the second half")
    for name in s.rss.pids:
        start, peak, end, slope = s.rss.summary(name)
        print(f"  {name:22s} {start:7.0f} / {peak:7.0f} / {end:7.0f}   {slope:+7.2f} MiB/min")
    table = "no answer" if after.table is None else after.table
    print(f"after the load (checked for {after.settle_s:.1f} s): coordinator requests in flight {table}")
    for name, m in after.held.items():
        state = "no answer" if m is None else (
            f"npu_cache_usage_perc {m['npu_cache_usage_perc']:.4f}, running {m['num_requests_running']:.0f}, "
            f"waiting {m['num_requests_waiting']:.0f}")
        print(f"  {name:22s} {state}")
    problems = [s.died] if s.died else []
    for title, items in (("failed", t.failures), ("lost", list(after.lost.values())), ("mismatched", t.mismatches)):
        if items:
            problems.append(f"{len(items)} {title}")
            print(f"{title}:")
            for item in items:
                print(f"  {item}")
    if t.lost != len(after.lost):
        problems.append(f"{t.lost} lost, {len(after.lost)} of them known")
    if any(m is None or m["npu_cache_usage_perc"] for m in after.held.values()):
        problems.append("KV blocks still held (or an instance did not answer)")
    if after.table != 0:
        problems.append(f"the coordinator's table holds {table} requests")
    return problems


LOG_PROBLEM = re.compile(r"Traceback|\b(ERROR|CRITICAL)\b")


def excerpt(lines: list[str], k: int) -> list[str]:
    """Line k; for a traceback, its head and its last frames down to the exception line."""
    if not lines[k].startswith("Traceback"):
        return [lines[k]]
    end = next((j for j in range(k + 1, len(lines)) if not lines[j].startswith(" ")), len(lines) - 1)
    return [lines[k], *(["  ..."] if end - 8 > k + 1 else []), *lines[max(k + 1, end - 8):end + 1]]


def scan_logs(cluster: LocalCluster) -> list[str]:
    """Each process's exit status and any error or traceback in its log (excerpts printed)."""
    assert cluster.workdir is not None
    problems = []
    for name, proc in cluster.processes.items():
        lines = (cluster.workdir / f"{name}.log").read_text(errors="replace").splitlines()
        hits = [k for k, line in enumerate(lines) if LOG_PROBLEM.search(line)]
        warnings = sum(" WARNING " in line for line in lines)
        print(f"  {name:22s} exit {proc.returncode}, {len(hits)} error/traceback lines, {warnings} warnings")
        for k in hits[:3]:
            print("    | " + "\n    | ".join(excerpt(lines, k)))
        if hits:
            problems.append(f"{len(hits)} error lines in {name}.log")
        if proc.returncode:
            problems.append(f"{name} exited with {proc.returncode}")
    return problems


def cpu() -> str:
    info = Path("/proc/cpuinfo").read_text()
    model = re.search(r"^model name\s*:\s*(.*)$", info, re.M)
    flags = set(re.search(r"^flags\s*:\s*(.*)$", info, re.M).group(1).split())  # type: ignore[union-attr]
    have = " ".join(f"{f}={'yes' if f in flags else 'no'}" for f in ("avx2", "avx512f", "avx512_bf16"))
    return f"{model.group(1) if model else 'unknown CPU'}, {os.cpu_count()} cores, {have}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--prefill", type=int, default=1)
    ap.add_argument("--decode", type=int, default=1)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--abort-rate", type=float, default=0.1)
    ap.add_argument("--preempt-at", default="8/5", help=f"the decode nodes' {PREEMPT_ENV}: K/E")
    ap.add_argument("--first-ip", default="127.0.9.80")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    cluster = local_cluster(args.prefill, args.decode, args.first_ip,
                            role_env={"decode": {PREEMPT_ENV: args.preempt_at}})
    cluster.start()
    print(f"CPU: {cpu()}\ncluster configs and logs: {cluster.workdir}", flush=True)
    problems: list[str] = []
    try:
        cluster.wait_ready()
        problems = asyncio.run(soak(cluster, args))
    finally:
        cluster.stop()
        print("processes and logs:")
        problems += scan_logs(cluster)
    print(f"\nverdict: {'FAIL: ' + '; '.join(problems) if problems else 'PASS'}")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
