"""Picks the P and the D for a request.

`round_robin` takes the instances of a role in turn. `load_balance` takes the one with the most free
slots, then the most free blocks, as its last `/v1/status` poll said, less the requests sent to it
since that poll (which its figures cannot count yet); ties go round robin. Either way an instance
already holding `single_node_max_requests` requests is skipped.

`cache_affinity` picks D as `load_balance` does, and P by the prompt (`affinity.PrefixIndex`): the
P that was sent the longest prefix of this request (ties by load), unless that P is busy, when it
takes the `load_balance` choice instead. A request whose longest prefix anywhere is under
`MIN_SHARE` of it (a new conversation that shares only a system prompt, an unrelated prompt) goes
by load too. A P is busy when it has no free slot, or when it has more than `BUSY_MARGIN` requests
more waiting for their first token than the `load_balance` choice has.
"""

from __future__ import annotations

from mindie.coordinator.affinity import Prefixes, PrefixIndex, prefixes
from mindie.coordinator.config import Role
from mindie.coordinator.instances import Instance, Registry
from mindie.coordinator.requests import RequestTable
from mindie.server.protocols.family import Family

# A hit saves at most the prefill of one prompt, and every request P has not answered yet delays a
# newcomer by about its own prefill, less what its own hits saved. So a couple of requests beyond the
# least-loaded P is about where waiting eats the saving: a judgement, not a measurement. SGLang's
# router leaves its cache-aware choice the same way, past an absolute imbalance of waiting requests.
BUSY_MARGIN = 2
# Below half the prompt, a hit saves less than half its prefill, and spreading the load matters more:
# otherwise every new conversation would follow the P that first got a short shared system prompt.
# SGLang's router's cache_threshold defaults to the same 0.5.
MIN_SHARE = 0.5


class Scheduler:
    def __init__(self, registry: Registry, table: RequestTable, algorithm: str, per_instance_limit: int) -> None:
        if algorithm not in ("round_robin", "load_balance", "cache_affinity"):
            raise ValueError(f"unknown scheduling algorithm {algorithm!r}")
        self.registry = registry
        self.table = table
        self.algorithm = algorithm
        self.limit = per_instance_limit
        self.index = PrefixIndex()
        self._next = {Role.PREFILL: 0, Role.DECODE: 0}

    def pick(self, family: Family, body: bytes, prefer_p: Instance | None = None) -> tuple[Instance, Instance] | None:
        """A (P, D) pair with room for the request (its family and body), or None when either role
        has none now. `prefer_p` is the P when it has room (a recompute's media are held there)."""
        prompt = prefixes(family.prompt(body) if self.algorithm == "cache_affinity" else None)
        p = self._pick(Role.PREFILL, prompt, prefer_p)
        d = self._pick(Role.DECODE, None) if p is not None else None
        if p is None or d is None:
            return None
        for inst in (p, d):
            inst.assigned_since_poll += 1
        if prompt.hashes:
            self.index.record(p.id, prompt.hashes)
        return p, d

    def forget_departed(self) -> None:
        """Drops what the index knows of every P out of the schedule: its cache may be gone."""
        for inst_id in self.index.instance_ids:
            inst = self.registry.instances.get(inst_id)
            if inst is None or not inst.schedulable:
                self.index.forget(inst_id)

    def _pick(self, role: Role, prompt: Prefixes | None, prefer: Instance | None = None) -> Instance | None:
        ordered = sorted(self.registry.of_role(role), key=lambda i: i.id)
        if not ordered:
            return None
        start = self._next[role] % len(ordered)
        rotated = ordered[start:] + ordered[:start]  # the round-robin order, also the tie-break
        candidates = [i for i in rotated if i.schedulable and len(i.in_flight) < self.limit]
        if not candidates:
            return None
        chosen = candidates[0]
        if prefer in candidates:
            chosen = prefer
        elif self.algorithm != "round_robin":
            chosen = max(candidates, key=_free)  # max keeps the first of equals: round robin among ties
        if prompt is not None and prompt.hashes and prefer not in candidates:
            chosen = self._affine(candidates, prompt, chosen)
        self._next[role] = ordered.index(chosen) + 1
        return chosen

    def _affine(self, candidates: list[Instance], prompt: Prefixes, by_load: Instance) -> Instance:
        matched = {inst: self.index.longest(inst.id, prompt.hashes) for inst in candidates}
        best = max(matched.values())
        if prompt.share(best) < MIN_SHARE:
            return by_load
        holder = max((inst for inst in candidates if matched[inst] == best), key=_free)
        return by_load if self._busy(holder, by_load) else holder

    def _busy(self, p: Instance, by_load: Instance) -> bool:
        return _free(p)[0] <= 0 or self.table.unanswered(p) > self.table.unanswered(by_load) + BUSY_MARGIN


def _free(inst: Instance) -> tuple[int, int]:
    slots = inst.avail_slots if inst.avail_slots is not None else 0  # not polled yet: no better than any
    blocks = inst.avail_blocks if inst.avail_blocks is not None else 0
    return slots - inst.assigned_since_poll, blocks - inst.assigned_since_poll
