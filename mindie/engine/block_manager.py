"""KV-cache block bookkeeping: ownership, ref counts, copy-on-write, prefix caching, LRU eviction.

Mechanism only. The scheduler decides *whether* to admit, grow, preempt or move a sequence and asks
here first (`can_allocate`, `num_free_blocks`); every mutating call either succeeds completely or
returns None / raises with no state changed. KV data is never touched: where data must move the
caller gets (src, dst) block pairs or block ids and copies with `mindie.ops.copy_blocks`.

Every block is in exactly one of three sets (see `check_invariants`):
  free       ref 0, no hash              plain free heap, handed out lowest id first
  evictable  ref 0, registered hash      LRU order: least recently freed is evicted first
  used       ref > 0                     = number of block-table entries pointing at it
A block's hash is registered by `commit` once it is full and computed (or by `import_sequence`),
and dropped only when the block is evicted for reuse. Hashes are chained sha256 digests of the
block's tokens, so equal hashes mean equal token prefixes, not just equal blocks.

A table may start with holes (`HOLE`): blocks released by `release_before` while the sequence
runs, because every layer attends to a sliding window and no query of the sequence reads them
again. A hole keeps the table positional (position p is still in entry p // block_size) and counts
as no reference; a released block is freed as `free` frees it, so a cached prefix block stays
cached, unchanged, for other sequences.
"""

from __future__ import annotations

import hashlib
import heapq
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

__all__ = ["HOLE", "BlockManager", "PrefixMatch", "hash_block"]

HOLE = -1  # a table entry whose block was released (see release_before): no block, never read

ROOT_HASH = hashlib.sha256(b"mindie.block_manager.v1").digest()  # parent of every first block


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """sha256(parent hash + token ids as little-endian int64): a block's chained hash."""
    return hashlib.sha256(parent + struct.pack(f"<{len(token_ids)}q", *token_ids)).digest()


class PrefixMatch(NamedTuple):
    block_ids: list[int]  # cached blocks covering the matched prefix, in order
    num_tokens: int  # = len(block_ids) * block_size


class _Plan(NamedTuple):
    reuse: list[int]  # prefix-cache blocks to share, in order
    hashes: list[bytes]  # the chained hashes of the whole matched prefix (holes' blocks first)
    need: int  # fresh blocks to take
    holes: int  # matched blocks left out of the table, before `reuse` (a window passed them)


@dataclass
class _Seq:
    table: list[int] = field(default_factory=list)  # position p lives in block table[p // bs]
    hashes: list[bytes] = field(default_factory=list)  # hashes of the leading committed blocks
    released: int = 0  # the table's first `released` entries are HOLEs


