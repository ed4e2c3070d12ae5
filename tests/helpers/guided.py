"""References for guided decoding with a reasoning model, on transformers' forward: greedy under a
grammar's mask with a logit bias (what our engine must give, token for token), and a bias on
`</think>` that makes a tiny random model reason for a few tokens and then close its think block."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import torch

from mindie.structured.matcher import GrammarMatcher


def _biased(logits: torch.Tensor, bias: Mapping[int, float]) -> torch.Tensor:
    out = logits.float().clone()
    for token, value in bias.items():
        out[token] += value
    return out


def end_tag_bias(hf_model, prompt: list[int], end_id: int, reasoning: int = 3, horizon: int = 24) -> tuple[float, int]:
    """A logit bias on `end_id` under which greedy decoding from `prompt` writes at least `reasoning`
    free tokens and then `end_id`, and at which position it writes it. Found from the unbiased greedy
    run's margins (the top logit less end_id's) at each step: a bias between the margin at step k and
    the smallest margin before k moves no earlier step and wins step k, each by at least 0.02 (our
    float32 logits are within 1e-4 of transformers')."""
    margins: list[float] = []
    with torch.no_grad():
        out = hf_model(torch.tensor([prompt]), use_cache=True)
        for _ in range(horizon):
            logits = out.logits[0, -1].float()
            margins.append(float(logits.max() - logits[end_id]))
            token = int(logits.argmax())
            out = hf_model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    for k in range(reasoning, horizon):
        below = min(margins[:k])
        if below - margins[k] > 0.04:
            return (below + margins[k]) / 2, k
    raise AssertionError(f"no step of {horizon} lets a bias on {end_id} win it alone: margins {margins}")


def allowed_tokens(matcher: GrammarMatcher, vocab: int) -> torch.Tensor:
    """bool [vocab]: the tokens the matcher allows next (none past its bitmask)."""
    row = torch.zeros(matcher.bitmask_words, dtype=torch.int32)
    matcher.fill_bitmask(row)
    bits = np.unpackbits(row.numpy().view(np.uint8), bitorder="little")[:vocab].astype(bool)
    return torch.from_numpy(np.pad(bits, (0, vocab - len(bits))))


def hf_guided_greedy(hf_model, prefix: list[int], matcher: GrammarMatcher, eos_ids: Iterable[int],
                     bias: Mapping[int, float] | None = None, max_new: int = 128,
                     also_first: Iterable[int] = ()) -> list[int]:
    """transformers' greedy continuation of `prefix` under `matcher`'s mask (the grammar as it stands
    after `prefix`) with `bias` added first, as our sampler orders them: until EOS (included) or
    until the grammar allows nothing more. `also_first`: tokens allowed at the first step besides
    the grammar's (a reply that may still open a think block); taking one ends the walk there."""
    eos, extra = set(eos_ids), set(also_first)
    tokens: list[int] = []
    with torch.no_grad():
        out = hf_model(torch.tensor([prefix]), use_cache=True)
        for _ in range(max_new):
            logits = _biased(out.logits[0, -1], bias or {})
            ok = allowed_tokens(matcher, logits.shape[0])
            if not tokens:
                ok[list(extra)] = True
            token = int(logits.masked_fill(~ok, float("-inf")).argmax())
            tokens.append(token)
            if token in eos or (len(tokens) == 1 and token in extra):  # ended, or left the grammar's hands
                return tokens
            assert matcher.advance(token), matcher.error
            if matcher.is_finished():
                return tokens
            out = hf_model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    raise AssertionError(f"the grammar did not finish in {max_new} tokens")


def hf_biased_greedy(hf_model, prompt: list[int], bias: Mapping[int, float], new_tokens: int) -> list[int]:
    """transformers' free greedy continuation of `prompt` with `bias` added to the logits."""
    tokens: list[int] = []
    with torch.no_grad():
        out = hf_model(torch.tensor([prompt]), use_cache=True)
        for _ in range(new_tokens):
            token = int(_biased(out.logits[0, -1], bias).argmax())
            tokens.append(token)
            out = hf_model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens
