"""Scheduling policy: which sequences run in the next step, and with how many tokens.

There are no separate prefill and decode phases. Every sequence has `token_ids` (prompt plus
generated tokens) and `num_computed_tokens` (those whose KV is cached); each step, sequences catch
up under a token budget (`maxPrefillTokens`). A decode step is a catch-up of one token, a long
prompt catches up a chunk at a time (chunked prefill, so running decodes are never stalled behind
it), a prefix-cache hit starts a sequence with tokens already computed, and a preempted sequence
starts again from zero (recompute). Running sequences are served first, oldest-priority first;
then waiting ones are admitted by (priority, arrival) while the budget, the batch limits and the
free blocks allow. When a running sequence cannot get a block, the lowest-priority, newest running
sequence is preempted. Blocks themselves belong to the BlockManager (mechanism); this module only
asks it.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from mindie.engine.block_manager import BlockManager
from mindie.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_prefill_tokens: int = 8192  # token budget of one step (maxPrefillTokens)
    max_batch_size: int = 200  # running sequences (maxBatchSize)
    max_prefill_batch_size: int = 50  # sequences with prompt tokens in one step (maxPrefillBatchSize)
    max_preempt_count: int = 200  # preemptions per step (maxPreemptCount)


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int  # tokens to compute this step, from seq.num_computed_tokens on


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.blocks = block_manager
        self.waiting: list[Sequence] = []  # sorted by sort_key
        self.running: list[Sequence] = []  # sorted by sort_key

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Takes a finished or aborted sequence out, in any phase, freeing all its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if self.blocks.has(seq.seq_id):
            self.blocks.free(seq.seq_id)
        seq.status = SequenceStatus.FINISHED

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_prefill_tokens
        prefills = 0
        scheduled_ids: set[int] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            is_prefill = seq.num_pending_tokens > 1
            if is_prefill and prefills >= self.config.max_prefill_batch_size:
                i += 1
                continue
            n = min(seq.num_pending_tokens, budget)
            if not self._grow(seq, n, out, scheduled_ids):
                break  # seq itself was preempted: everything after it is newer
            out.scheduled.append(ScheduledSequence(seq, n))
            scheduled_ids.add(id(seq))
            budget -= n
            prefills += is_prefill
            i += 1
        if out.preempted:
            return out  # blocks are short: admit nobody new this step
        held = 0  # sibling samples waiting for their lead's prompt stay in place
        while held < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_batch_size:
            if prefills >= self.config.max_prefill_batch_size:
                break
            seq = self.waiting[held]
            if not seq.admissible:
                held += 1
                continue
            cached = self.blocks.match_prefix(seq.token_ids).num_tokens
            n = min(len(seq.token_ids) - cached, budget)
            reused = self.blocks.allocate(seq.seq_id, seq.token_ids, cached + n)
            if reused is None:
                break  # strict priority order: nobody jumps the queue
            self.waiting.pop(held)
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            seq.num_computed_tokens = reused
            if seq.num_preemptions == 0:
                seq.num_cached_prompt_tokens = reused
            n = min(len(seq.token_ids) - reused, budget)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.sort_key)
            out.scheduled.append(ScheduledSequence(seq, n))
            budget -= n
            prefills += 1
        return out

    def _grow(self, seq: Sequence, n: int, out: SchedulerOutput, scheduled_ids: set[int]) -> bool:
        """Gets blocks for n more tokens of a running seq, preempting the newest unscheduled
        lower-or-equal priority sequences if needed. False if seq had to be preempted itself."""
        target = seq.num_computed_tokens + n
        while self.blocks.allocate(seq.seq_id, seq.token_ids, target) is None:
            victim = self.running[-1]
            if id(victim) in scheduled_ids:
                raise RuntimeError("KV cache too small for the sequences already scheduled this step")
            if victim is not seq and len(out.preempted) >= self.config.max_preempt_count:
                return False
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the KV, keep the tokens; the sequence re-enters the queue at
        its original place and its output continues exactly where it stopped."""
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.add(seq)

    def after_step(self, out: SchedulerOutput) -> None:
        """The model wrote KV for the scheduled tokens: advance and publish full blocks."""
        for s in out.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
            self.blocks.commit(s.seq.seq_id, s.seq.token_ids, s.seq.num_computed_tokens)
