"""Scheduling policy: which sequences run in the next step, and with how many tokens.

There are no separate prefill and decode phases. Every sequence has `token_ids` (prompt plus
generated tokens) and `num_computed_tokens` (those whose KV is cached); each step, sequences catch
up under a token budget (`prefillChunkSize`, at most `maxPrefillTokens`). A decode step is a
catch-up of one token, a long prompt catches up a chunk at a time (chunked prefill, so running
decodes are never stalled behind it), a prefix-cache hit starts a sequence with tokens already
computed, and a preempted sequence starts again from zero (recompute). Running sequences are served
first, oldest-priority first; then waiting ones are admitted by (priority, arrival) while the
budget, the batch limits and the free blocks allow. When a running sequence cannot get a block, the
lowest-priority, newest running sequence is preempted. Blocks themselves belong to the BlockManager
(mechanism); this module only asks it. On a model whose every layer slides (Phi-3), blocks that have
left a sequence's window are given back as it runs (`after_step`).

The beams of a beam-search request (`Sequence.lockstep`) are one unit: admitted together or not
at all, served in the same step (all of them decode together; only a unit larger than the rest
of the step's budget is split, and the engine's beam step then waits for the last beam), given
their blocks and copy-on-write copies together, and preempted together, so that a recomputed
group never mixes beams of different lengths. From admission on, a group counts at its full beam
width against maxBatchSize. Units sharing a sort key stay contiguous: members enter the lists one
after another and a forked beam goes right after its parent.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from mindie.engine.block_manager import BlockManager
from mindie.engine.sequence import Sequence, SequenceStatus

# A step's token budget when prefillChunkSize is unset (MindIE's "dynamic"). On the CPU a step's
# matmuls reach their full rate by 256-512 rows (3B Q4_K_M, 2-core Zen 5: 155 prompt tok/s in steps
# of 256 tokens, 160 in steps of 2048; the 135 M model is fastest at 256-512); a larger step
# computes no faster, it only makes every prompt in it wait for the last one and stalls the running
# streams behind it.
DEFAULT_STEP_TOKENS = 512


@dataclass(frozen=True)
class SchedulerConfig:
    step_tokens: int = DEFAULT_STEP_TOKENS  # token budget of one step (prefillChunkSize, at most maxPrefillTokens)
    max_batch_size: int = 200  # running sequences (maxBatchSize)
    max_prefill_batch_size: int = 50  # sequences with prompt tokens in one step (maxPrefillBatchSize)
    max_preempt_count: int = 200  # preemptions per step (maxPreemptCount)
    # The sliding window every layer attends within (the model's kv_window; 0: none): a running
    # sequence's blocks wholly before the window of its next position are released after each step.
    window: int = 0


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int  # tokens to compute this step, from seq.num_computed_tokens on


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Copy-on-write (src, dst) block pairs: the runner copies them before the step writes KV.
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.blocks = block_manager
        self.waiting: list[Sequence] = []  # sorted by sort_key
        self.running: list[Sequence] = []  # sorted by sort_key
        self.num_preemptions = 0  # since start, for the metrics

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def resume(self, seq: Sequence) -> None:
        """Adds a sequence that arrives holding its blocks and computed KV (a request P handed
        off): it runs from the next step like any running sequence."""
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=lambda s: s.sort_key)

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

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Adds child, a copy of the running parent (same tokens, same computed KV), sharing all of
        the parent's blocks copy-on-write; it runs right after the parent."""
        self.blocks.fork(parent.seq_id, child.seq_id)
        child.status = SequenceStatus.RUNNING
        self.running.insert(self.running.index(parent) + 1, child)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.step_tokens
        prefills = 0
        scheduled_ids: set[int] = set()
        handled: set[int] = set()
        for seq in list(self.running):
            if budget == 0:
                break
            if id(seq) in handled or seq.status is not SequenceStatus.RUNNING:
                continue  # a member of a unit already served, or preempted by it
            unit = seq.lockstep or [seq]
            handled.update(id(s) for s in unit)
            work = self._share(unit, budget, prefills)
            if not work:
                continue
            if not self._grow(unit, work, out, scheduled_ids):
                break  # the unit itself was preempted: everything after it is newer
            out.scheduled += work
            scheduled_ids.update(id(w.seq) for w in work)
            budget -= sum(w.num_new_tokens for w in work)
            prefills += sum(w.seq.num_pending_tokens > 1 for w in work)
        if out.preempted:
            return out  # blocks are short: admit nobody new this step
        held = 0  # sibling samples waiting for their lead's prompt stay in place
        while held < len(self.waiting) and budget > 0:
            if prefills >= self.config.max_prefill_batch_size:
                break
            seq = self.waiting[held]
            if not seq.admissible:
                held += 1
                continue
            unit = seq.lockstep or [seq]
            if self._batch_size() + _width(unit) > self.config.max_batch_size:
                break
            work = self._admit(unit, budget, prefills)
            if work is None:
                break  # strict priority order: nobody jumps the queue
            out.scheduled += work
            budget -= sum(w.num_new_tokens for w in work)
            prefills += len(work)
        return out

    def _batch_size(self) -> int:
        """Running sequences, a beam group still at its prompt counted at its full width."""
        return sum(_width(s.lockstep) if s.lockstep is not None and len(s.lockstep) == 1 else 1
                   for s in self.running)

    def _chunk(self, pending: int, budget: int) -> int:
        """How many of a sequence's pending tokens to compute this step, at most `budget`. A prompt
        is never cut into a one-token piece: attention runs a one-token query as a decode row, which
        rounds differently from a prompt row, and where a prompt is cut depends on what else the
        step runs; so a token's result would depend on the batch."""
        n = min(pending, budget)
        if pending < 2 or self.config.step_tokens < 2:
            return n
        if pending - n == 1:
            n -= 1
        return n if n >= 2 else 0

    def _share(self, unit: list[Sequence], budget: int, prefills: int) -> list[ScheduledSequence]:
        """The unit's tokens for this step, in order, within the budget and the prefill-batch
        limit; beams already fully computed (waiting for their siblings) take none."""
        work = []
        for seq in unit:
            is_prefill = seq.num_pending_tokens > 1
            if is_prefill and prefills >= self.config.max_prefill_batch_size:
                continue
            n = self._chunk(seq.num_pending_tokens, budget)
            if n > 0:
                work.append(ScheduledSequence(seq, n))
                budget -= n
                prefills += is_prefill
        return work

    def _grow(self, unit: list[Sequence], work: list[ScheduledSequence], out: SchedulerOutput,
              scheduled_ids: set[int]) -> bool:
        """Gets blocks, and the copy-on-write copies of shared ones, for the unit's scheduled tokens,
        preempting the newest unscheduled lower-or-equal priority units if needed. False if the
        unit had to be preempted itself or the preemption limit was reached."""
        writes = [(w.seq.seq_id, w.seq.num_computed_tokens, w.seq.num_computed_tokens + w.num_new_tokens)
                  for w in work]
        while self.blocks.blocks_to_write(writes) > self.blocks.num_free_blocks():
            victim = self.running[-1]
            victims = victim.lockstep or [victim]
            if any(id(v) in scheduled_ids for v in victims):
                raise RuntimeError("KV cache too small for the sequences already scheduled this step")
            own = victim in unit
            if not own and len(out.preempted) >= self.config.max_preempt_count:
                return False
            for v in list(victims):
                self.preempt(v)
                out.preempted.append(v)
            if own:
                return False
        for (seq_id, start, end), w in zip(writes, work):
            self.blocks.allocate(seq_id, w.seq.token_ids, end)  # cannot fail: counted above
            out.block_copies += self.blocks.prepare_write(seq_id, start, end)
        return True

    def _admit(self, unit: list[Sequence], budget: int, prefills: int) -> list[ScheduledSequence] | None:
        """Moves a waiting unit to running with blocks for its prefix-cache hit plus this step's
        tokens, or returns None if the blocks are not there (a beam group never runs in part: the
        members already given blocks give them back). Members past the budget or the
        prefill-batch limit enter with no tokens this step."""
        plans: list[tuple[int, int]] = []  # (reused tokens, tokens this step) per member
        for seq in unit:
            reuse = not seq.wants_prompt_logprobs
            cached = self.blocks.match_prefix(seq.cache_keys).num_tokens if reuse else 0
            n = self._chunk(len(seq.token_ids) - cached, budget) if prefills < self.config.max_prefill_batch_size else 0
            reused = self.blocks.allocate(seq.seq_id, seq.cache_keys, cached + n, reuse_prefix=reuse,
                                          window=self._release_window(seq))
            if reused is None:
                for done in unit[: len(plans)]:
                    self.blocks.free(done.seq_id)
                return None
            plans.append((reused, n))
            budget -= n
            prefills += n > 0
        work = []
        for seq, (reused, n) in zip(unit, plans):
            self.waiting.remove(seq)
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            seq.num_computed_tokens = reused
            if seq.num_preemptions == 0:
                seq.num_cached_prompt_tokens = reused
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.sort_key)
            if n > 0:
                work.append(ScheduledSequence(seq, n))
        return work

    def preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the KV, keep the tokens; the sequence re-enters the queue at
        its original place and its output continues exactly where it stopped."""
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    def after_step(self, out: SchedulerOutput) -> None:
        """The model wrote KV for the scheduled tokens: advance and publish full blocks; with a
        sliding window on every layer, release the blocks no later query of the sequence reads
        (its next position p sees keys p - window + 1 .. p, and later ones see later keys). A
        request handed off after this step keeps them all: its export carries the whole prompt."""
        for s in out.scheduled:
            seq = s.seq
            seq.num_computed_tokens += s.num_new_tokens
            self.blocks.commit(seq.seq_id, seq.cache_keys, seq.num_computed_tokens)
            if self._release_window(seq):
                self.blocks.release_before(seq.seq_id, seq.num_computed_tokens - self.config.window + 1)

    def _release_window(self, seq: Sequence) -> int:
        """The window behind which `seq` gives its blocks back; 0: it keeps them all (no window, or a
        request handed off after its first step, whose export carries the whole prompt)."""
        return 0 if seq.request.handoff else self.config.window


def window_blocks(window: int, block_size: int, chunk: int) -> int:
    """The most blocks a sequence that gives back what its window has passed holds at once: before a
    step, the window - 1 keys its first query reads; the step adds at most `chunk` positions (its
    token budget), a span that touches ceil((span - 1) / block_size) + 1 blocks at worst alignment.
    A prefix-cache hit holds no more (BlockManager.allocate leaves the rest as holes)."""
    return (window - 1 + chunk - 1 + block_size - 1) // block_size + 1


def _width(unit: list[Sequence]) -> int:
    """Batch places a unit takes: a beam group's prompt forks into W beams at its first step."""
    return max(len(unit), unit[0].request.params.num_samples) if unit[0].lockstep is not None else len(unit)
