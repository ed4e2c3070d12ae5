"""Batches the sampling parameters of one step's rows and calls the sampling kernel.

Order (kernels/cpu/sampling.h): repetition penalty over prompt + output, presence and frequency
penalties over output, temperature (0 = greedy), top-k, top-p, then one seeded Philox draw per row
keyed by (seed, number of tokens generated so far), so a seeded request gets the same tokens in
any batch. Log-probabilities are of the raw logits plus the request's logit_bias, after a
grammar's mask when the request has one (a disallowed token has log-probability -inf).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from mindie import ops
from mindie.engine.sequence import Sequence


def _csr(lists: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = [0]
    for tokens in lists:
        offsets.append(offsets[-1] + len(tokens))
    flat = [t for tokens in lists for t in tokens]
    return torch.tensor(flat, dtype=torch.int64), torch.tensor(offsets, dtype=torch.int64)


def _apply_grammars(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Masks the rows of constrained samples to the tokens their grammar allows next; free rows
    (mask index -1) share the kernel call untouched, and so do samples whose grammar waits for the
    end of their reasoning."""
    rows = [r for r, s in enumerate(seqs) if s.matcher is not None and s.matcher.constrains_next]
    if not rows:
        return
    words = seqs[rows[0]].matcher.bitmask_words
    bitmask = torch.empty(len(rows), words, dtype=torch.int32)
    mask_index = torch.full((len(seqs),), -1, dtype=torch.int32)
    for k, r in enumerate(rows):
        seqs[r].matcher.fill_bitmask(bitmask[k])
        mask_index[r] = k
    ops.apply_token_bitmask(logits, bitmask, mask_index)


def _apply_biases(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: Iterable[int]) -> None:
    """Adds each request's logit_bias to its row, and -inf to the tokens that would end a sample
    (EOS unless ignored, stop_token_ids) while it has fewer than its min_tokens: all rows in one
    indexed add."""
    vocab = logits.shape[-1]
    entries = []
    for r, s in enumerate(seqs):
        p = s.request.params
        entries += [(r, t, b) for t, b in p.logit_bias]
        if s.num_output_tokens < p.min_tokens:
            ending = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            entries += [(r, t, float("-inf")) for t in ending if t < vocab]
    if not entries:
        return
    rows, cols, values = zip(*entries)
    with torch.inference_mode():  # the model's logits are inference tensors
        logits.index_put_((torch.tensor(rows), torch.tensor(cols)), torch.tensor(values, dtype=logits.dtype),
                          accumulate=True)


def sample(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: Iterable[int] = ()) -> ops.SampleOutput:
    _apply_biases(logits, seqs, eos_token_ids)
    _apply_grammars(logits, seqs)
    params = [s.request.params for s in seqs]
    temperature = torch.tensor([0.0 if p.greedy else p.temperature for p in params], dtype=torch.float32)
    kwargs: dict = {}
    if any(p.repetition_penalty != 1.0 for p in params):
        kwargs["repetition_penalty"] = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32)
        kwargs["prompt_tokens"], kwargs["prompt_offsets"] = _csr([s.request.prompt_token_ids for s in seqs])
    if any(p.presence_penalty != 0.0 for p in params):
        kwargs["presence_penalty"] = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32)
    if any(p.frequency_penalty != 0.0 for p in params):
        kwargs["frequency_penalty"] = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32)
    if len(kwargs) > 0:
        kwargs["output_tokens"], kwargs["output_offsets"] = _csr([s.output_token_ids for s in seqs])
    return ops.sample(
        logits,
        temperature,
        torch.tensor([p.top_k for p in params], dtype=torch.int32),
        torch.tensor([p.top_p for p in params], dtype=torch.float32),
        # The kernel reads the seed's 64 bits as uint64: pass a uint64 as its int64 bit pattern.
        torch.tensor([s.seed - 2**64 if s.seed >= 2**63 else s.seed for s in seqs], dtype=torch.int64),
        torch.tensor([s.num_output_tokens for s in seqs], dtype=torch.int64),
        num_logprobs=max((p.logprobs or 0) for p in params),
        **kwargs,
    )
