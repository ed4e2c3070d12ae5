"""The coordinator's state in one place: configuration, instances, scheduler, requests in flight,
the `/dresult` links and the HTTP client they all share; and the calls several planes make
(`stop_infer`, waiting for an instance to free up)."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from mindie.coordinator.config import CoordinatorConfig, Role
from mindie.coordinator.dresult import SILENCE_LIMIT_S, DResultLink
from mindie.coordinator.instances import Instance, Registry
from mindie.coordinator.requests import RequestTable, Tracked
from mindie.coordinator.scheduler import Scheduler

log = logging.getLogger("mindie.coordinator")


class Coordinator:
    def __init__(self, config: CoordinatorConfig, silence_limit_s: float = SILENCE_LIMIT_S) -> None:
        self.config = config
        self.started_at = time.time()
        timeout = httpx.Timeout(config.http_timeout_s or None)
        self.client = httpx.AsyncClient(timeout=timeout, headers={"User-Agent": config.user_agent},
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
                                        trust_env=False)
        self._change = asyncio.Event()
        self.registry = Registry(config.instances, self.client, self.notify)
        self.table = RequestTable()
        self.scheduler = Scheduler(self.registry, self.table, config.algorithm, config.single_node_max_requests)
        self.links: dict[int, DResultLink] = {}
        self._silence_limit_s = silence_limit_s
        self._background: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        self.registry.start(self._role_taken)

    async def close(self) -> None:
        await self.registry.stop()
        for link in self.links.values():
            await link.stop()
        if self._background:
            await asyncio.wait(self._background, timeout=5)
        await self.client.aclose()

    def _role_taken(self, inst: Instance) -> None:
        if inst.role is not Role.DECODE:
            return
        if inst.id in self.links:  # a D given its role again (it restarted): its /dresult answers now
            self.links[inst.id].relink_now()
            return
        link = DResultLink(inst, self.registry, self.table, self.config.max_retry, self._silence_limit_s)
        self.links[inst.id] = link
        link.start()

    def notify(self) -> None:
        """Something a waiting request may care about changed (an instance came up or went away, a
        slot freed)."""
        self.scheduler.forget_departed()
        self._change.set()
        self._change = asyncio.Event()

    async def wait_change(self, timeout: float | None) -> None:
        await asyncio.wait_for(self._change.wait(), timeout)

    def finish(self, tracked: Tracked) -> None:
        self.table.remove(tracked)
        self.notify()

    def stop_infer(self, tracked: Tracked) -> None:
        """Cancels the request on its P and D (`POST /v2/models/{model}/stopInfer {"id"}`, P first),
        in the background: the client that went away waits for nothing."""
        task = asyncio.ensure_future(self._stop_infer([i for i in (tracked.p, tracked.d) if i is not None],
                                                      tracked.req_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _stop_infer(self, instances: list[Instance], req_id: str) -> None:
        for inst in instances:
            model = inst.model_name or next((i.model_name for i in self.registry.instances.values()
                                             if i.model_name), None)
            if model is None:
                log.warning("cannot stop request %s on %s: its model name is unknown", req_id, inst.spec.name)
                continue
            for _ in range(max(1, self.config.max_retry)):
                try:
                    reply = await self.client.post(f"{inst.business_url}/v2/models/{model}/stopInfer",
                                                   json={"id": req_id})
                except httpx.HTTPError as exc:
                    log.debug("stopInfer %s on %s failed: %s", req_id, inst.spec.name, exc)
                    continue
                if reply.status_code < 500:  # 200, or 404: it had already finished there
                    break
