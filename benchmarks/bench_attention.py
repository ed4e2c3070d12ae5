"""Paged attention and KV-cache writes: mindie._C against plain PyTorch on this machine.

    python benchmarks/bench_attention.py [--threads N]

Decode target: 32 sequences x 1024 context tokens, 9 query / 3 kv heads, head_dim 64, bf16 KV,
block size 128. The caches rotate through four disjoint sets of blocks, so every call reads its
25 MB of KV from memory rather than from the 32 MB last-level cache.
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch
import torch.nn.functional as F
from common import bench, fmt_ms, memory_read_bandwidth

from mindie import _C, ops


def torch_paged_attention(q, key_cache, value_cache, block_tables, seq_len, scale, causal):
    """What plain PyTorch does: gather each sequence's blocks, then SDPA with GQA."""
    b, nblk = block_tables.shape
    bs, hkv, d = key_cache.shape[1:]
    k = key_cache[block_tables.long()].view(b, nblk * bs, hkv, d)[:, :seq_len].transpose(1, 2)
    v = value_cache[block_tables.long()].view(b, nblk * bs, hkv, d)[:, :seq_len].transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=causal, enable_gqa=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        _C.set_num_threads(args.threads)
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"kernel variant: {_C.get_isa()}, kernel threads: {_C.get_num_threads()}, "
          f"torch threads: {torch.get_num_threads()}")

    seqs, ctx, heads, kv_heads, d, bs = 32, 1024, 9, 3, 64, 128
    sets = 4
    nblk = ctx // bs
    num_blocks = seqs * nblk * sets
    kc = torch.randn(num_blocks, bs, kv_heads, d).bfloat16()
    vc = torch.randn(num_blocks, bs, kv_heads, d).bfloat16()
    perm = torch.randperm(num_blocks).to(torch.int32).view(sets, seqs, nblk)
    q = torch.randn(seqs, heads, d).bfloat16()
    lens = torch.full((seqs,), ctx, dtype=torch.int32)
    query_start_loc = torch.arange(seqs + 1, dtype=torch.int32)  # one query token per sequence: decode
    scale = 1 / math.sqrt(d)
    kv_bytes = 2 * seqs * ctx * kv_heads * d * 2
    it = iter(range(1 << 62))
    out = torch.empty_like(q)

    def ours():
        ops.paged_attention(q, kc, vc, perm[next(it) % sets], query_start_loc, lens, scale, out=out)

    def theirs():
        torch_paged_attention(q.unsqueeze(2), kc, vc, perm[next(it) % sets], ctx, scale, False)

    # The machine's bandwidth drifts with its neighbours: measure it interleaved with the kernel.
    rounds = [(memory_read_bandwidth(), bench(ours, min_time=0.3)) for _ in range(5)]
    bw = statistics.median(r[0] for r in rounds)
    t_ours = statistics.median(r[1] for r in rounds)
    share = statistics.median(kv_bytes / t / b for b, t in rounds)
    t_torch = bench(theirs)
    print(f"memory read bandwidth (torch sum over 1 GiB, median of 5 interleaved): {bw / 1e9:.1f} GB/s "
          f"(range {min(r[0] for r in rounds) / 1e9:.1f}-{max(r[0] for r in rounds) / 1e9:.1f})")
    print(f"\ndecode {seqs} seqs x {ctx} ctx, GQA {heads}:{kv_heads}, head_dim {d}, bf16 KV, block {bs}")
    print(f"  mindie._C  {fmt_ms(t_ours)}  {kv_bytes / t_ours / 1e9:6.1f} GB/s of KV "
          f"({share * 100:5.1f}% of the bandwidth measured beside it)")
    print(f"  torch      {fmt_ms(t_torch)}  {kv_bytes / t_torch / 1e9:6.1f} GB/s   speed-up x{t_torch / t_ours:.2f}")

    for seqs_p, plen in [(1, 512), (4, 256)]:
        nb = math.ceil(plen / bs)
        tables = torch.randperm(num_blocks)[: seqs_p * nb].to(torch.int32).view(seqs_p, nb)
        qp = torch.randn(seqs_p * plen, heads, d).bfloat16()
        qsl = torch.arange(seqs_p + 1, dtype=torch.int32) * plen
        lp = torch.full((seqs_p,), plen, dtype=torch.int32)
        outp = torch.empty_like(qp)
        qt = qp.view(seqs_p, plen, heads, d).transpose(1, 2)
        t_ours = bench(lambda: ops.paged_attention(qp, kc, vc, tables, qsl, lp, scale, out=outp))
        t_torch = bench(lambda: torch_paged_attention(qt, kc, vc, tables, plen, scale, True))
        flops = 4 * seqs_p * heads * d * plen * plen / 2
        print(f"\nprefill {seqs_p} x {plen} tokens (causal), bf16")
        print(f"  mindie._C  {fmt_ms(t_ours)}  {flops / t_ours / 1e9:6.1f} GFLOP/s")
        print(f"  torch      {fmt_ms(t_torch)}  {flops / t_torch / 1e9:6.1f} GFLOP/s   "
              f"speed-up x{t_torch / t_ours:.2f}")

    tokens = 256
    k_new = torch.randn(tokens, kv_heads, d).bfloat16()
    slots = torch.randperm(num_blocks * bs)[:tokens]
    t_ours = bench(lambda: ops.reshape_and_cache(k_new, k_new, kc, vc, slots))
    flat_k, flat_v = kc.view(-1, kv_heads, d), vc.view(-1, kv_heads, d)

    def torch_write():
        flat_k.index_copy_(0, slots, k_new)
        flat_v.index_copy_(0, slots, k_new)

    t_torch = bench(torch_write)
    print(f"\nKV write {tokens} tokens x {kv_heads} heads x {d}, bf16")
    print(f"  mindie._C  {fmt_ms(t_ours)}\n  torch      {fmt_ms(t_torch)}   speed-up x{t_torch / t_ours:.2f}")


if __name__ == "__main__":
    main()
