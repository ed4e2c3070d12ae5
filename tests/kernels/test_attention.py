from __future__ import annotations

import math
import random

import pytest
import torch
from reference.attention import paged_attention as ref_paged_attention

from mindie import _C, ops

DTYPES = {  # (query dtype, kv dtype) -> (atol, rtol)
    (torch.float32, torch.float32): (2e-5, 2e-5),
    (torch.bfloat16, torch.bfloat16): (1.6e-2, 1.6e-2),
    (torch.float32, torch.bfloat16): (2e-5, 2e-5),
}


def make_batch(
    q_lens: list[int],
    ctx_lens: list[int],
    num_heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    gen: torch.Generator,
    spare_blocks: int = 3,
) -> dict:
    blocks_per_seq = [math.ceil(c / block_size) for c in ctx_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    max_blocks = max([*blocks_per_seq, 1]) + 1  # one unused column: tables are wider than needed
    tables = torch.full((len(q_lens), max_blocks), -7, dtype=torch.int32)  # junk past the end
    used = 0
    for s, n in enumerate(blocks_per_seq):
        tables[s, :n] = perm[used : used + n]
        used += n
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return dict(
        query=torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(q_dtype),
        key_cache=torch.randn(shape, generator=gen).to(kv_dtype),
        value_cache=torch.randn(shape, generator=gen).to(kv_dtype),
        block_tables=tables,
        query_start_loc=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32),
        seq_lens=torch.tensor(ctx_lens, dtype=torch.int32),
        scale=1.0 / math.sqrt(head_dim),
    )


def check(batch: dict, partition_size: int = 0, window: int = 0, softcap: float = 0.0) -> None:
    out = ops.paged_attention(**batch, partition_size=partition_size, window=window, softcap=softcap)
    ref = ref_paged_attention(**batch, window=window, softcap=softcap)
    atol, rtol = DTYPES[(batch["query"].dtype, batch["key_cache"].dtype)]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("q_dtype,kv_dtype", list(DTYPES))
