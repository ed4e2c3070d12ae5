"""`GET /metrics` on the external port: every instance's Prometheus metrics in one exposition.

Samples are labelled, not summed: each keeps its own labels plus `instance="<ip>:<port>"` and
`role="prefill"|"decode"`, so nothing is lost (gauges such as `npu_cache_usage_perc` do not add up)
and `sum by (...)` gives the cluster totals. An instance that does not answer is left out of that
scrape. The result is cached for `prometheus_metrics_config.reuse_time` seconds, as MindIE's.
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from mindie.coordinator.instances import Instance

log = logging.getLogger("mindie.coordinator")


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


class MetricsAggregator:
    def __init__(self, client: httpx.AsyncClient, instances: list[Instance], reuse_s: float) -> None:
        self.client = client
        self.instances = instances
        self.reuse_s = reuse_s
        self._cached: tuple[float, bytes] | None = None
        self._lock = asyncio.Lock()  # concurrent scrapes share one round of fetches

    async def exposition(self) -> bytes:
        async with self._lock:
            if self._cached is not None and time.monotonic() - self._cached[0] < self.reuse_s:
                return self._cached[1]
            texts = await asyncio.gather(*(self._fetch(i) for i in self.instances))
            merged: dict[str, Metric] = {}
            for inst, text in zip(self.instances, texts):
                if text is not None:
                    self._merge(merged, inst, text)
            body = generate_latest(_Families(list(merged.values())))  # type: ignore[arg-type]
            self._cached = (time.monotonic(), body)
            return body

    async def _fetch(self, inst: Instance) -> str | None:
        try:
            reply = await self.client.get(inst.metrics_url)
        except httpx.HTTPError as exc:
            log.debug("no metrics from %s: %s", inst.spec.name, exc)
            return None
        return reply.text if reply.status_code == 200 else None

    @staticmethod
    def _merge(merged: dict[str, Metric], inst: Instance, text: str) -> None:
        extra = {"instance": f"{inst.spec.ip}:{inst.spec.port}", "role": inst.role.value}
        try:
            families = list(text_string_to_metric_families(text))
        except ValueError as exc:
            log.warning("unreadable metrics from %s: %s", inst.spec.name, exc)
            return
        for family in families:
            into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type,
                                                         family.unit))
            for sample in family.samples:
                into.add_sample(sample.name, {**sample.labels, **extra}, sample.value, sample.timestamp)
