"""The P and D instances the coordinator routes to, and what it knows of each: whether it holds its
role yet, whether it is online (the manage port's offline/online), reachable (its last status poll),
linked (a D's `/dresult` stream is open) or faulty (a D whose re-link failed `max_retry` times), its
free slots and blocks as last polled, and the requests it has in flight.

`Registry.start` brings each instance into service the way MindIE's controller does: read its
`/v1/config` (the model name, for `stopInfer`), `POST /v1/role/{prefill|decode}` with MindIE's body
(P's peers are the D instances and D's the P instances), then keep polling `/v1/status`.

An instance's `ip` (and `mgmt_ip`) may be a DNS name, such as a StatefulSet pod's stable name. The
registry resolves it to an IPv4 address (getaddrinfo in the loop's executor: the loop never waits on
DNS) before offering the role and again before every status poll, and what it sends to instances
carries only that address (`d-target`, the `/v1/role` peers, every URL). While a name does not
resolve, its instance is unreachable, out of the schedule. An instance found at a new address (a pod
that was replaced) is a new process: it gets its role again, as does one whose `/v1/status` says it
has lost its role (a process restarted in place). An instance whose peers' addresses changed is
out of the schedule until it has taken its role again with the new peer list, which it is offered
at once: P and D accept calls from their peers only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from mindie.config_keys import is_ip
from mindie.coordinator.config import InstanceSpec, Role

log = logging.getLogger("mindie.coordinator")

STATUS_POLL_S = 1.0  # MindIE's controller syncs the cluster every second (cluster_synchronization_seconds)
# A poll that gets no answer in this long counts as a failed one: an instance behind a link that is
# down (not closed) would otherwise stay "reachable", and scheduled, for the whole http_timeout.
STATUS_TIMEOUT_S = 5.0
ROLE_RETRY_MAX_S = 2.0  # an instance still loading its model is asked again this often
RESOLVE_TIMEOUT_S = 5.0  # a resolver that does not answer in time counts as a name that does not resolve


async def resolve_ipv4(host: str) -> list[str]:
    """The IPv4 addresses `host` resolves to now, in the resolver's order; [] if it does not."""
    try:
        async with asyncio.timeout(RESOLVE_TIMEOUT_S):
            infos = await asyncio.get_running_loop().getaddrinfo(host, None, family=socket.AF_INET,
                                                                 type=socket.SOCK_STREAM)
    except (OSError, TimeoutError):  # socket.gaierror is an OSError
        return []
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


