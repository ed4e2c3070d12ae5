"""Picks the P and the D for a request.

`round_robin` takes the instances of a role in turn. `load_balance` takes the one with the most free
slots, then the most free blocks, as its last `/v1/status` poll said, less the requests sent to it
since that poll (which its figures cannot count yet); ties go round robin. Either way an instance
already holding `single_node_max_requests` requests is skipped.
"""

from __future__ import annotations

from mindie.coordinator.config import Role
from mindie.coordinator.instances import Instance, Registry


class Scheduler:
    def __init__(self, registry: Registry, algorithm: str, per_instance_limit: int) -> None:
        if algorithm not in ("round_robin", "load_balance"):
            raise ValueError(f"unknown scheduling algorithm {algorithm!r}")
        self.registry = registry
        self.algorithm = algorithm
        self.limit = per_instance_limit
        self._next = {Role.PREFILL: 0, Role.DECODE: 0}

    def pick(self) -> tuple[Instance, Instance] | None:
        """A (P, D) pair with room, or None when either role has none now."""
        p = self._pick(Role.PREFILL)
        d = self._pick(Role.DECODE) if p is not None else None
        if p is None or d is None:
            return None
        for inst in (p, d):
            inst.assigned_since_poll += 1
        return p, d

    def _pick(self, role: Role) -> Instance | None:
        ordered = sorted(self.registry.of_role(role), key=lambda i: i.id)
        if not ordered:
            return None
        start = self._next[role] % len(ordered)
        rotated = ordered[start:] + ordered[:start]  # the round-robin order, also the tie-break
        candidates = [i for i in rotated if i.schedulable and len(i.in_flight) < self.limit]
        if not candidates:
            return None
        chosen = candidates[0]
        if self.algorithm == "load_balance":
            chosen = max(candidates, key=_free)  # max keeps the first of equals: round robin among ties
        self._next[role] = ordered.index(chosen) + 1
        return chosen


def _free(inst: Instance) -> tuple[int, int]:
    slots = inst.avail_slots if inst.avail_slots is not None else 0  # not polled yet: no better than any
    blocks = inst.avail_blocks if inst.avail_blocks is not None else 0
    return slots - inst.assigned_since_poll, blocks - inst.assigned_since_poll