@pytest.mark.parametrize(
    "num_heads,kv_heads,head_dim", [(4, 4, 64), (9, 3, 64), (8, 1, 33), (6, 2, 17), (2, 1, 128)]
)
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_decode_matches_reference(isa, q_dtype, kv_dtype, num_heads, kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(1)
    # Lengths on and around block boundaries, batch of many.
    ctx = [1, block_size - 1 or 1, block_size, block_size + 1, 2 * block_size + 3, 40]
    check(make_batch([1] * len(ctx), ctx, num_heads, kv_heads, head_dim, block_size, q_dtype, kv_dtype, gen))


@pytest.mark.parametrize("q_dtype,kv_dtype", list(DTYPES))
@pytest.mark.parametrize(
    "num_heads,kv_heads,head_dim", [(24, 8, 128), (16, 8, 64), (32, 8, 64), (16, 16, 64), (30, 6, 128)]
)
def test_decode_walks_blocks_in_segments(isa, q_dtype, kv_dtype, num_heads, kv_heads, head_dim):
    """Cache rows of 1-4 KB: decode walks a 128-token block in segments of 32 KB of key rows (8-32
    tokens), heads a kv head's group at a time (2-4 queries per kv head) or four at a time (1 or 5);
    contexts end inside, on and past segment and block boundaries, in one batch and one at a time."""
    gen = torch.Generator().manual_seed(5)
    ctx = [1, 7, 8, 9, 17, 31, 32, 33, 127, 128, 129, 300]
    batch = make_batch([1] * len(ctx), ctx, num_heads, kv_heads, head_dim, 128, q_dtype, kv_dtype, gen)
    check(batch)
    for s in (4, 11):  # alone, each context is also split over key ranges and kv heads
        one = dict(batch, query=batch["query"][s : s + 1], block_tables=batch["block_tables"][s : s + 1],
                   query_start_loc=torch.tensor([0, 1], dtype=torch.int32), seq_lens=batch["seq_lens"][s : s + 1])
        check(one)


@pytest.mark.parametrize("q_dtype,kv_dtype", list(DTYPES))
@pytest.mark.parametrize("partition_size", [1, 7, 32])
def test_decode_split_context(isa, q_dtype, kv_dtype, partition_size):
    gen = torch.Generator().manual_seed(2)
    ctx = [300, 33, 1, 64]
    check(make_batch([1] * 4, ctx, 9, 3, 64, 16, q_dtype, kv_dtype, gen), partition_size)


@pytest.mark.parametrize("q_dtype,kv_dtype", list(DTYPES))
@pytest.mark.parametrize("kv_heads,group", [(1, 4), (3, 3), (8, 2), (5, 1)])
@pytest.mark.parametrize("ctx", [[37], [700], [1300, 5], [600, 20, 9]])
@pytest.mark.parametrize("block_size", [16, 128])
def test_small_batch_decode_splits_heads_and_context(isa, q_dtype, kv_dtype, kv_heads, group, ctx, block_size):
    """A batch too small to keep the threads busy is split over key ranges (merged) and, where
    threads are still idle, over kv head ranges: every combination, at several pool sizes, against
    the reference."""
    gen = torch.Generator().manual_seed(9)
    batch = make_batch([1] * len(ctx), ctx, kv_heads * group, kv_heads, 64, block_size, q_dtype, kv_dtype, gen)
    threads = _C.get_num_threads()
    try:
        for t in (1, 2, 8):
            _C.set_num_threads(t)
            for partition_size in (0, 256):  # 256: the fixed spans the model step uses
                check(batch, partition_size)
    finally:
        _C.set_num_threads(threads)


@pytest.mark.parametrize("q_dtype,kv_dtype", list(DTYPES))
def test_decode_row_does_not_depend_on_the_head_split(isa, q_dtype, kv_dtype):
    """With the model step's fixed key spans, a decode row alone (its kv heads split over the threads)
    equals the same row in a batch large enough that no row is split over heads, bit for bit: a
    head's sums are the same wherever it runs."""
    gen = torch.Generator().manual_seed(10)
    ctx = [200, 17, 64, 3, 99, 700, 31, 8, 300, 77]
    batch = make_batch([1] * len(ctx), ctx, 16, 8, 64, 16, q_dtype, kv_dtype, gen)
    together = ops.paged_attention(**batch, partition_size=256)
    for s in range(len(ctx)):
        alone = {**batch, "query": batch["query"][s:s + 1], "block_tables": batch["block_tables"][s:s + 1],
                 "query_start_loc": torch.tensor([0, 1], dtype=torch.int32), "seq_lens": batch["seq_lens"][s:s + 1]}
        assert torch.equal(ops.paged_attention(**alone, partition_size=256), together[s:s + 1]), s


@pytest.mark.parametrize("q_dtype,kv_dtype", list(DTYPES))
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(6, 2, 128), (4, 4, 80), (3, 1, 40)])
def test_prefill_over_whole_blocks(isa, q_dtype, kv_dtype, heads, kv_heads, head_dim):
    """Prompts over 128-token blocks, whose keys the vector variants transpose in squares (16 x 16 on
    AVX-512, 8 x 8 on AVX2): head dims of whole squares (128, 80) and with a remainder (40 on
    AVX-512), keys of whole squares and a block's partial end, a prompt alone and one extending a
    cached prefix."""
    gen = torch.Generator().manual_seed(11)
    q_lens, ctx = [300, 70], [300, 203]
    check(make_batch(q_lens, ctx, heads, kv_heads, head_dim, 128, q_dtype, kv_dtype, gen))


@pytest.mark.parametrize("q_dtype,kv_dtype", list(DTYPES))
@pytest.mark.parametrize("block_size", [1, 7, 16, 32])
def test_prefill_and_extend(isa, q_dtype, kv_dtype, block_size):
    gen = torch.Generator().manual_seed(3)
    # Full prefill, chunked prefill / prefix hit (q_len < ctx), decode rows mixed in.
    q_lens = [37, 5, 1, 16, 17, 1]
    ctx = [37, 70, 20, 16, 50, 1]
    check(make_batch(q_lens, ctx, 9, 3, 64, block_size, q_dtype, kv_dtype, gen))


