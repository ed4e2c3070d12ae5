from __future__ import annotations

import torch


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Token t goes to block slot // block_size, offset slot % block_size; negative slots skip."""
    block_size = key_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        key_cache[slot // block_size, slot % block_size] = key[t].to(key_cache.dtype)
        value_cache[slot // block_size, slot % block_size] = value[t].to(value_cache.dtype)


def copy_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    for src, dst in block_mapping.tolist():
        dst_cache[dst] = src_cache[src]
