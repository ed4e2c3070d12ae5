"""The P and D instances the coordinator routes to, and what it knows of each: whether it holds its
role yet, whether it is online (the manage port's offline/online), reachable (its last status poll),
linked (a D's `/dresult` stream is open) or faulty (a D whose re-link failed `max_retry` times), its
free slots and blocks as last polled, and the requests it has in flight.

`Registry.start_instance` brings one instance into service the way MindIE's controller does: read
its `/v1/config` (the model name, for `stopInfer`), `POST /v1/role/{prefill|decode}` with MindIE's
body (P's peers are the D instances and D's the P instances), then keep polling `/v1/status`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from mindie.coordinator.config import InstanceSpec, Role

log = logging.getLogger("mindie.coordinator")

STATUS_POLL_S = 1.0  # MindIE's controller syncs the cluster every second (cluster_synchronization_seconds)
ROLE_RETRY_MAX_S = 2.0  # an instance still loading its model is asked again this often


@dataclass(eq=False)
class Instance:
    spec: InstanceSpec
    role_assigned: bool = False
    role_error: str | None = None  # the instance refused its role (a 4xx): it stays out of service
    online: bool = True
    reachable: bool = False
    linked: bool = False
    faulty: bool = False
    model_name: str | None = None
    avail_slots: int | None = None
    avail_blocks: int | None = None
    assigned_since_poll: int = 0  # requests sent since the last poll, which its figures do not count yet
    in_flight: set[str] = field(default_factory=set)

    @property
    def id(self) -> int:
        return self.spec.id

    @property
    def role(self) -> Role:
        return self.spec.role

    @property
    def business_url(self) -> str:
        return f"http://{self.spec.ip}:{self.spec.port}"

    @property
    def management_url(self) -> str:
        return f"http://{self.spec.mgmt_ip}:{self.spec.mgmt_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.spec.mgmt_ip}:{self.spec.metrics_port}/metrics"

    @property
    def schedulable(self) -> bool:
        if not (self.role_assigned and self.online and self.reachable):
            return False
        return self.role is Role.PREFILL or (self.linked and not self.faulty)

    def describe(self) -> dict[str, Any]:
        return {"id": self.id, "role": self.role.value, "ip": self.spec.ip, "port": self.spec.port,
                "role_assigned": self.role_assigned, "role_error": self.role_error, "online": self.online,
                "reachable": self.reachable, "linked": self.linked if self.role is Role.DECODE else None,
                "faulty": self.faulty, "allocated_slots": len(self.in_flight),
                "avail_slots": self.avail_slots, "avail_blocks": self.avail_blocks}


def role_body(local: InstanceSpec, peers: list[InstanceSpec]) -> dict[str, Any]:
    """MindIE's `/v1/role` body (mindie-api.md 3.19). A CPU instance has one "device": itself."""

    def entry(s: InstanceSpec) -> dict[str, Any]:
        return {"id": s.id, "host_ip": s.ip, "server_ip": s.ip,
                "device": [{"device_logical_id": "0", "device_id": "0", "device_ip": s.ip}]}

    return {"local": entry(local), "peers": [entry(p) for p in peers]}


class Registry:
    def __init__(self, specs: tuple[InstanceSpec, ...], client: httpx.AsyncClient,
                 on_change: Callable[[], None]) -> None:
        self.client = client
        self.instances: dict[int, Instance] = {s.id: Instance(s) for s in specs}
        self._on_change = on_change  # wakes requests waiting for an instance to schedule on
        self._tasks: dict[int, asyncio.Task[None]] = {}

    def of_role(self, role: Role) -> list[Instance]:
        return [i for i in self.instances.values() if i.role is role]

    @property
    def ready(self) -> bool:
        return any(i.schedulable for i in self.of_role(Role.PREFILL)) and any(
            i.schedulable for i in self.of_role(Role.DECODE))

    def changed(self) -> None:
        self._on_change()

    def start(self, on_decode_ready: Callable[[Instance], None]) -> None:
        for inst in self.instances.values():
            self._tasks[inst.id] = asyncio.ensure_future(self._serve(inst, on_decode_ready))

    async def stop(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()

    async def _serve(self, inst: Instance, on_decode_ready: Callable[[Instance], None]) -> None:
        while True:
            if not await self._assign_role(inst):
                return
            if inst.role is Role.DECODE:
                on_decode_ready(inst)
            while await self.poll(inst):
                await asyncio.sleep(STATUS_POLL_S)
            # it answers without a role: a restarted process, out of service until it has one again
            log.warning("%s has no role any more (restarted?): assigning it again", inst.spec.name)
            inst.role_assigned = False
            self.changed()

    async def _assign_role(self, inst: Instance) -> bool:
        role = inst.role
        peers = [i.spec for i in self.instances.values() if i.role is not role]
        delay = 0.1
        while True:
            try:
                config = await self.client.get(f"{inst.management_url}/v1/config")
                if config.status_code == 200:
                    inst.model_name = config.json().get("modelName")
                reply = await self.client.post(f"{inst.management_url}/v1/role/{role.value}",
                                               json=role_body(inst.spec, peers))
            except (httpx.HTTPError, ValueError) as exc:
                log.debug("%s is not answering yet (%s)", inst.spec.name, exc)
            else:
                if reply.status_code == 200:
                    inst.role_assigned = inst.reachable = True
                    log.info("%s took its role", inst.spec.name)
                    self.changed()
                    return True
                if 400 <= reply.status_code < 500:
                    inst.role_error = f"{reply.status_code} {reply.text[:200]}"
                    log.error("%s refused its role: %s", inst.spec.name, inst.role_error)
                    return False
                log.debug("%s answered %d to its role; asking again", inst.spec.name, reply.status_code)
            await asyncio.sleep(delay)
            delay = min(delay * 2, ROLE_RETRY_MAX_S)

    async def poll(self, inst: Instance) -> bool:
        """Free slots and blocks from `/v1/status` (the figures load_balance weighs); False if the
        instance answers that it holds no role."""
        was = inst.reachable
        try:
            reply = await self.client.get(f"{inst.management_url}/v1/status")
            status = reply.json() if reply.status_code == 200 else None
            if status is not None and status.get("service", {}).get("roleStatus") == "RoleUnknown":
                return False
            resource = status["resource"] if status is not None else None
            inst.avail_slots = int(resource["availSlotsNum"]) if resource else None
            inst.avail_blocks = int(resource["availBlockNum"]) if resource else None
            inst.reachable = resource is not None
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            inst.reachable = False
        inst.assigned_since_poll = 0
        if inst.reachable != was:
            log.warning("%s is %s", inst.spec.name, "reachable again" if inst.reachable else "not answering")
            self.changed()
        return True