@pytest.mark.parametrize("q_dtype,kv_dtype", list(DTYPES))
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (6, 2, 17)])
def test_prefill_rows_do_not_depend_on_the_chunking(isa, q_dtype, kv_dtype, heads, kv_heads, head_dim):
    # Chunk boundaries depend on what else the scheduler runs; a query row's output must not.
    gen = torch.Generator().manual_seed(5)
    ctx = 75
    whole = make_batch([ctx], [ctx], heads, kv_heads, head_dim, 16, q_dtype, kv_dtype, gen)
    want = ops.paged_attention(**whole)
    for cuts in ([30], [2, 40], [33, 35, 73]):  # the scheduler never cuts off one token (see Scheduler._chunk)
        starts = [0, *cuts]
        ends = [*cuts, ctx]
        for a, b in zip(starts, ends):
            chunk = {**whole, "query": whole["query"][a:b],
                     "query_start_loc": torch.tensor([0, b - a], dtype=torch.int32),
                     "seq_lens": torch.tensor([b], dtype=torch.int32)}
            assert torch.equal(ops.paged_attention(**chunk), want[a:b]), (cuts, a, b)


def test_randomized(isa):
    rng = random.Random(4)
    gen = torch.Generator().manual_seed(4)
    for _ in range(25):
        kv_heads = rng.choice([1, 2, 3])
        num_heads = kv_heads * rng.choice([1, 2, 3, 4])
        head_dim = rng.choice([8, 15, 32, 64, 80])
        block_size = rng.choice([1, 3, 8, 16, 32])
        n = rng.choice([1, 1, 2, 5, 9])
        ctx = [rng.randint(1, 90) for _ in range(n)]
        q_lens = [rng.choice([1, c, rng.randint(1, c)]) for c in ctx]
        q_dtype, kv_dtype = rng.choice(list(DTYPES))
        batch = make_batch(q_lens, ctx, num_heads, kv_heads, head_dim, block_size, q_dtype, kv_dtype, gen)
        check(batch, rng.choice([0, 0, 16]))


@pytest.mark.parametrize("q_dtype,kv_dtype", list(DTYPES))
@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("window", [1, 7, 16, 33])
def test_sliding_window(isa, q_dtype, kv_dtype, block_size, window):
    """Prefill, chunked prefill and decode rows (split and not) on a sliding-window layer: windows
    shorter and longer than a block, not multiples of it, contexts shorter and far longer than them."""
    gen = torch.Generator().manual_seed(8)
    q_lens = [70, 5, 1, 1, 40, 1]
    ctx = [70, 90, 3, 100, 41, window]
    batch = make_batch(q_lens, ctx, 9, 3, 64, block_size, q_dtype, kv_dtype, gen)
    for partition_size in (0, 7):
        check(batch, partition_size, window=window)


def test_sliding_window_skips_blocks_before_it(isa):
    """Blocks wholly before every query's window are never read: NaN there changes nothing."""
    gen = torch.Generator().manual_seed(9)
    batch = make_batch([30, 1], [60, 60], 4, 2, 32, 8, torch.float32, torch.float32, gen)
    want = ops.paged_attention(**batch, window=20)
    for cache in ("key_cache", "value_cache"):
        for table in batch["block_tables"]:
            batch[cache][table[:1].long()] = float("nan")  # positions 0..7, before 30 - 20 + 1
    assert torch.equal(ops.paged_attention(**batch, window=20), want)


