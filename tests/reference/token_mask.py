"""Reference for ``mindie.ops.apply_token_bitmask``: the spec of kernels/cpu/token_mask.h."""

from __future__ import annotations

import torch


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [num_masks, vocab]: token t allowed iff bit t % 32 of word t // 32 is set; tokens past
    the mask's 32 * words are not allowed."""
    words = bitmask.shape[1]
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [num_masks, words, 32]; >> keeps the sign bit
    allowed = bits.reshape(bitmask.shape[0], words * 32).bool()
    if vocab <= words * 32:
        return allowed[:, :vocab]
    pad = torch.zeros(bitmask.shape[0], vocab - words * 32, dtype=torch.bool)
    return torch.cat([allowed, pad], dim=1)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, mask_index: torch.Tensor) -> torch.Tensor:
    """A masked copy of logits [rows, vocab]: rows with mask_index -1 unchanged, others -inf where
    their mask forbids the token."""
    out = logits.clone()
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    for r, m in enumerate(mask_index.tolist()):
        if m >= 0:
            out[r] = torch.where(allowed[m], logits[r], torch.tensor(float("-inf")))
    return out
