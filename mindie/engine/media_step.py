"""A step's media inputs: encoder outputs placed at their tokens' rows, and multimodal rotary
positions (Qwen2-VL's M-RoPE) for every row when some sequence in the batch needs them.

The model only sees rows: which rows take an encoder output instead of their token's embedding,
and, when any scheduled sequence has 3-D positions, one rotary (cos, sin) row per token. Text rows
in such a batch get their plain position on all three axes, which is the 1-D rotary exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np
import torch

from mindie.engine.sequence import Sequence


class MediaRows(NamedTuple):
    rows: torch.Tensor | None  # int64 [k]: batch rows whose embedding is replaced
    embeds: torch.Tensor | None  # [k, hidden]
    rope: torch.Tensor | None  # float32 [tokens, head_dim]: per-row cos/sin; None: the plain table


NONE = MediaRows(None, None, None)


def media_rows(model: Any, spans: list[tuple[Sequence, int, int, int]]) -> MediaRows:
    """`spans`: (sequence, its first row in the batch, first position, tokens) in row order."""
    if not any(seq.request.media is not None for seq, *_ in spans):
        return NONE
    rows: list[int] = []
    embeds: list[torch.Tensor] = []
    positions: list[np.ndarray] = []
    for seq, row0, start, n in spans:
        media = seq.request.media
        end = start + n
        prompt_end = min(end, seq.num_prompt_tokens)
        if media is not None and media.positions is not None:
            prompt = media.positions[:, start:prompt_end]
        else:  # text; or a decode node's handed-over media, whose prompt it never computes
            prompt = np.broadcast_to(np.arange(start, prompt_end), (3, max(prompt_end - start, 0)))
        generated = np.arange(max(start, seq.num_prompt_tokens), end) + (media.rope_delta if media else 0)
        positions.append(np.concatenate([prompt, np.broadcast_to(generated, (3, len(generated)))], axis=1))
        if media is None:
            continue
        for index, item in enumerate(media.items):
            lo, hi = max(start, item.offset), min(end, item.offset + item.num_tokens)
            if lo >= hi:
                continue
            if index not in media.embeddings:  # encoded once per request, kept for recompute
                media.embeddings[index] = model.encode_media(item)
                # the pixels are not needed again: let them go while the request runs on
                media.items = media.items[:index] + (dataclasses.replace(item, data=None),) + media.items[index + 1:]
            rows += range(row0 + lo - start, row0 + hi - start)
            embeds.append(media.embeddings[index][lo - item.offset : hi - item.offset])
    rope = None
    if getattr(model, "mrope_section", None):
        rope = model.mrope_cos_sin(torch.from_numpy(np.concatenate(positions, axis=1)))
    if not rows:
        return MediaRows(None, None, rope)
    return MediaRows(torch.tensor(rows, dtype=torch.int64), torch.cat(embeds), rope)