def test_randomized_window_and_softcap(isa):
    rng = random.Random(10)
    gen = torch.Generator().manual_seed(10)
    for _ in range(25):
        kv_heads = rng.choice([1, 2])
        head_dim = rng.choice([8, 32, 64])
        block_size = rng.choice([1, 3, 16])
        ctx = [rng.randint(1, 90) for _ in range(rng.choice([1, 3]))]
        q_lens = [rng.choice([1, c, rng.randint(1, c)]) for c in ctx]
        q_dtype, kv_dtype = rng.choice(list(DTYPES))
        batch = make_batch(q_lens, ctx, kv_heads * rng.choice([1, 3]), kv_heads, head_dim, block_size, q_dtype,
                           kv_dtype, gen)
        batch["query"] = batch["query"] * 2  # scores large enough that a cap of 1.5 bends them
        check(batch, rng.choice([0, 16]), window=rng.choice([0, 1, 6, 20]), softcap=rng.choice([0.0, 1.5, 30.0]))


def test_empty_batch_and_zero_length_queries(isa):
    gen = torch.Generator().manual_seed(5)
    batch = make_batch([], [], 4, 2, 16, 8, torch.float32, torch.float32, gen)
    assert ops.paged_attention(**batch).shape == (0, 4, 16)
    # A sequence with no new tokens contributes no rows and is skipped.
    check(make_batch([0, 3], [4, 3], 4, 2, 16, 8, torch.float32, torch.float32, gen))


def test_output_into_strided_view(isa):
    gen = torch.Generator().manual_seed(6)
    batch = make_batch([3, 1], [5, 9], 4, 2, 16, 4, torch.float32, torch.float32, gen)
    wide = torch.zeros(4, 6, 16)
    out = wide[:, 1:5]  # token stride 96, heads and dims dense
    ops.paged_attention(**batch, out=out)
    torch.testing.assert_close(out, ref_paged_attention(**batch), atol=2e-5, rtol=2e-5)
    assert torch.count_nonzero(wide[:, 0]) == 0 and torch.count_nonzero(wide[:, 5]) == 0


def bad(batch: dict, **changes) -> dict:
    return {**batch, **changes}


def test_bad_arguments_raise():
    gen = torch.Generator().manual_seed(7)
    b = make_batch([2, 1], [5, 9], 4, 2, 16, 4, torch.float32, torch.float32, gen)
    cases = [
        (bad(b, block_tables=b["block_tables"].masked_fill(b["block_tables"] >= 0, 99)), "out of range"),
        (bad(b, block_tables=b["block_tables"].masked_fill(b["block_tables"] >= 0, -1)), "out of range"),
        (bad(b, block_tables=b["block_tables"].long()), "int32"),
        (bad(b, block_tables=b["block_tables"][:, :1]), "columns"),
        (bad(b, seq_lens=torch.tensor([1, 9], dtype=torch.int32)), "smaller than"),
        (bad(b, seq_lens=torch.tensor([5], dtype=torch.int32)), "num_seqs"),
        (bad(b, query_start_loc=torch.tensor([0, 2, 4], dtype=torch.int32)), "query_start_loc"),
        (bad(b, query_start_loc=torch.tensor([0, 4, 3], dtype=torch.int32)), "non-decreasing"),
        (bad(b, query=b["query"].double()), "float32 or bfloat16"),
        (bad(b, query=torch.randn(3, 3, 16)), "multiple of kv_heads"),
        (bad(b, query=torch.randn(3, 4, 8)), "head_dim"),
        (bad(b, query=torch.randn(3, 16, 4).transpose(1, 2)), "contiguous"),
        (bad(b, key_cache=b["key_cache"].transpose(0, 1)), "contiguous"),
        (bad(b, value_cache=b["value_cache"].bfloat16()), "dtype"),
        (bad(b, scale=float("nan")), "scale"),
        (bad(b, window=-1), "window"),
        (bad(b, softcap=float("inf")), "softcap"),
        (bad(b, out=[1.0, 2.0]), "DLPack"),
    ]
    for kwargs, message in cases:
        with pytest.raises((ValueError, TypeError), match=message):
            ops.paged_attention(**kwargs)
    with pytest.raises(ValueError, match="out"):
        ops.paged_attention(**b, out=torch.empty(3, 4, 16, dtype=torch.bfloat16))
