"""Scheduler policy without a model: budgets, chunking, priorities, preemption, exact block ids."""

from __future__ import annotations

from mindie.engine.block_manager import BlockManager
from mindie.engine.request import EngineRequest, SamplingParams
from mindie.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from mindie.engine.sequence import Sequence, SequenceStatus

BLOCK = 4


def seq(rid: str, prompt_len: int, priority: int = 5, arrival: float = 0.0, index: int = 0,
        lead: Sequence | None = None) -> Sequence:
    request = EngineRequest(rid, list(range(100, 100 + prompt_len)), SamplingParams(), priority=priority,
                            arrival_time=arrival)
    return Sequence(request, index, seed=0, max_total_tokens=prompt_len + 50, detokenizer=None, admit_after=lead)


def make(num_blocks: int = 32, **config) -> Scheduler:
    return Scheduler(SchedulerConfig(**config), BlockManager(num_blocks, BLOCK))


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled]


def decode_step(sched: Scheduler, out: SchedulerOutput, token: int = 7) -> None:
    """What the engine does after the model step: advance, then append a token to every
    sequence whose pending tokens are all computed."""
    sched.after_step(out)
    for s in out.scheduled:
        if s.seq.num_computed_tokens == len(s.seq.token_ids):
            s.seq.token_ids.append(token)
    sched.blocks.check_invariants()


def test_token_budget_chunks_a_long_prompt_and_keeps_decodes_running():
    sched = make(max_prefill_tokens=8)
    short = seq("short", 3, arrival=0)
    sched.add(short)
    out = sched.schedule()
    assert plan(out) == [("short#0", 3)]
    decode_step(sched, out)
    sched.add(seq("long", 20, arrival=1))
    out = sched.schedule()
    assert plan(out) == [("short#0", 1), ("long#0", 7)]  # the decode first, the prompt takes the rest
    decode_step(sched, out)
    out = sched.schedule()
    assert plan(out) == [("short#0", 1), ("long#0", 7)]
    decode_step(sched, out)
    out = sched.schedule()
    assert plan(out) == [("short#0", 1), ("long#0", 6)]  # the last chunk completes the prompt
    # Blocks are handed out lowest id first, as each sequence grows into them.
    assert sched.blocks.block_table("short#0") == [0, 3]
    assert sched.blocks.block_table("long#0") == [1, 2, 4, 5, 6]


def test_admission_follows_priority_then_arrival():
    sched = make(max_prefill_tokens=64, max_prefill_batch_size=2)
    sched.add(seq("late-low", 2, priority=5, arrival=2))
    sched.add(seq("early-low", 2, priority=5, arrival=1))
    sched.add(seq("high", 2, priority=1, arrival=3))
    assert plan(sched.schedule()) == [("high#0", 2), ("early-low#0", 2)]


def test_batch_limit_and_strict_queue_order():
    sched = make(num_blocks=3, max_batch_size=2)
    for i in range(3):
        sched.add(seq(f"r{i}", 4, arrival=i))
    assert plan(sched.schedule()) == [("r0#0", 4), ("r1#0", 4)]  # r2 waits: batch limit
    assert [s.seq_id for s in sched.waiting] == ["r2#0"]


def test_block_shortage_preempts_the_newest_lowest_priority():
    sched = make(num_blocks=4)
    old, new = seq("old", 8, arrival=0), seq("new", 8, arrival=1)
    sched.add(old)
    sched.add(new)
    out = sched.schedule()
    assert plan(out) == [("old#0", 8), ("new#0", 8)]  # 2 + 2 blocks: the pool is full
    decode_step(sched, out)
    out = sched.schedule()  # old needs a 3rd block for position 8: new is preempted
    assert plan(out) == [("old#0", 1)]
    assert [s.seq_id for s in out.preempted] == ["new#0"]
    assert new.status is SequenceStatus.WAITING and new.num_computed_tokens == 0 and new.num_preemptions == 1
    assert len(new.token_ids) == 9  # its generated token is kept and will be recomputed
    assert sched.blocks.block_table("old#0") == [0, 1, 2]
    sched.blocks.check_invariants()


def test_sibling_samples_wait_for_the_lead_prompt_then_share_it():
    sched = make(max_prefill_tokens=64)
    lead = seq("r", 10, index=0)
    sibling = seq("r", 10, index=1, lead=lead)
    sched.add(lead)
    sched.add(sibling)
    out = sched.schedule()
    assert plan(out) == [("r#0", 10)]  # the sibling is held
    decode_step(sched, out)
    out = sched.schedule()
    assert plan(out) == [("r#0", 1), ("r#1", 2)]  # 8 of its 10 prompt tokens come from the cache
    assert sched.blocks.block_table("r#1")[:2] == sched.blocks.block_table("r#0")[:2]


def test_remove_in_any_phase_frees_everything():
    sched = make(max_prefill_tokens=4)
    running, waiting = seq("running", 10, arrival=0), seq("waiting", 3, arrival=1)
    sched.add(running)
    sched.add(waiting)
    out = sched.schedule()  # running is mid-prefill, waiting had no budget left
    assert plan(out) == [("running#0", 4)]
    decode_step(sched, out)
    sched.remove(running)
    sched.remove(waiting)
    assert not sched.has_unfinished()
    assert sched.blocks.num_used_blocks() == 0
    sched.blocks.check_invariants()