class BlockManager:
    """A pool of `num_blocks` blocks of `block_size` tokens, ids 0..num_blocks-1."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        if num_blocks < 0 or block_size <= 0:
            raise ValueError(f"bad pool shape: {num_blocks} blocks of {block_size} tokens")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._free = list(range(num_blocks))  # a heap (sorted is a valid heap)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # first = least recently freed
        self._hash_of: dict[int, bytes] = {}  # block id -> registered hash
        self._block_of: dict[bytes, int] = {}  # registered hash -> block id
        self._seqs: dict[str, _Seq] = {}
        self.prefix_query_tokens = 0  # prompt tokens seen by first allocations
        self.prefix_hit_tokens = 0  # of which served from the prefix cache

    # --- queries (never modify state) ------------------------------------------------------

    def num_free_blocks(self) -> int:
        """Blocks obtainable right now: plain free + evictable cached."""
        return len(self._free) + len(self._evictable)

    def num_used_blocks(self) -> int:
        """Blocks with ref count > 0."""
        return self.num_blocks - self.num_free_blocks()

    def num_cached_blocks(self) -> int:
        """Evictable blocks that still hold a registered prefix (ref 0, hash kept)."""
        return len(self._evictable)

    def has(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    def block_table(self, seq_id: str) -> list[int]:
        """A copy of seq_id's block table (released entries are HOLE). KeyError if unknown."""
        return list(self._seqs[seq_id].table)

    def num_released(self, seq_id: str) -> int:
        """How many leading entries of seq_id's table are holes. KeyError if unknown."""
        return self._seqs[seq_id].released

    export_blocks = block_table  # the seq's block ids in order, for copying its KV out

    def ref_count(self, block_id: int) -> int:
        """How many block-table entries reference block_id."""
        return self._ref[block_id]

    def num_blocks_needed(self, num_tokens: int) -> int:
        """ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        """Longest run of registered full blocks matching token_ids' prefix, never covering the last
        token (at most (len - 1) // block_size blocks). Empty when caching is off."""
        blocks, _ = self._match(token_ids)
        return PrefixMatch(blocks, len(blocks) * self.block_size)

    def _match(self, token_ids: Sequence[int]) -> tuple[list[int], list[bytes]]:
        if not self.enable_prefix_caching:
            return [], []
        bs, blocks, hashes, parent = self.block_size, [], [], ROOT_HASH
        for i in range(max(len(token_ids) - 1, 0) // bs):
            parent = hash_block(parent, token_ids[i * bs : (i + 1) * bs])
            block = self._block_of.get(parent)
            if block is None:
                break
            blocks.append(block)
            hashes.append(parent)
        return blocks, hashes

    # --- allocation -------------------------------------------------------------------------

    def _plan(self, seq_id: str, token_ids: Sequence[int], num_tokens: int, reuse_prefix: bool = True,
              window: int = 0) -> _Plan | None:
        """What `allocate` would do, or None if not enough blocks are obtainable now."""
        seq = self._seqs.get(seq_id)
        holes = 0
        if seq is not None:
            reuse, hashes = [], []
            need = max(self.num_blocks_needed(num_tokens) - len(seq.table), 0)
        else:
            reuse, hashes = self._match(token_ids) if reuse_prefix else ([], [])
            keep = min(len(reuse), num_tokens // self.block_size)
            if window:  # what release_before would release once the first query (position keep * bs) ran
                holes = min(max(keep * self.block_size - window + 1, 0) // self.block_size, keep)
            reuse, hashes = reuse[holes:keep], hashes[:keep]
            need = self.num_blocks_needed(num_tokens) - keep
        reviving = sum(1 for b in reuse if self._ref[b] == 0)  # these leave the evictable set
        return _Plan(reuse, hashes, need, holes) if need <= self.num_free_blocks() - reviving else None

    def can_allocate(self, seq_id: str, token_ids: Sequence[int], num_tokens: int) -> bool:
        """Whether `allocate` with the same arguments would succeed now. Modifies nothing."""
        return self._plan(seq_id, token_ids, num_tokens) is not None

    def allocate(self, seq_id: str, token_ids: Sequence[int], num_tokens: int, reuse_prefix: bool = True,
                 window: int = 0) -> int | None:
        """Make seq_id own blocks covering positions [0, num_tokens).

        First call for seq_id: reuses the prefix match of token_ids (capped at num_tokens rounded
        down to whole blocks; those blocks get ref + 1) and returns the number of reused tokens,
        which the caller need not compute. With `window` (every layer slides; see release_before)
        the matched blocks wholly before the first computed position's window enter the table as
        HOLEs, unreferenced: a long cached prefix then takes no more blocks than the window does.
        Later calls only extend the table and return 0 (the table never shrinks; token_ids is then
        unused). Returns None, changing nothing, if not enough blocks are obtainable - test the
        result with `is None`, 0 is a success. `reuse_prefix=False` computes everything (prompt
        log-probabilities need every position).
        """
        plan = self._plan(seq_id, token_ids, num_tokens, reuse_prefix, window)
        if plan is None:
            return None
        reuse, hashes, need, holes = plan
        seq = self._seqs.get(seq_id)
        if seq is None:
            seq = self._seqs[seq_id] = _Seq(table=[HOLE] * holes, hashes=hashes, released=holes)
            self.prefix_query_tokens += len(token_ids)
            self.prefix_hit_tokens += len(hashes) * self.block_size
        for block in reuse:
            self._evictable.pop(block, None)
            self._ref[block] += 1
        seq.table += reuse + [self._take_fresh() for _ in range(need)]
        return (holes + len(reuse)) * self.block_size

    def _take_fresh(self) -> int:
        """A block with ref 1: lowest free id, else evict the least recently freed cached block."""
        if self._free:
            block = heapq.heappop(self._free)
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._hash_of.pop(block)]
        else:
            raise RuntimeError("no KV-cache block obtainable (check num_free_blocks first)")
        self._ref[block] = 1
        return block

    def commit(self, seq_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """After KV for positions < num_computed was written: register the hash of every full,
        computed block of seq_id not registered yet. token_ids is the seq's whole token list. A hash
        already registered to another block keeps that registration. KeyError for an unknown seq;
        ValueError (nothing changed) if num_computed exceeds the table or token_ids, or if token_ids
        disagree with a block's existing registration."""
        seq = self._seqs[seq_id]
        if num_computed > min(len(token_ids), len(seq.table) * self.block_size):
            raise ValueError(f"{seq_id}: {num_computed} computed > tokens or table capacity")
        if not self.enable_prefix_caching:
            return
        bs, new = self.block_size, []
        parent = seq.hashes[-1] if seq.hashes else ROOT_HASH
        if seq.released > len(seq.hashes) and num_computed // bs > len(seq.hashes):
            raise ValueError(f"{seq_id}: blocks released before they were committed")
        for i in range(len(seq.hashes), num_computed // bs):
            parent = hash_block(parent, token_ids[i * bs : (i + 1) * bs])
            known = self._hash_of.get(seq.table[i])
            if known is not None and known != parent:
                raise ValueError(f"{seq_id}: block {seq.table[i]} registered with other tokens")
            new.append(parent)
        for i, h in enumerate(new, start=len(seq.hashes)):
            if h not in self._block_of:
                self._block_of[h], self._hash_of[seq.table[i]] = seq.table[i], h
        seq.hashes += new

    def fork(self, parent_id: str, child_id: str) -> None:
        """child_id gets a copy of parent_id's table; each block's ref count + 1. KeyError if the
        parent is unknown, ValueError if child_id exists."""
        parent = self._seqs[parent_id]
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id!r} already exists")
        for block in parent.table[parent.released:]:
            self._ref[block] += 1
        self._seqs[child_id] = _Seq(list(parent.table), list(parent.hashes), parent.released)

    def prepare_append(self, seq_id: str, position: int) -> list[tuple[int, int]]:
        """Before KV is written at `position`: if its block is shared (ref > 1), copy-on-write -
        a fresh block replaces it in seq_id's table, the old one gets ref - 1, and [(old, new)] is
        returned for the caller to copy. Otherwise []. KeyError for an unknown seq, IndexError if
        the table does not cover position, RuntimeError (nothing changed) if no block is
        obtainable."""
        seq = self._seqs[seq_id]
        table = seq.table
        if not seq.released * self.block_size <= position < len(table) * self.block_size:
            raise IndexError(f"{seq_id}: position {position} not covered by {len(table)} blocks "
                             f"({seq.released} released)")
        idx = position // self.block_size
        old = table[idx]
        if self._ref[old] <= 1:
            return []
        table[idx] = self._take_fresh()
        self._ref[old] -= 1
        return [(old, table[idx])]

    def blocks_to_write(self, writes: Sequence[tuple[str, int, int]]) -> int:
        """Fresh blocks that `allocate(seq_id, _, end)` then `prepare_write(seq_id, start, end)`
        for every (seq_id, start, end) in writes (known seqs, each once) would take together.
        A block shared by r tables and written by w of them takes min(w, r - 1) copies: the last
        holder writes in place. Modifies nothing."""
        need = 0
        writers: dict[int, int] = {}  # existing block -> tables writing into it
        for seq_id, start, end in writes:
            table = self._seqs[seq_id].table
            covered = self.num_blocks_needed(end)
            need += max(covered - len(table), 0)
            for idx in range(start // self.block_size, min(covered, len(table))):
                writers[table[idx]] = writers.get(table[idx], 0) + 1
        return need + sum(min(w, self._ref[b] - 1) for b, w in writers.items() if self._ref[b] > 1)

    def prepare_write(self, seq_id: str, start: int, end: int) -> list[tuple[int, int]]:
        """`prepare_append` for each block holding a position in [start, end): the (src, dst)
        copies to make before writing there. Same errors as prepare_append."""
        copies, bs = [], self.block_size
        for idx in range(start // bs, -(-end // bs)):
            copies += self.prepare_append(seq_id, max(idx * bs, start))
        return copies

    def free(self, seq_id: str) -> None:
        """Release every block of seq_id (ref - 1) and forget it. Blocks are released last block
        first, so a prefix's head is evicted after its tail. A block reaching ref 0 becomes
        evictable-cached if it holds a registered hash, plain free otherwise. KeyError if
        unknown."""
        seq = self._seqs.pop(seq_id)
        for block in reversed(seq.table[seq.released:]):
            self._release(block)

    def release_before(self, seq_id: str, position: int) -> int:
        """Release seq_id's blocks that hold only positions < `position` (ref - 1 each, as `free`
        does), leaving HOLEs in their table entries: for a sequence no query of which will read
        those keys again (every layer's sliding window has passed them). The caller commits the
        blocks first, so that a prefix they hold stays cached. Returns how many were released.
        KeyError if unknown."""
        seq = self._seqs[seq_id]
        end = min(max(position, 0) // self.block_size, len(seq.table))
        if end <= seq.released:
            return 0
        for idx in range(seq.released, end):
            self._release(seq.table[idx])
            seq.table[idx] = HOLE
        count, seq.released = end - seq.released, end
        return count

    def _release(self, block: int) -> None:
        self._ref[block] -= 1
        if self._ref[block] == 0:
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                heapq.heappush(self._free, block)

    def import_sequence(
        self, seq_id: str, token_ids: Sequence[int], num_tokens: int
    ) -> list[int] | None:
        """A sequence arriving with KV for positions [0, num_tokens): allocate fresh blocks (no
        prefix reuse), register its full blocks as committed, and return the block ids to copy the
        incoming KV into, in order. None (nothing changed) if not enough blocks. ValueError if
        seq_id exists or num_tokens > len(token_ids)."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already exists")
        if num_tokens > len(token_ids):
            raise ValueError(f"{seq_id}: {num_tokens} tokens of KV but {len(token_ids)} token ids")
        need = self.num_blocks_needed(num_tokens)
        if need > self.num_free_blocks():
            return None
        self._seqs[seq_id] = _Seq([self._take_fresh() for _ in range(need)])
        self.commit(seq_id, token_ids, num_tokens)
        return self.block_table(seq_id)

    # --- consistency --------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """AssertionError with details unless free + evictable + used == num_blocks (disjoint),
        ref counts equal table references, and the hash maps are consistent both ways. Counted
        with numpy: tests call it after every step, on pools of a million one-token blocks."""
        n = self.num_blocks
        free_count = np.bincount(np.asarray(self._free, dtype=np.int64), minlength=n)
        assert (free_count <= 1).all(), f"duplicate ids in free list {np.flatnonzero(free_count > 1).tolist()}"
        free = free_count > 0
        evictable = np.zeros(n, dtype=bool)
        evictable[list(self._evictable)] = True
        ref = np.asarray(self._ref, dtype=np.int64)
        used = ref > 0
        assert not (free & evictable).any(), f"free and evictable: {np.flatnonzero(free & evictable).tolist()}"
        both = (free | evictable) & used
        assert not both.any(), f"free or evictable but used: {np.flatnonzero(both).tolist()}"
        assert free.sum() + evictable.sum() + used.sum() == n, (
            f"free {free.sum()} + evictable {evictable.sum()} + used {used.sum()} != {n}"
        )
        for seq_id, seq in self._seqs.items():
            live = seq.table[seq.released:]
            assert len(set(live)) == len(live), f"{seq_id}: repeated block {seq.table}"
            assert all(b == HOLE for b in seq.table[: seq.released]) and HOLE not in live, (
                f"{seq_id}: holes other than the {seq.released} leading ones: {seq.table}")
            assert len(seq.hashes) <= len(seq.table), f"{seq_id}: more hashes than blocks"
        tables = [b for seq in self._seqs.values() for b in seq.table[seq.released:]]
        refs = np.bincount(np.asarray(tables, dtype=np.int64), minlength=n)
        bad = [(int(b), int(ref[b]), int(refs[b])) for b in np.flatnonzero(ref != refs)]
        assert not bad, f"(block, ref count, table references) mismatches: {bad}"
        hashed = self._hash_of.keys()
        skew = [(b, h.hex()[:8]) for b, h in self._hash_of.items() if self._block_of.get(h) != b]
        assert not skew and len(self._block_of) == len(hashed), f"hash maps disagree: {skew}"
        free_hashed = [b for b in hashed if free[b]]
        assert not free_hashed, f"free blocks with a hash: {sorted(free_hashed)}"
        evictable_unhashed = set(self._evictable) - hashed
        assert not evictable_unhashed, f"evictable without a hash: {sorted(evictable_unhashed)}"
        assert self.enable_prefix_caching or not hashed, "hashes registered with caching off"
