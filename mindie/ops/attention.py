"""Paged attention and the paged KV cache it reads: writing a step's keys and values into their
slots, copying whole blocks (copy-on-write), attending over the blocks."""

from __future__ import annotations

import torch

from mindie import _C


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` [tokens, kv_heads, head_dim] into the paged caches at
    ``slot_mapping`` (int64, ``block * block_size + offset``; negative skips a token)."""
    _C.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def copy_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy whole blocks ``src_cache[m[i, 0]] -> dst_cache[m[i, 1]]`` (int64 [n, 2])."""
    _C.copy_blocks(src_cache, dst_cache, block_mapping)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    partition_size: int = 0,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of a flattened batch over its paged KV cache.

    ``query`` [tokens, heads, head_dim]; sequence ``s`` owns query rows
    ``query_start_loc[s]:query_start_loc[s + 1]`` and has ``seq_lens[s]`` cached tokens, the new
    ones included (write them with :func:`reshape_and_cache` first). Covers decode, prefill,
    chunked prefill and prefix-cache hits in one call. ``window`` > 0 (sliding-window layers): a
    query at position ``p`` sees keys ``p - window + 1 .. p`` only. ``softcap`` > 0: scaled scores
    become ``softcap * tanh(score / softcap)`` (attention logit soft-capping).
    """
    if out is None:
        out = torch.empty_like(query)
    _C.paged_attention(
        out, query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, partition_size, window,
        softcap,
    )
    return out
