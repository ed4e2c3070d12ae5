"""BlockManager without a model: exact block ids, eviction order, ask-then-commit, invariants."""

from __future__ import annotations

import collections
import copy
import random

import pytest

from mindie.engine.block_manager import HOLE, ROOT_HASH, BlockManager, PrefixMatch, hash_block

BS = 4


def toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def state(m: BlockManager) -> dict:
    """Everything a failed call must leave untouched."""
    return copy.deepcopy(vars(m))


def counts(m: BlockManager) -> tuple[int, int, int]:
    return m.num_free_blocks(), m.num_used_blocks(), m.num_cached_blocks()


def run(m: BlockManager, seq_id: str, token_ids: list[int], num_tokens: int) -> int:
    """allocate + commit, as one scheduler step that computes every allocated token would."""
    reused = m.allocate(seq_id, token_ids, num_tokens)
    assert reused is not None
    m.commit(seq_id, token_ids, min(num_tokens, len(token_ids)))
    m.check_invariants()
    return reused


def test_hash_is_chained_sha256():
    import hashlib
    import struct

    h0 = hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert h0 == hashlib.sha256(ROOT_HASH + struct.pack("<4q", 1, 2, 3, 4)).digest()
    assert hash_block(h0, [5, 6, 7, 8]) != hash_block(ROOT_HASH, [5, 6, 7, 8])


