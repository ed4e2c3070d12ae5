from __future__ import annotations

import torch


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached rows of one sequence, [length, kv_heads, head_dim], walking its
    block table one token at a time."""
    block_size = cache.shape[1]
    rows = [cache[int(block_table[p // block_size]), p % block_size] for p in range(length)]
    return torch.stack(rows) if rows else cache.new_empty((0, *cache.shape[2:]))


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Query i of sequence s sits at position seq_lens[s] - q_len + i and attends to cache
    positions 0..pos, or pos - window + 1..pos with a window. Query head h reads kv head
    h // (num_heads // kv_heads). Soft-capping: scores -> softcap * tanh(scores / softcap) before the
    mask. float32 math."""
    out = torch.zeros_like(query, dtype=torch.float32)
    num_heads, kv_heads = query.shape[1], key_cache.shape[2]
    group = num_heads // kv_heads
    for s in range(seq_lens.shape[0]):
        start, end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        ctx = int(seq_lens[s])
        if end == start:
            continue
        k = gather_context(key_cache, block_tables[s], ctx).float().repeat_interleave(group, dim=1)
        v = gather_context(value_cache, block_tables[s], ctx).float().repeat_interleave(group, dim=1)
        q = query[start:end].float()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        first_pos = ctx - (end - start)
        pos = torch.arange(end - start) + first_pos
        mask = torch.arange(ctx)[None, :] > pos[:, None]
        if window > 0:
            mask |= torch.arange(ctx)[None, :] <= pos[:, None] - window
        scores = scores.masked_fill(mask[None], float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)
    return out.to(query.dtype)
