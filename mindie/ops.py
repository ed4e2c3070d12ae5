"""Typed wrappers over ``mindie._C``: they allocate outputs and call the kernels, nothing else.

Tensors are torch CPU tensors; the kernels read and write their memory in place through DLPack.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from mindie import _C

__all__ = [
    "copy_blocks",
    "linear",
    "paged_attention",
    "paged_attention_decode",
    "reshape_and_cache",
    "SampleOutput",
    "sample",
    "BeamSearchState",
    "BeamStepOutput",
    "beam_search_step",
    "apply_token_bitmask",
]


# --- KV cache -------------------------------------------------------------------------------


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


# --- attention ------------------------------------------------------------------------------


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
) -> torch.Tensor:
    """Causal attention of a flattened batch over its paged KV cache.

    ``query`` [tokens, heads, head_dim]; sequence ``s`` owns query rows
    ``query_start_loc[s]:query_start_loc[s + 1]`` and has ``seq_lens[s]`` cached tokens, the new
    ones included (write them with :func:`reshape_and_cache` first). Covers decode, prefill,
    chunked prefill and prefix-cache hits in one call.
    """
    if out is None:
        out = torch.empty_like(query)
    _C.paged_attention(
        out, query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, partition_size
    )
    return out


def paged_attention_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    partition_size: int = 0,
) -> torch.Tensor:
    """One query token per sequence: ``query`` [num_seqs, heads, head_dim]."""
    query_start_loc = torch.arange(query.shape[0] + 1, dtype=torch.int32)
    return paged_attention(
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, out, partition_size
    )


# --- layers ---------------------------------------------------------------------------------


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``weight * rmsnorm(x)`` per row of ``x`` [rows, hidden]. With ``residual``, first
    ``residual += x`` in place, then the sum is normalised (the fused pre-norm of a decoder layer)."""
    if out is None:
        out = torch.empty_like(x)
    _C.rms_norm(out, x, weight, eps, residual)
    return out


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    neox: bool = True,
) -> None:
    """Rotate ``query``/``key`` [tokens, heads, head_dim] in place by ``positions`` (int64)."""
    _C.rotary_embedding(positions, query, key, cos_sin_cache, neox)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(x[:, :n]) * x[:, n:]`` for ``x`` [tokens, 2n] (a gated MLP's activation)."""
    if out is None:
        out = x.new_empty((x.shape[0], x.shape[1] // 2))
    _C.silu_and_mul(out, x)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [m, k] @ weight[n, k]^T (+ bias)`` for a few rows of ``x``: the weight streams once at
    memory speed (bf16 x bf16 uses AVX512-BF16 dot products where the CPU has them)."""
    if out is None:
        out = x.new_empty((x.shape[0], weight.shape[0]))
    _C.linear(out, x, weight, bias)
    return out


# --- sampling -------------------------------------------------------------------------------

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


def dequantize(data: torch.Tensor, ggml_type: int, cols: int, packed_rows: int | None = None) -> torch.Tensor:
    """float32 [rows, cols] of GGUF blocks data [rows, row_bytes] (uint8) in ggml_type; with packed_rows,
    data is a matrix of that many rows packed in panels (pack_panels)."""
    out = torch.empty(data.shape[0] if packed_rows is None else packed_rows, cols, dtype=torch.float32)
    _C.dequantize(out, data, ggml_type, packed_rows is not None)
    return out


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    if sys.platform != "linux":
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise


_madvise = _libc_madvise()


def _empty_on_huge_pages(rows: int, cols: int) -> torch.Tensor:
    """An uninitialised uint8 [rows, cols] whose whole 2 MiB pages are advised as transparent huge
    pages (Linux, THP in madvise mode) before anything touches them: a decode step streams every
    weight once, and on 4 KiB pages it takes a TLB walk, and a hardware-prefetch restart, every 4 KiB
    (one Sapphire Rapids core read the 1.7B shape's FFN matrices 3-9% faster). Best effort: where
    the advice fails the memory is ordinary."""
    n = rows * cols
    if _madvise is None or n < 2 * _HUGE_PAGE:
        return torch.empty(rows, cols, dtype=torch.uint8)
    buf = torch.empty(n + _HUGE_PAGE, dtype=torch.uint8)
    start = (-buf.data_ptr()) % _HUGE_PAGE
    _madvise(buf.data_ptr() + start, n // _HUGE_PAGE * _HUGE_PAGE, _MADV_HUGEPAGE)
    return buf[start:start + n].view(rows, cols)


def pack_panels(data: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """Blocks [rows, row_bytes] of a quantized format packed in panels of 16 rows: [rows rounded up to 16,
    row_bytes], on huge pages where the OS gives them."""
    out = _empty_on_huge_pages((data.shape[0] + 15) // 16 * 16, data.shape[1])
    _C.pack_panels(out, data, ggml_type)
    return out


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row and block of 32: x ~= d * (128 * q[:, 0] + q[:, 1]); returns q [m, 2, k] int8, d [m, k/32]."""
    m, k = x.shape
    q = torch.empty(m, 2, k, dtype=torch.int8)
    d = torch.empty(m, k // 32, dtype=torch.float32)
    _C.quantize_activations(q, d, x)
    return q, d


def qmatmul(xq: torch.Tensor, xd: torch.Tensor, weight: torch.Tensor, ggml_type: int,
            bias: torch.Tensor | None = None, packed_rows: int | None = None) -> torch.Tensor:
    """float32 [m, n] = the quantized activations times the GGUF-block weight [n, row_bytes]^T; with
    packed_rows, weight is a matrix of n = packed_rows rows packed in panels (pack_panels)."""
    out = torch.empty(xq.shape[0], weight.shape[0] if packed_rows is None else packed_rows, dtype=torch.float32)
    _C.qmatmul(out, xq, xd, weight, ggml_type, bias, packed_rows is not None)
    return out


def qmatmul_group(xq: torch.Tensor, xd: torch.Tensor,
                  weights: Sequence[tuple[int, torch.Tensor, int, int, bool]]) -> list[torch.Tensor]:
    """float32 [m, n_j] for each of 1 to 4 weights (QuantizedWeight.spec()) that share the quantized
    activations, in one call, as the forward step projects q/k/v and gate/up."""
    outs = [torch.empty(xq.shape[0], rows, dtype=torch.float32) for _, _, _, rows, _ in weights]
    _C.qmatmul_group(outs, xq, xd, list(weights))
    return outs


def round_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """bfloat16 [m, k] of float32 x [m, k], rounded to nearest even."""
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    _C.round_to_bf16(out, x)
    return out


def qmatmul_bf16(x: torch.Tensor, weight: torch.Tensor, ggml_type: int,
                 bias: torch.Tensor | None = None, packed_rows: int | None = None) -> torch.Tensor:
    """float32 [m, n] = bfloat16 x [m, k] times the GGUF-block weight [n, row_bytes]^T, each weight rounded to
    bfloat16; packed_rows as in qmatmul."""
    out = torch.empty(x.shape[0], weight.shape[0] if packed_rows is None else packed_rows, dtype=torch.float32)
    _C.qmatmul_bf16(out, x, weight, ggml_type, bias, packed_rows is not None)
    return out