def test_allocate_and_grow_exact_ids():
    m = BlockManager(10, BS)
    assert (m.num_blocks, m.block_size) == (10, BS)
    assert [m.num_blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert m.allocate("a", toks(10), 10) == 0
    assert m.block_table("a") == [0, 1, 2] and m.has("a") and not m.has("b")
    assert counts(m) == (7, 3, 0)
    assert m.allocate("a", toks(12), 12) == 0 and m.block_table("a") == [0, 1, 2]
    assert m.allocate("a", toks(13), 13) == 0 and m.block_table("a") == [0, 1, 2, 3]
    assert m.allocate("a", toks(13), 5) == 0 and m.block_table("a") == [0, 1, 2, 3]  # no shrink
    assert m.allocate("b", toks(5, 100), 5) == 0 and m.block_table("b") == [4, 5]
    assert m.allocate("c", [], 0) == 0 and m.block_table("c") == []
    table = m.block_table("a")
    table.append(99)  # a copy
    assert m.block_table("a") == [0, 1, 2, 3]
    m.free("a")
    m.check_invariants()
    assert m.allocate("d", toks(8, 200), 8) == 0 and m.block_table("d") == [0, 1]  # lowest first
    assert [m.ref_count(b) for b in range(6)] == [1, 1, 0, 0, 1, 1]
    m.check_invariants()


def test_failed_allocate_changes_nothing():
    m = BlockManager(4, BS)
    run(m, "a", toks(9), 9)  # blocks 0, 1 registered, 2 partial
    run(m, "b", toks(3, 50), 3)  # block 3
    before, before_counts = state(m), counts(m)
    assert not m.can_allocate("c", toks(5, 80), 5)
    assert m.allocate("c", toks(5, 80), 5) is None
    assert not m.can_allocate("b", toks(3, 50), 9)
    assert m.allocate("b", toks(3, 50), 9) is None
    assert state(m) == before and counts(m) == before_counts
    m.check_invariants()


def test_failed_allocate_counts_revived_cached_blocks():
    """Reused evictable blocks are no longer obtainable for the fresh part of the same request."""
    m = BlockManager(4, BS)
    run(m, "a", toks(9), 9)
    m.free("a")  # blocks 0, 1 cached; 2, 3 plain free
    assert counts(m) == (4, 0, 2)
    before = state(m)
    assert not m.can_allocate("b", toks(17), 17)  # 2 reused + 3 fresh > 4 - 2
    assert m.allocate("b", toks(17), 17) is None
    assert state(m) == before
    assert m.can_allocate("b", toks(16), 16)
    assert m.allocate("b", toks(16), 16) == 8  # match capped at (16 - 1) // 4 = 3 blocks; 2 exist
    assert m.block_table("b") == [0, 1, 2, 3] and counts(m) == (0, 4, 0)
    m.check_invariants()


def test_prefix_hit_reuses_exact_blocks():
    m = BlockManager(10, BS)
    prompt = toks(10)
    run(m, "a", prompt, 10)  # [0, 1, 2]; blocks 0 and 1 full and registered
    assert m.match_prefix(prompt + [7]) == PrefixMatch([0, 1], 8)
    # A hit on blocks still used by a running sequence shares them.
    assert m.allocate("b", prompt + [42, 43], 12) == 8
    assert m.block_table("b") == [0, 1, 3]
    assert [m.ref_count(b) for b in (0, 1, 2, 3)] == [2, 2, 1, 1]
    m.free("a")
    m.free("b")
    assert counts(m) == (10, 0, 2)
    # A hit on evictable blocks takes them out of the evictable set.
    assert m.allocate("c", prompt, 10) == 8
    assert m.block_table("c") == [0, 1, 2] and counts(m) == (7, 3, 0)
    assert (m.prefix_hit_tokens, m.prefix_query_tokens) == (16, 10 + 12 + 10)
    m.check_invariants()


def test_first_allocate_caps_reuse_at_whole_blocks_of_num_tokens():
    m = BlockManager(10, BS)
    run(m, "a", toks(13), 13)  # 3 registered blocks: 0, 1, 2
    m.free("a")
    assert m.match_prefix(toks(13)) == PrefixMatch([0, 1, 2], 12)
    assert m.allocate("b", toks(13), 7) == 4  # only 1 whole block below 7 tokens
    assert m.block_table("b") == [0, 3]  # lowest plain-free id, cached 1 and 2 kept
    assert m.num_cached_blocks() == 2
    m.check_invariants()


def test_match_never_covers_last_token():
    m = BlockManager(10, BS)
    run(m, "a", toks(8), 8)  # two full blocks registered
    assert m.match_prefix(toks(8)) == PrefixMatch([0], 4)
    assert m.match_prefix(toks(9)) == PrefixMatch([0, 1], 8)
    assert m.match_prefix(toks(4)) == PrefixMatch([], 0)
    assert m.match_prefix([]) == PrefixMatch([], 0)
    assert m.allocate("b", toks(8), 8) == 4 and m.block_table("b") == [0, 2]


def test_partial_blocks_never_hit():
    m = BlockManager(10, BS)
    m.allocate("a", toks(8), 8)
    m.commit("a", toks(8), 7)  # block 1 full but not computed
    assert m.match_prefix(toks(9)).block_ids == [0]
    run(m, "b", toks(6, 100), 6)  # second block partial
    m.free("b")
    assert m.match_prefix(toks(6, 100) + [0, 0, 0]).block_ids == [2]
    assert m.num_cached_blocks() == 1
    m.commit("a", toks(8), 8)
    assert m.match_prefix(toks(9)).block_ids == [0, 1]
    # Chained: an equal second block after a different first block does not hit.
    assert m.match_prefix([9, 9, 9, 9] + toks(4, 4) + [0]).block_ids == []
    m.check_invariants()


def test_commit_keeps_existing_registration():
    m = BlockManager(10, BS)
    run(m, "a", toks(5), 5)  # block 0 registered
    m.allocate("b", toks(5), 3)  # reuses nothing (< 1 whole block): fresh [2]
    m.allocate("b", toks(5), 5)
    assert m.block_table("b") == [2, 3]
    m.commit("b", toks(5), 5)  # same content as block 0: 0 stays the registered one
    m.free("b")
    assert m.num_cached_blocks() == 0 and m.match_prefix(toks(5)).block_ids == [0]
    with pytest.raises(ValueError):
        m.commit("a", toks(5), 9)  # beyond the table
    m.check_invariants()


def test_fork_and_copy_on_write():
    m = BlockManager(10, BS)
    prompt = toks(6)
    run(m, "p", prompt, 6)  # [0, 1]
    m.fork("p", "c")
    assert m.block_table("c") == [0, 1]
    assert (m.ref_count(0), m.ref_count(1)) == (2, 2) and counts(m) == (8, 2, 0)
    assert m.prepare_append("c", 6) == [(1, 2)]
    assert m.block_table("c") == [0, 2] and m.block_table("p") == [0, 1]
    assert [m.ref_count(b) for b in (0, 1, 2)] == [2, 1, 1]
    assert m.prepare_append("p", 6) == []  # now sole owner
    assert m.prepare_append("c", 7) == []
    m.check_invariants()
    m.free("p")
    assert [m.ref_count(b) for b in (0, 1, 2)] == [1, 0, 1] and counts(m) == (8, 2, 0)
    m.free("c")
    assert counts(m) == (10, 0, 1)  # block 0 stays cached
    m.check_invariants()


def test_blocks_to_write_counts_a_shared_block_once_per_extra_holder():
    m = BlockManager(12, BS)
    run(m, "p", toks(6), 6)  # [0, 1]: block 1 half full
    m.fork("p", "b")
    m.fork("p", "c")  # block 1 held by three tables
    assert m.blocks_to_write([("p", 6, 7)]) == 1
    assert m.blocks_to_write([("p", 6, 7), ("b", 6, 7)]) == 2
    assert m.blocks_to_write([("p", 6, 7), ("b", 6, 7), ("c", 6, 7)]) == 2  # the last one writes in place
    assert m.blocks_to_write([("p", 6, 10)]) == 2  # a copy of block 1 plus a new block for 8..9
    before = state(m)
    copies = [pair for seq in ("p", "b", "c") for pair in m.prepare_write(seq, 6, 7)]
    assert copies == [(1, 2), (1, 3)] and m.block_table("c") == [0, 1]
    assert state(m) != before and m.blocks_to_write([("p", 6, 7), ("b", 6, 7), ("c", 6, 7)]) == 0
    m.allocate("p", toks(6), 10)
    assert m.prepare_write("p", 6, 10) == [] and len(m.block_table("p")) == 3
    m.check_invariants()


def test_copy_on_write_errors_change_nothing():
    m = BlockManager(2, BS)
    m.allocate("p", toks(6), 6)
    m.fork("p", "c")
    before = state(m)
    with pytest.raises(RuntimeError):
        m.prepare_append("c", 6)
    with pytest.raises(IndexError):
        m.prepare_append("c", 8)
    assert state(m) == before
    m.check_invariants()


def test_eviction_is_least_recently_freed_first():
    m = BlockManager(6, BS)
    for i, sid in enumerate("xyz"):
        run(m, sid, toks(5, 100 * i), 5)  # x [0, 1], y [2, 3], z [4, 5]; 0, 2, 4 registered
    for sid in "yxz":
        m.free(sid)
    assert counts(m) == (6, 0, 3)
    assert m.allocate("w", toks(16, 1000), 16) == 0
    assert m.block_table("w") == [1, 3, 5, 2]  # plain free first, then y's cached block
    assert m.match_prefix(toks(5, 100)).block_ids == []  # evicted: hash dropped
    assert m.match_prefix(toks(5, 0)).block_ids == [0]
    assert m.allocate("v", toks(1, 2000), 1) == 0 and m.block_table("v") == [0]
    assert m.match_prefix(toks(5, 0)).block_ids == []
    assert m.match_prefix(toks(5, 200)).block_ids == [4] and counts(m) == (1, 5, 1)
    m.check_invariants()


def test_free_releases_tail_first():
    m = BlockManager(5, BS)
    run(m, "a", toks(13), 13)  # [0, 1, 2, 3]; 0, 1, 2 registered
    m.free("a")  # evictable order 2, 1, 0: the head of a prefix goes last
    assert m.allocate("b", toks(6, 500), 6) == 0 and m.block_table("b") == [3, 4]
    assert m.allocate("b", toks(6, 500), 9) == 0 and m.block_table("b") == [3, 4, 2]
    assert m.match_prefix(toks(13)).block_ids == [0, 1]
    assert m.allocate("b", toks(6, 500), 13) == 0 and m.block_table("b") == [3, 4, 2, 1]
    assert m.match_prefix(toks(13)).block_ids == [0]
    m.check_invariants()


def test_hit_then_free_refreshes_recency():
    m = BlockManager(4, BS)
    run(m, "x", toks(5, 0), 5)  # [0, 1], 0 registered
    run(m, "y", toks(5, 100), 5)  # [2, 3], 2 registered
    m.free("x")
    m.free("y")  # evictable order 0, 2
    assert m.allocate("c", toks(5, 0), 5) == 4 and m.block_table("c") == [0, 1]
    m.free("c")  # evictable order 2, 0
    assert m.allocate("d", toks(12, 900), 12) == 0 and m.block_table("d") == [1, 3, 2]
    assert m.match_prefix(toks(5, 100)).block_ids == []
    assert m.match_prefix(toks(5, 0)).block_ids == [0]
    m.check_invariants()


def test_prefix_caching_off_never_hits():
    m = BlockManager(10, BS, enable_prefix_caching=False)
    run(m, "a", toks(13), 13)
    m.free("a")
    assert counts(m) == (10, 0, 0)
    assert m.match_prefix(toks(13)) == PrefixMatch([], 0)
    assert m.allocate("b", toks(13), 13) == 0 and m.block_table("b") == [0, 1, 2, 3]
    assert m.import_sequence("c", toks(13), 13) == [4, 5, 6, 7]
    m.free("c")
    assert m.num_cached_blocks() == 0 and m.prefix_hit_tokens == 0
    m.check_invariants()


def test_export_and_import():
    src = BlockManager(10, BS)
    prompt = toks(10)
    run(src, "a", prompt, 10)
    assert src.export_blocks("a") == src.block_table("a") == [0, 1, 2]

    dst = BlockManager(7, BS)
    dst.allocate("other", toks(3, 70), 3)  # block 0
    before = state(dst)
    assert dst.import_sequence("big", toks(30), 30) is None and state(dst) == before
    assert dst.import_sequence("a", prompt, 10) == [1, 2, 3]
    assert dst.block_table("a") == [1, 2, 3] and counts(dst) == (3, 4, 0)
    assert dst.match_prefix(prompt + [1]) == PrefixMatch([1, 2], 8)  # full blocks committed
    with pytest.raises(ValueError):
        dst.import_sequence("a", prompt, 10)
    with pytest.raises(ValueError):
        dst.import_sequence("short", prompt, 11)
    # Continues like any sequence: grows, commits from where the import left off.
    assert dst.allocate("a", prompt + [5, 6], 12) == 0 and dst.block_table("a") == [1, 2, 3]
    dst.commit("a", prompt + [5, 6], 12)
    assert dst.match_prefix(prompt + [5, 6, 0]).block_ids == [1, 2, 3]
    # Importing a prefix that is already cached keeps the existing registration.
    assert dst.import_sequence("a2", prompt, 10) == [4, 5, 6]
    assert dst.match_prefix(prompt + [1]).block_ids == [1, 2]
    dst.check_invariants()
    dst.free("a2")
    assert dst.num_cached_blocks() == 0  # its blocks were never registered: plain free
    dst.check_invariants()


@pytest.mark.parametrize("stage", ["allocate", "chunked_prefill", "decode_growth", "fork", "hit"])
def test_abort_at_every_stage_returns_every_block(stage):
    m = BlockManager(12, BS)
    prompt = toks(14)
    if stage == "hit":
        run(m, "warm", prompt, 14)
        m.free("warm")
    m.allocate("s", prompt, 6 if stage == "chunked_prefill" else 14)
    if stage == "chunked_prefill":
        m.commit("s", prompt, 6)
        m.allocate("s", prompt, 11)  # second chunk allocated, not yet computed
    if stage in ("decode_growth", "fork"):
        m.commit("s", prompt, 14)
        tokens = prompt + [1, 2, 3]
        for n in range(15, 18):
            m.allocate("s", tokens, n)
            m.prepare_append("s", n - 1)
            m.commit("s", tokens, n)
    if stage == "fork":
        m.fork("s", "s2")
        assert m.prepare_append("s2", 17) == [(4, 5)]
        m.free("s2")
    m.check_invariants()
    assert m.num_used_blocks() > 0
    m.free("s")
    m.check_invariants()
    assert counts(m)[:2] == (12, 0) and not m.has("s")
    with pytest.raises(KeyError):
        m.free("s")


def test_unknown_and_duplicate_ids():
    m = BlockManager(4, BS)
    m.allocate("a", toks(5), 5)
    for call in (
        lambda: m.block_table("x"),
        lambda: m.export_blocks("x"),
        lambda: m.free("x"),
        lambda: m.fork("x", "y"),
        lambda: m.commit("x", toks(5), 5),
        lambda: m.prepare_append("x", 0),
    ):
        with pytest.raises(KeyError):
            call()
    m.fork("a", "b")
    before = state(m)
    with pytest.raises(ValueError):
        m.fork("a", "b")
    with pytest.raises(ValueError):
        m.import_sequence("b", toks(5), 5)
    assert state(m) == before
    m.check_invariants()


def test_release_before_leaves_holes_and_releases_as_free_does():
    m = BlockManager(8, BS)
    run(m, "a", toks(14), 14)  # blocks 0..3, the first three full and committed
    m.fork("a", "b")  # b shares every block
    assert m.release_before("a", 9) == 2  # positions < 9: blocks holding 0..7 only
    assert m.block_table("a") == [HOLE, HOLE, 2, 3] and m.num_released("a") == 2
    assert [m.ref_count(b) for b in range(4)] == [1, 1, 2, 2]  # b still holds 0 and 1
    assert m.release_before("a", 11) == 0 and m.release_before("a", 3) == 0  # nothing more, never back
    m.check_invariants()
    m.fork("a", "c")  # a fork takes the holes as they are
    assert m.block_table("c") == [HOLE, HOLE, 2, 3] and [m.ref_count(b) for b in range(4)] == [1, 1, 3, 3]
    m.free("c")
    m.free("b")  # 0 and 1 reach ref 0 holding a prefix: cached, not corrupted, still hit
    assert counts(m) == (6, 2, 2)
    assert m.match_prefix(toks(14)).block_ids == [0, 1, 2]
    with pytest.raises(IndexError, match="released"):
        m.prepare_append("a", 7)
    assert m.prepare_append("a", 13) == [] and m.release_before("a", 16) == 2
    assert m.block_table("a") == [HOLE] * 4 and m.num_used_blocks() == 0
    m.free("a")
    m.check_invariants()
    assert m.num_free_blocks() == 8


def test_a_windowed_prefix_hit_leaves_the_passed_blocks_out():
    """With a window, a first allocation takes only the matched blocks its first query's window reads:
    the rest enter as holes, unreferenced and still cached, yet count as reused tokens (not computed
    again) and keep their hashes (later commits chain on). Without the window the same hit needs
    more blocks than the pool has left."""
    m = BlockManager(8, BS)
    run(m, "a", toks(29), 29)  # blocks 0..6 full and committed, 7 partial
    m.free("a")
    assert counts(m) == (8, 0, 7)
    before = state(m)
    assert m.allocate("b", toks(60), 36) is None and state(m) == before  # 7 revived + 2 fresh > 8 free
    assert m.allocate("b", toks(60), 36, window=10) == 28  # position 28 reads keys 19 on: blocks 4..6
    # fresh: the free block 7, then the least recently freed cached one left (3: a freed its tail first)
    assert m.block_table("b") == [HOLE] * 4 + [4, 5, 6, 7, 3] and m.num_released("b") == 4
    assert counts(m) == (3, 5, 3) and m.prefix_hit_tokens == 28
    m.check_invariants()
    m.commit("b", toks(60), 36)  # positions 28..35 chain on the holes' hashes
    parent = ROOT_HASH
    for i in range(9):
        parent = hash_block(parent, toks(60)[i * BS:(i + 1) * BS])
    assert m._block_of[parent] == 3
    m.free("b")
    m.check_invariants()


def test_released_blocks_go_back_to_the_free_list_without_caching():
    m = BlockManager(4, BS, enable_prefix_caching=False)
    run(m, "a", toks(12), 12)
    assert m.release_before("a", 10) == 2 and m.num_free_blocks() == 3
    assert m.allocate("b", toks(5, 50), 5) == 0 and m.block_table("b") == [0, 1]  # lowest ids first
    m.check_invariants()
    with pytest.raises(ValueError, match="released before they were committed"):
        cached = BlockManager(4, BS)
        assert cached.allocate("c", toks(12), 12) == 0
        cached.release_before("c", 12)
        cached.commit("c", toks(12), 12)


def test_check_invariants_catches_corruption():
    m = BlockManager(4, BS)
    m.allocate("a", toks(5), 5)
    m._ref[0] += 1
    with pytest.raises(AssertionError, match="ref count"):
        m.check_invariants()


def test_randomized_stress():
    """Random ops on a small pool against a fake KV cache (a token id per slot): prefix hits,
    copy-on-write and imports must always hand back blocks holding the right tokens."""
    rng = random.Random(1234)
    m = BlockManager(24, BS)
    kv = [[None] * BS for _ in range(m.num_blocks)]
    seqs: dict[str, tuple[list[int], int]] = {}  # seq id -> (tokens, num computed)
    bases = [[rng.randrange(50) for _ in range(16)] for _ in range(3)]
    next_id = 0
    seen: collections.Counter[str] = collections.Counter()  # the paths the ops went through

    def write(sid: str, tokens: list[int], start: int, stop: int) -> None:
        for p in range(start, stop):
            for src, dst in m.prepare_append(sid, p):
                kv[dst] = list(kv[src])  # what ops.copy_blocks does
                seen["copy-on-write"] += 1
            kv[m.block_table(sid)[p // BS]][p % BS] = tokens[p]

    def read(sid: str, n: int) -> list:
        """The cached tokens of positions [0, n), None for those in released blocks."""
        table = m.block_table(sid)
        return [None if table[p // BS] == HOLE else kv[table[p // BS]][p % BS] for p in range(n)]

    def kept(sid: str, tokens: list[int], n: int) -> list:
        held = m.num_released(sid) * BS
        return [None] * min(held, n) + tokens[held:n]

    for _ in range(400):
        op = rng.choice(["new"] * 2 + ["step"] * 5 + ["fork"] * 2 + ["free"] * 3 + ["import"] + ["slide"])
        before = state(m)
        if op == "new" or not seqs:
            sid, next_id = f"s{next_id}", next_id + 1
            base = rng.choice(bases)
            suffix = [rng.randrange(50) for _ in range(rng.randrange(6))]
            tokens = base[: rng.randrange(1, 17)] + suffix
            target = rng.randrange(1, len(tokens) + 1)
            reused = m.allocate(sid, tokens, target)
            if reused is None:
                assert state(m) == before
                seen["failed"] += 1
            else:
                assert reused % BS == 0 and reused <= target
                seen["hit"] += reused > 0
                assert read(sid, reused) == tokens[:reused]  # a hit hands back the right KV
                write(sid, tokens, reused, target)
                m.commit(sid, tokens, target)
                seqs[sid] = (tokens, target)
        elif op == "step":
            sid = rng.choice(sorted(seqs))
            tokens, done = seqs[sid]
            if done == len(tokens):
                tokens = tokens + [rng.randrange(50)]  # decode: one generated token
            target = min(len(tokens), done + rng.randrange(1, 7))
            if m.allocate(sid, tokens, target) is None:
                assert state(m) == before
                continue_step = False
            else:  # the caller checks for copy-on-write blocks before writing
                table = m.block_table(sid)
                shared = {table[p // BS] for p in range(done, target)}
                continue_step = sum(m.ref_count(b) > 1 for b in shared) <= m.num_free_blocks()
            if continue_step:
                write(sid, tokens, done, target)
                m.commit(sid, tokens, target)
                seqs[sid] = (tokens, target)
        elif op == "fork":
            parent = rng.choice(sorted(seqs))
            sid, next_id = f"s{next_id}", next_id + 1
            m.fork(parent, sid)
            seqs[sid] = (list(seqs[parent][0]), seqs[parent][1])
        elif op == "free":
            sid = rng.choice(sorted(seqs))
            m.free(sid)
            del seqs[sid]
        elif op == "slide":  # a sliding window passed: blocks before it are released
            sid = rng.choice(sorted(seqs))
            seen["released"] += m.release_before(sid, seqs[sid][1] - rng.randrange(1, 9))
        else:  # import from another server: KV arrives for every token
            sid, next_id = f"s{next_id}", next_id + 1
            tokens = rng.choice(bases)[: rng.randrange(1, 17)]
            blocks = m.import_sequence(sid, tokens, len(tokens))
            if blocks is None:
                assert state(m) == before
            else:
                seen["import"] += 1
                for p, t in enumerate(tokens):
                    kv[blocks[p // BS]][p % BS] = t
                seqs[sid] = (tokens, len(tokens))
        m.check_invariants()
        for sid, (tokens, done) in seqs.items():
            assert read(sid, done) == kept(sid, tokens, done), sid
    assert min(seen[k] for k in ("copy-on-write", "failed", "hit", "import", "released")) > 0, seen
    assert 0 < m.prefix_hit_tokens < m.prefix_query_tokens
    for sid in list(seqs):
        m.free(sid)
    m.check_invariants()
    assert m.num_free_blocks() == m.num_blocks and m.num_used_blocks() == 0
