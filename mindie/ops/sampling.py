"""Choosing the next tokens from a step's logits: sampling, a beam-search step, and the grammar's
allowed-token mask applied before either."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from mindie import _C


class SampleOutput(NamedTuple):
    token_ids: torch.Tensor  # int64 [B]
    logprobs: torch.Tensor  # float32 [B], log_softmax of the RAW logits at token_ids
    top_logprobs: torch.Tensor  # float32 [B, N], descending, RAW logits
    top_ids: torch.Tensor  # int64 [B, N]


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    step: torch.Tensor,
    *,
    repetition_penalty: torch.Tensor | None = None,
    presence_penalty: torch.Tensor | None = None,
    frequency_penalty: torch.Tensor | None = None,
    prompt_tokens: torch.Tensor | None = None,
    prompt_offsets: torch.Tensor | None = None,
    output_tokens: torch.Tensor | None = None,
    output_offsets: torch.Tensor | None = None,
    num_logprobs: int = 0,
) -> SampleOutput:
    """Sample one token per row of ``logits`` [B, V] (float32 or bfloat16), each row with its own
    parameters (1-D contiguous, length B): ``temperature`` float32 >= 0 (0 = greedy argmax),
    ``top_k`` int32 (-1 or 0 = off), ``top_p`` float32 in (0, 1] (1 = off), ``seed`` int64 and
    ``step`` int64 >= 0 (tokens generated so far) keying a Philox4x32-10 draw, so a seeded request
    gets the same token whatever the batch.

    Penalties (float32 [B] or None = off): ``repetition_penalty`` > 0 (HF semantics) over the prompt
    and output tokens, ``presence_penalty`` / ``frequency_penalty`` (OpenAI semantics) over the
    output tokens; token lists are CSR: int64 ids + int64 offsets [B + 1] (None = no tokens).

    Log-probabilities are ``log_softmax`` of the RAW logits (before penalties and temperature), as
    vLLM v1 returns them; ``num_logprobs`` in [0, 20] adds the top-N per row. See
    kernels/cpu/sampling.h for the exact order of operations.
    """
    rows = logits.shape[0]
    n = max(num_logprobs, 0)
    out = SampleOutput(
        torch.empty(rows, dtype=torch.int64),
        torch.empty(rows, dtype=torch.float32),
        torch.empty(rows, n, dtype=torch.float32),
        torch.empty(rows, n, dtype=torch.int64),
    )
    _C.sample(
        out.token_ids,
        out.logprobs,
        out.top_logprobs,
        out.top_ids,
        logits,
        temperature,
        top_k,
        top_p,
        seed,
        step,
        repetition_penalty,
        presence_penalty,
        frequency_penalty,
        prompt_tokens,
        prompt_offsets,
        output_tokens,
        output_offsets,
        num_logprobs,
    )
    return out


# --- beam search ----------------------------------------------------------------------------


@dataclass
class BeamSearchState:
    """Finished-hypotheses state of G groups of W beams (HF ``BeamHypotheses``), updated in place by
    :func:`beam_search_step`. Slot ``j < num_hyps[g]`` of group ``g`` holds a kept hypothesis; the
    caller keeps the token sequences per slot."""

    hyp_scores: torch.Tensor  # float64 [G, W] normalised scores
    hyp_order: torch.Tensor  # int64 [G, W] insertion order (larger = newer)
    num_hyps: torch.Tensor  # int64 [G]
    worst_score: torch.Tensor  # float64 [G], 1e9 while empty (as HF)
    done: torch.Tensor  # int32 [G], 0 / 1

    @classmethod
    def new(cls, num_groups: int, beam_width: int) -> BeamSearchState:
        return cls(
            torch.zeros(num_groups, beam_width, dtype=torch.float64),
            torch.full((num_groups, beam_width), -1, dtype=torch.int64),
            torch.zeros(num_groups, dtype=torch.int64),
            torch.full((num_groups,), 1e9, dtype=torch.float64),
            torch.zeros(num_groups, dtype=torch.int32),
        )


class BeamStepOutput(NamedTuple):
    next_parents: torch.Tensor  # int64 [G, W], global row index of each new beam's parent
    next_tokens: torch.Tensor  # int64 [G, W]
    next_scores: torch.Tensor  # float32 [G, W], cumulative log-probabilities
    fin_parents: torch.Tensor  # int64 [G, W], finished candidates in rank order, -1 past fin_count
    fin_tokens: torch.Tensor  # int64 [G, W], the EOS id that finished them
    fin_logprobs: torch.Tensor  # float32 [G, W], cumulative log-probability
    fin_scores: torch.Tensor  # float64 [G, W], logprob / cur_len ** length_penalty
    fin_slots: torch.Tensor  # int64 [G, W], slot of BeamSearchState it went to, -1 = rejected
    fin_count: torch.Tensor  # int64 [G]
    done: torch.Tensor  # bool [G], after this step


def beam_search_step(
    logprobs: torch.Tensor,
    beam_scores: torch.Tensor,
    state: BeamSearchState,
    eos_token_ids: torch.Tensor | Sequence[int],
    cur_len: int,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
    max_len: int = 0,
    pad_token_id: int = -1,
) -> BeamStepOutput:
    """One beam-search step with HF ``BeamSearchScorer.process`` semantics for G groups of W beams.

    ``logprobs`` float32 [G*W, V] (already log_softmax'ed), ``beam_scores`` float32 [G*W] (the
    beams' cumulative log-probabilities), ``cur_len`` the generated length including the token
    chosen now, ``early_stopping`` True / False / "never" (``max_len``, the generated-length limit,
    is needed for "never" with ``length_penalty`` > 0). Groups already done are padded with
    ``pad_token_id`` (< 0: the first EOS id), parent ``g * W`` and score 0.
    """
    if not isinstance(eos_token_ids, torch.Tensor):
        eos_token_ids = torch.tensor(list(eos_token_ids), dtype=torch.int64)
    groups, width = state.hyp_scores.shape
    grid = (groups, width)
    out = BeamStepOutput(
        torch.empty(grid, dtype=torch.int64),
        torch.empty(grid, dtype=torch.int64),
        torch.empty(grid, dtype=torch.float32),
        torch.empty(grid, dtype=torch.int64),
        torch.empty(grid, dtype=torch.int64),
        torch.empty(grid, dtype=torch.float32),
        torch.empty(grid, dtype=torch.float64),
        torch.empty(grid, dtype=torch.int64),
        torch.empty(groups, dtype=torch.int64),
        torch.empty(groups, dtype=torch.bool),
    )
    _C.beam_search_step(
        logprobs,
        beam_scores,
        eos_token_ids,
        cur_len,
        length_penalty,
        early_stopping,
        max_len,
        pad_token_id,
        state.hyp_scores,
        state.hyp_order,
        state.num_hyps,
        state.worst_score,
        state.done,
        *out[:9],
    )
    out.done.copy_(state.done)
    return out


# --- constrained decoding -------------------------------------------------------------------


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, mask_index: torch.Tensor | None = None
) -> None:
    """Set to -inf, in place, the logits [rows, vocab] (float32) of the tokens a grammar forbids.

    ``bitmask`` int32 [num_masks, words] in llguidance's layout: bit ``j`` of word ``w`` allows
    token ``32 * w + j``. Row ``r`` uses mask ``mask_index[r]`` (int32 [rows]); -1 leaves the row
    untouched (an unconstrained request in the same batch). None: row ``r`` uses mask ``r``.
    Tokens at or beyond ``32 * words`` are forbidden; mask bits at or beyond ``vocab`` are ignored.
    """
    if mask_index is None:
        mask_index = torch.arange(logits.shape[0], dtype=torch.int32)
    _C.apply_token_bitmask(logits, bitmask, mask_index)