@dataclass(eq=False)
class Instance:
    spec: InstanceSpec  # its addresses: as configured, with names resolved (the names until they first are)
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
    peers_given: tuple[str, ...] | None = None  # the peers' addresses in the role it last took
    peers_stale: bool = False  # a peer has moved since: it would refuse that peer's calls
    configured: InstanceSpec = field(init=False)  # as ms_coordinator.json has it
    addressed: bool = field(init=False)  # spec holds addresses, not names

    def __post_init__(self) -> None:
        self.configured = self.spec
        self.addressed = is_ip(self.spec.ip) and is_ip(self.spec.mgmt_ip)

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
        if not (self.role_assigned and self.online and self.reachable) or self.peers_stale:
            return False
        return self.role is Role.PREFILL or (self.linked and not self.faulty)

    def describe(self) -> dict[str, Any]:
        return {"id": self.id, "role": self.role.value, "host": self.configured.ip, "ip": self.spec.ip,
                "port": self.spec.port, "role_assigned": self.role_assigned, "role_error": self.role_error,
                "online": self.online,
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
        self._wake = {s.id: asyncio.Event() for s in specs}  # polls an instance now rather than at its next turn
        self._on_role_taken: Callable[[Instance], None] = lambda inst: None

    def of_role(self, role: Role) -> list[Instance]:
        return [i for i in self.instances.values() if i.role is role]

    @property
    def ready(self) -> bool:
        return any(i.schedulable for i in self.of_role(Role.PREFILL)) and any(
            i.schedulable for i in self.of_role(Role.DECODE))

    def changed(self) -> None:
        self._on_change()

    def start(self, on_role_taken: Callable[[Instance], None]) -> None:
        """Brings every instance into service; `on_role_taken(inst)` runs each time one takes its
        role, the first time and again after it lost it (it restarted)."""
        self._on_role_taken = on_role_taken
        for inst in self.instances.values():
            self._tasks[inst.id] = asyncio.ensure_future(self._serve(inst))

    def suspect(self, inst: Instance) -> None:
        """A request could not go through `inst`: it is out of the schedule until a status poll,
        asked at once, answers."""
        if inst.reachable:
            inst.reachable = False
            log.warning("%s failed a request: out of the schedule until its status answers", inst.spec.name)
            self.changed()
        self._wake[inst.id].set()

    async def stop(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()

    async def _serve(self, inst: Instance) -> None:
        if not await self._assign_role(inst):
            return
        wake = self._wake[inst.id]
        while True:
            await self.poll(inst)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), STATUS_POLL_S)
            wake.clear()

    def _peers(self, inst: Instance) -> list[InstanceSpec]:
        """The other role's instances, those with an address: a name that has never resolved joins
        the peer list when it does."""
        return [i.spec for i in self.instances.values() if i.role is not inst.role and i.addressed]

    def _peers_moved(self, moved: Instance) -> None:
        """The instances that were given `moved`'s old address (or none) leave the schedule until
        they take their role again with its new one, at once."""
        for inst in self.instances.values():
            if inst.role is not moved.role and inst.peers_given is not None and not inst.peers_stale:
                inst.peers_stale = True
                self._wake[inst.id].set()
        self.changed()

    async def _resolve(self, inst: Instance) -> bool:
        """Points `inst.spec` at what its names resolve to now; False while one does not. An address
        still among the answers is kept, so that a name with several does not flap between them."""
        c = inst.configured
        found: dict[str, str] = {}
        for name, current in ((c.ip, inst.spec.ip), (c.mgmt_ip, inst.spec.mgmt_ip)):
            if is_ip(name) or name in found:
                continue
            addresses = await resolve_ipv4(name)
            if not addresses:
                return False
            found[name] = current if current in addresses else addresses[0]
        spec = replace(c, ip=found.get(c.ip, c.ip), mgmt_ip=found.get(c.mgmt_ip, c.mgmt_ip))
        if spec != inst.spec:
            if inst.addressed:
                log.warning("%s is now at %s: a new process, it gets its role again", inst.spec.name, spec.ip)
                if inst.role_assigned:
                    inst.role_assigned = False
                    self.changed()
            else:
                log.info("%s resolves to %s", c.ip, spec.ip)
            inst.spec, inst.addressed = spec, True
            self._peers_moved(inst)
        return True

    async def _assign_role(self, inst: Instance) -> bool:
        delay = 0.1
        while (took := await self._offer_role(inst)) is None:
            await asyncio.sleep(delay)
            delay = min(delay * 2, ROLE_RETRY_MAX_S)
        return took

    async def _offer_role(self, inst: Instance) -> bool | None:
        """One attempt to give `inst` its role: True if it took it, False if it refused (a 4xx: it
        stays out of service), None if it should be asked again."""
        if not await self._resolve(inst):
            log.debug("%s does not resolve yet", inst.configured.ip)
            return None
        peers = self._peers(inst)
        try:
            config = await self.client.get(f"{inst.management_url}/v1/config")
            if config.status_code == 200:
                inst.model_name = config.json().get("modelName")
            reply = await self.client.post(f"{inst.management_url}/v1/role/{inst.role.value}",
                                           json=role_body(inst.spec, peers))
        except (httpx.HTTPError, ValueError) as exc:
            log.debug("%s is not answering yet (%s)", inst.spec.name, exc)
            return None
        if reply.status_code == 200:
            inst.peers_given = tuple(p.ip for p in peers)
            stale, inst.peers_stale = inst.peers_stale, inst.peers_given != tuple(p.ip for p in self._peers(inst))
            if inst.peers_stale:  # a peer moved while it was being asked
                self._wake[inst.id].set()
            elif stale:
                self.changed()
            if not inst.role_assigned:
                inst.role_assigned = inst.reachable = True
                log.info("%s took its role", inst.spec.name)
                self._on_role_taken(inst)
                self.changed()
            return True
        if 400 <= reply.status_code < 500:
            inst.role_error = f"{reply.status_code} {reply.text[:200]}"
            log.error("%s refused its role: %s", inst.spec.name, inst.role_error)
            if inst.role_assigned:
                inst.role_assigned = False
                self.changed()
            return False
        log.debug("%s answered %d to its role; asking again", inst.spec.name, reply.status_code)
        return None

    async def poll(self, inst: Instance) -> None:
        """Resolves its names again, reads free slots and blocks from `/v1/status` (the figures
        load_balance weighs), and gives it its role again if it lost it or its peers moved."""
        was = inst.reachable
        current_role = None
        resolved = await self._resolve(inst)
        if not resolved:
            inst.reachable = False
        else:
            try:
                reply = await self.client.get(f"{inst.management_url}/v1/status", timeout=STATUS_TIMEOUT_S)
                body = reply.json() if reply.status_code == 200 else None
                resource = body["resource"] if body else None
                inst.avail_slots = int(resource["availSlotsNum"]) if resource else None
                inst.avail_blocks = int(resource["availBlockNum"]) if resource else None
                inst.reachable = resource is not None
                current_role = body.get("service", {}).get("currentRole") if body else None
            except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
                inst.reachable = False
        inst.assigned_since_poll = 0
        if inst.reachable != was:
            log.warning("%s is %s", inst.spec.name, "reachable again" if inst.reachable else "not answering"
                        if resolved else f"unreachable: {inst.configured.ip} does not resolve")
            self.changed()
        if not inst.reachable or inst.role_error is not None:
            return
        if current_role not in (None, inst.role.value) and inst.role_assigned:
            log.warning("%s has lost its role (restarted?): it gets it again", inst.spec.name)
            inst.role_assigned = False
            self.changed()
        if not inst.role_assigned or inst.peers_stale:
            await self._offer_role(inst)
