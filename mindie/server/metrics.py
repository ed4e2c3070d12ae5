"""Prometheus metrics under MindIE's names (spec section 5), and the JSON summary of
`/metrics-json`. Counters and histograms are fed by the serving layer as requests finish; gauges
are set from the engine's latest stats snapshot when scraped."""

from __future__ import annotations

from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from mindie.engine.request import FinishReason, RequestOutput
from mindie.engine.stats import EngineStats

_TOKEN_BUCKETS = (10, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 16000, 20000, 32000, 50000, 64000, 128000)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, label = self.registry, ["model_name"]
        self._label = model_name

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, label, registry=r)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, label, registry=r)

        self.request_received = counter("request_received", "Requests received")
        self.request_success = counter("request_success", "Requests finished successfully")
        self.request_failed = counter("request_failed", "Requests that failed, timed out or were cancelled")
        self.preemptions = counter("num_preemptions", "Sequences preempted (their KV dropped, to be recomputed)")
        self._preemptions_seen = 0
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens received")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self.running = gauge("num_requests_running", "Requests running")
        self.waiting = gauge("num_requests_waiting", "Requests waiting")
        self.swapped = gauge("num_requests_swapped", "Requests swapped out (always 0: preemption recomputes)")
        self.prompt_tps = gauge("avg_prompt_throughput_toks_per_s", "Prompt tokens per second, as of the last "
                                "finished request")
        self.gen_tps = gauge("avg_generation_throughput_toks_per_s", "Generated tokens per second, as of the last "
                             "finished request")
        self.failed_perc = gauge("failed_request_perc", "Failed requests / received requests")
        self.cache_usage = gauge("npu_cache_usage_perc", "KV-cache blocks in use / total (the device is the CPU)")
        self.cpu_cache_usage = gauge("cpu_cache_usage_perc", "Host swap-space usage (always 0: no swap space)")
        self.prefix_hit = gauge("npu_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / "
                                "prompt tokens looked up")
        self.radix_all = gauge("all_radix_match_num", "Prompt tokens looked up in the prefix cache")
        self.radix_hit = gauge("npu_radix_match_hit_num", "Prompt tokens found in the prefix cache")
        self.ttft = Histogram("time_to_first_token_seconds", "Time to first token", label, registry=r, buckets=(
            0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10))
        self.tpot = Histogram("time_per_output_token_seconds", "Time per output token", label, registry=r, buckets=(
            0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5))
        self.e2e = Histogram("e2e_request_latency_seconds", "End-to-end request latency", label, registry=r,
                             buckets=(1, 2.5, 5, 10, 15, 20, 30, 40, 50, 60))
        self.req_prompt = Histogram("request_prompt_tokens", "Prompt tokens per request", label, registry=r,
                                    buckets=_TOKEN_BUCKETS)
        self.req_gen = Histogram("request_generation_tokens", "Generated tokens per request", label, registry=r,
                                 buckets=_TOKEN_BUCKETS)
        self._received = 0
        self._failed = 0
        self._ttft_recent: deque[float] = deque(maxlen=1000)  # /metrics-json averages
        self._tbt_recent: deque[float] = deque(maxlen=1000)

    @property
    def received_count(self) -> int:
        """Requests the server has taken so far (each admitted, whatever became of it)."""
        return self._received

    def received(self, prompt_tokens: int) -> None:
        self._received += 1
        self.request_received.labels(self._label).inc()
        self.prompt_tokens.labels(self._label).inc(prompt_tokens)
        self.req_prompt.labels(self._label).observe(prompt_tokens)

    def failed(self) -> None:
        self._failed += 1
        self.request_failed.labels(self._label).inc()

    def finished(self, out: RequestOutput, num_tokens: int, ttft_s: float | None, e2e_s: float) -> None:
        """Called with a request's last output (`request_done`), the tokens it generated over all
        samples, and its latencies."""
        if out.finish_reason is FinishReason.ABORT:
            self.failed()
            return
        if out.finish_reason is FinishReason.RECOMPUTE:
            return  # sent back to a prefill node: it ends, and is counted, where it is continued
        self.request_success.labels(self._label).inc()
        self.generation_tokens.labels(self._label).inc(num_tokens)
        self.req_gen.labels(self._label).observe(num_tokens)
        if e2e_s > 0:
            self.gen_tps.labels(self._label).set(num_tokens / e2e_s)
        if ttft_s:
            self.prompt_tps.labels(self._label).set(out.num_prompt_tokens / ttft_s)
        if ttft_s is not None:
            self.ttft.labels(self._label).observe(ttft_s)
            self._ttft_recent.append(ttft_s)
            if num_tokens > 1:
                tbt = (e2e_s - ttft_s) / (num_tokens - 1)
                self.tpot.labels(self._label).observe(tbt)
                self._tbt_recent.append(tbt)
        self.e2e.labels(self._label).observe(e2e_s)

    def _refresh_gauges(self, stats: EngineStats) -> None:
        self.running.labels(self._label).set(stats.running)
        self.waiting.labels(self._label).set(stats.waiting)
        self.swapped.labels(self._label).set(0)
        self.cache_usage.labels(self._label).set(stats.used_blocks / stats.total_blocks)
        self.cpu_cache_usage.labels(self._label).set(0)
        q, h = stats.prefix_query_tokens, stats.prefix_hit_tokens
        self.prefix_hit.labels(self._label).set(h / q if q else 0.0)
        self.radix_all.labels(self._label).set(q)
        self.radix_hit.labels(self._label).set(h)
        self.preemptions.labels(self._label).inc(stats.num_preemptions - self._preemptions_seen)
        self._preemptions_seen = stats.num_preemptions
        self.failed_perc.labels(self._label).set(self._failed / self._received if self._received else 0.0)

    def prometheus_text(self, stats: EngineStats) -> bytes:
        self._refresh_gauges(stats)
        return generate_latest(self.registry)

    def summary(self, stats: EngineStats) -> dict[str, float]:
        """TTFT / TBT averages (ms) over the last 1000 requests and the queue numbers."""

        def avg(xs: deque[float]) -> float:
            return 1e3 * sum(xs) / len(xs) if xs else 0.0

        return {
            "TTFT": avg(self._ttft_recent),
            "TBT": avg(self._tbt_recent),
            "waitingInferRequestNum": stats.waiting,
            "processingInferRequestNum": stats.running,
            "remainBlocks": stats.free_blocks,
        }
