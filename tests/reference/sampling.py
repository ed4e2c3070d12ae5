"""Reference for ``mindie.ops.sample``: the spec of kernels/cpu/sampling.h in plain PyTorch.

Row by row: penalties, temperature (0 = greedy), candidates ordered by descending scaled logit
(ties: lower token id), top-k then top-p over float32 weights exp(z - max z) summed in float64,
and one Philox4x32-10 uniform per row (key = seed, counter = step) that inverts the CDF.
Log-probabilities are ``log_softmax`` of the raw logits.
"""

from __future__ import annotations

import torch

M32 = 0xFFFFFFFF


def philox4x32_10(
    counter: tuple[int, int, int, int], key: tuple[int, int]
) -> tuple[int, int, int, int]:
    """Philox4x32-10 (Salmon et al., SC'11) with the Random123 constants."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        p0 = 0xD2511F53 * c0
        p1 = 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (
            ((p1 >> 32) ^ c1 ^ k0) & M32,
            p1 & M32,
            ((p0 >> 32) ^ c3 ^ k1) & M32,
            p0 & M32,
        )
        k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
    return c0, c1, c2, c3


def uniform(seed: int, step: int) -> float:
    """The row's uniform in [0, 1): 53 bits from the first two Philox words."""
    s, t = seed & 0xFFFFFFFFFFFFFFFF, step & 0xFFFFFFFFFFFFFFFF
    x0, x1, _, _ = philox4x32_10((t & M32, t >> 32, 0, 0), (s & M32, s >> 32))
    return ((x0 >> 5) * 67108864 + (x1 >> 6)) / 9007199254740992.0


def apply_penalties(
    logits: torch.Tensor,
    prompt: torch.Tensor,
    output: torch.Tensor,
    repetition_penalty: torch.Tensor,
    presence_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
) -> torch.Tensor:
    """One row: HF repetition penalty over prompt+output (once per token), then OpenAI presence and
    frequency penalties over the output tokens."""
    vocab = logits.shape[0]
    seen = torch.zeros(vocab, dtype=torch.bool)
    seen[prompt] = True
    seen[output] = True
    x = torch.where(
        seen,
        torch.where(logits > 0, logits / repetition_penalty, logits * repetition_penalty),
        logits,
    )
    counts = torch.bincount(output, minlength=vocab).to(torch.float32)
    return x - (presence_penalty * (counts > 0).to(torch.float32) + frequency_penalty * counts)


def candidates(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One row of penalised logits, temperature > 0: the kept token ids in order and their
    cumulative float64 weights."""
    vocab = logits.shape[0]
    z = logits / torch.tensor(temperature, dtype=torch.float32)
    z = torch.clamp(z, max=torch.finfo(torch.float32).max)
    order = torch.sort(z, descending=True, stable=True).indices  # ties: lower id first
    k = vocab if top_k <= 0 or top_k >= vocab else top_k
    order = order[:k]
    weights = torch.exp(z[order] - z[order[0]]).to(torch.float64)
    cum = torch.cumsum(weights, 0)
    if top_p < 1.0:
        reached = (cum >= float(top_p) * cum[-1].item()).nonzero()
        keep = int(reached[0]) + 1 if len(reached) else k
        order, cum = order[:keep], cum[:keep]
    return order, cum


def filtered_distribution(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> torch.Tensor:
    """One (penalised) row: the float64 probabilities the draw follows, zero off the kept set."""
    order, cum = candidates(logits, temperature, top_k, top_p)
    weights = torch.diff(cum, prepend=torch.zeros(1, dtype=torch.float64))
    probs = torch.zeros(logits.shape[0], dtype=torch.float64)
    probs[order] = weights / cum[-1]
    return probs


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    step: torch.Tensor,
    repetition_penalty: torch.Tensor | None = None,
    presence_penalty: torch.Tensor | None = None,
    frequency_penalty: torch.Tensor | None = None,
    prompt_tokens: torch.Tensor | None = None,
    prompt_offsets: torch.Tensor | None = None,
    output_tokens: torch.Tensor | None = None,
    output_offsets: torch.Tensor | None = None,
    num_logprobs: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (tokens int64 [B], logprobs float32 [B], top logprobs [B, N], top ids [B, N])."""
    rows = logits.shape[0]
    raw = logits.float()
    raw_logprobs = torch.log_softmax(raw, dim=-1)
    empty = torch.zeros(0, dtype=torch.int64)
    tokens = torch.zeros(rows, dtype=torch.int64)
    for b in range(rows):
        prompt = (
            prompt_tokens[prompt_offsets[b] : prompt_offsets[b + 1]]
            if prompt_tokens is not None
            else empty
        )
        output = (
            output_tokens[output_offsets[b] : output_offsets[b + 1]]
            if output_tokens is not None
            else empty
        )
        one = torch.tensor(1.0)
        zero = torch.tensor(0.0)
        x = apply_penalties(
            raw[b],
            prompt,
            output,
            repetition_penalty[b] if repetition_penalty is not None else one,
            presence_penalty[b] if presence_penalty is not None else zero,
            frequency_penalty[b] if frequency_penalty is not None else zero,
        )
        if temperature[b] == 0:
            tokens[b] = int(torch.argmax(x))  # first maximal index
            continue
        order, cum = candidates(x, float(temperature[b]), int(top_k[b]), float(top_p[b]))
        target = uniform(int(seed[b]), int(step[b])) * cum[-1].item()
        above = (cum > target).nonzero()
        tokens[b] = order[int(above[0])] if len(above) else order[-1]
    logprobs = raw_logprobs.gather(1, tokens[:, None])[:, 0]
    top = torch.sort(raw, dim=-1, descending=True, stable=True).indices[:, :num_logprobs]
    return tokens, logprobs, raw_logprobs.gather(1, top), top
