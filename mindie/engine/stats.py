"""The engine's state as readers outside its thread see it: one immutable snapshot, replaced whole
by the engine thread after every step. Management routes and metrics read only this, so they never
touch the scheduler or the block manager while a step mutates them, and what they report is one
consistent moment (free + used blocks always add up to the total)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineStats:
    running: int  # sequences being computed (a request with n samples counts n)
    waiting: int  # sequences queued or preempted
    free_blocks: int  # KV blocks obtainable now: never used or evictable prefix-cache blocks
    total_blocks: int
    prefix_query_tokens: int  # since start: prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int  # since start: of those, tokens found there
    num_preemptions: int  # since start: sequences whose KV was dropped, to be recomputed

    @property
    def used_blocks(self) -> int:
        return self.total_blocks - self.free_blocks
