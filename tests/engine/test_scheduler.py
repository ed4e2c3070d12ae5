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


def decode_step(sched: Scheduler, out: SchedulerOutput, token: int | None = 7) -> None:
    """What the engine does after the model step: advance, then append a token to every
    sequence whose pending tokens are all computed (token None: the test appends)."""
    sched.after_step(out)
    for s in out.scheduled:
        if token is not None and s.seq.num_computed_tokens == len(s.seq.token_ids):
            s.seq.token_ids.append(token)
    sched.blocks.check_invariants()


def test_token_budget_chunks_a_long_prompt_and_keeps_decodes_running():
    sched = make(step_tokens=8)
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


def test_a_prompt_is_never_cut_into_a_one_token_piece():
    # A one-token piece would run as a decode row, rounding unlike the rest of its prompt.
    sched = make(step_tokens=8)
    first = seq("a", 7, arrival=0)
    sched.add(first)
    sched.add(seq("b", 5, arrival=1))
    out = sched.schedule()
    assert plan(out) == [("a#0", 7)]  # one token of budget left: b waits rather than take it
    decode_step(sched, out)
    out = sched.schedule()
    assert plan(out) == [("a#0", 1), ("b#0", 5)]
    sched = make(step_tokens=4)
    sched.add(seq("c", 5))
    out = sched.schedule()
    assert plan(out) == [("c#0", 3)]  # 4 would leave a last piece of one
    decode_step(sched, out, token=None)
    assert plan(sched.schedule()) == [("c#0", 2)]


def test_admission_follows_priority_then_arrival():
    sched = make(step_tokens=64, max_prefill_batch_size=2)
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
    sched = make(step_tokens=64)
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
    sched = make(step_tokens=4)
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


def beam_group(rid: str, prompt_len: int, width: int, arrival: float = 0.0) -> list[Sequence]:
    """A beam request after its first beam step, as the engine leaves it: the prompt sequence
    computed, `width - 1` forks of it, each beam with one new token appended."""
    head = seq(rid, prompt_len, arrival=arrival)
    head.lockstep = [head]
    return head.lockstep


def fork_all(sched: Scheduler, group: list[Sequence], width: int, first: int = 1) -> None:
    head = group[0]
    for k in range(1, width):
        child = Sequence(head.request, first + k, 0, head.max_total_tokens, None, token_ids=list(head.token_ids),
                         num_computed_tokens=head.num_computed_tokens, lockstep=group)
        sched.fork(head, child)
        group.append(child)
    for k, s in enumerate(group):
        s.token_ids.append(200 + k)


def test_beam_group_decodes_together_with_copy_on_write():
    sched = make(step_tokens=64)
    group = beam_group("b", 6, 3)
    sched.add(group[0])
    out = sched.schedule()
    decode_step(sched, out, token=None)  # the prompt, fully computed: the engine's beam step next
    assert plan(out) == [("b#0", 6)]
    fork_all(sched, group, 3)
    assert [s.seq_id for s in sched.running] == ["b#0", "b#3", "b#2"]  # forks right after their parent
    out = sched.schedule()
    assert sorted(plan(out)) == [("b#0", 1), ("b#2", 1), ("b#3", 1)]
    # Block 1 (positions 4..7) is shared three ways: two copies (in the group's order), and the
    # last holder writes in place.
    assert out.block_copies == [(1, 2), (1, 3)]
    tables = {s.seq_id: sched.blocks.block_table(s.seq_id) for s in group}
    assert tables == {"b#0": [0, 2], "b#2": [0, 3], "b#3": [0, 1]}
    decode_step(sched, out, token=None)


def test_beam_group_is_preempted_and_readmitted_whole():
    sched = make(num_blocks=8, step_tokens=64)
    old = seq("old", 8, arrival=0)
    group = beam_group("b", 6, 3, arrival=1)
    sched.add(old)
    sched.add(group[0])
    out = sched.schedule()
    decode_step(sched, out, token=None)
    fork_all(sched, group, 3)  # old: blocks 0, 1; b: 2, 3, shared three ways
    old.token_ids.append(7)
    out = sched.schedule()  # old needs block 4 for position 8, b two copies of block 3
    assert sorted(plan(out)) == [("b#0", 1), ("b#2", 1), ("b#3", 1), ("old#0", 1)]
    assert len(out.block_copies) == 2
    for _ in range(2):
        decode_step(sched, out)
        out = sched.schedule()
    # Each beam now needs a block for position 8, and only block 7 is free: the group goes.
    assert plan(out) == [("old#0", 1)]
    assert [s.seq_id for s in out.preempted] == ["b#0", "b#2", "b#3"]
    assert all(s.status is SequenceStatus.WAITING and s.num_computed_tokens == 0 for s in group)
    decode_step(sched, out)
    sched.remove(old)
    out = sched.schedule()  # all three back at once; their full blocks come from the prefix cache
    assert plan(out) == [("b#0", 1), ("b#2", 1), ("b#3", 1)]
    assert not sched.waiting and [s.num_computed_tokens for s in group] == [8, 8, 8]
    decode_step(sched, out, token=None)


def test_beam_group_admission_is_all_or_nothing():
    sched = make(num_blocks=5, step_tokens=64)
    group = beam_group("b", 6, 3)
    sched.add(group[0])
    out = sched.schedule()
    decode_step(sched, out, token=None)
    fork_all(sched, group, 3)
    for s in group:
        sched.preempt(s)
    sched.blocks.allocate("filler", [0] * 8, 8)
    # Block 0 (the prompt head, cached, shared by all three) + blocks 3 and 4 free: two beams
    # could start, three cannot, so none does.
    out = sched.schedule()
    assert plan(out) == [] and len(sched.waiting) == 3 and not sched.running
    assert sched.blocks.num_used_blocks() == 2 and sched.blocks.num_cached_blocks() == 1
    sched.blocks.check_invariants()
    sched.blocks.free("filler")
    assert sorted(plan(sched.schedule())) == [("b#0", 3), ("b#2", 3), ("b#3", 3)]


def test_beam_group_larger_than_the_budget_is_split():
    sched = make(step_tokens=2)
    group = beam_group("b", 2, 3)
    sched.add(group[0])
    out = sched.schedule()
    decode_step(sched, out, token=None)
    fork_all(sched, group, 3)
    out = sched.schedule()
    assert plan(out) == [("b#0", 1), ("b#2", 1)]  # in the group's (the search's) order
    decode_step(sched, out, token=None)
    out = sched.schedule()  # the computed beams wait: only the last one runs
    assert plan(out) == [("b#3", 1)]
