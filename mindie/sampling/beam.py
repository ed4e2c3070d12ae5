"""One request's beam search: which beams continue each step, and the finished hypotheses.

The search follows Hugging Face transformers 5.x `generate(num_beams=W, length_penalty=...,
early_stopping=..., max_new_tokens=...)` so that the engine returns the same sequences:

1. Each live beam's next-token logits become float32 log-probabilities of the raw logits
   (temperature, top-k/top-p and seeds do not apply: the search is deterministic).
2. `mindie.ops.beam_search_step` (the C++ kernel) adds the beams' cumulative log-probabilities,
   keeps the top max(2, 1 + #eos) * W candidates, offers those ending in an EOS id at rank < W to
   the W kept hypotheses (score = cumulative / generated_len ** length_penalty) and picks the W
   best other candidates as the next beams. On the first step only the prompt is live: its row
   is repeated W times with scores [0, -1e9, ...], exactly as HF starts.
3. At the generated-length limit every candidate of rank < W finishes (those without EOS with
   finish reason "length"), as HF's max-length stopping criterion does.
4. The search is done when the limit is reached or HF's early-stop heuristic says the running
   beams cannot improve on the kept hypotheses: early_stopping=True stops once W hypotheses are
   kept; False compares the best running beam's score at the current length, "never" at the
   length limit when length_penalty > 0, with the worst kept score. This is transformers 5.x's
   rule (the best *running* beam); the kernel's own `done` flag follows the older
   BeamSearchScorer (the best candidate, EOS included), which implies ours, so it is only a
   backstop.

Scores that decide the result are computed in float32 as HF does; the kernel ranks its kept
hypotheses in float64, which can differ from HF only between scores equal to within float32
rounding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mindie import ops
from mindie.engine.request import FinishReason, SamplingParams, TokenLogprob

_DEAD = -1e9  # HF's initial score of the W - 1 copies of the prompt beam


@dataclass
class Hypothesis:
    """A finished beam: its generated tokens and how it ranks."""

    logprobs: list[TokenLogprob]  # one per generated token, the last included
    cumulative_logprob: float  # sum of the token log-probabilities (float32, not normalised)
    score: float  # cumulative_logprob / len ** length_penalty in float32: HF's sequences_scores
    finish_reason: FinishReason

    @property
    def token_ids(self) -> list[int]:
        return [lp.token_id for lp in self.logprobs]


class BeamSearch:
    """The search state of one request with beam width W = `params.num_samples`. Live beams are
    rows 0..live-1, in the order `step` last returned them (one row, the prompt, at first)."""

    def __init__(self, params: SamplingParams, eos_token_ids: Sequence[int], max_new_tokens: int) -> None:
        self.params = params
        self.width = params.num_samples
        self.eos_token_ids = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.int64)
        self.max_new_tokens = max_new_tokens
        self.state = ops.BeamSearchState.new(1, self.width)
        self.scores = [0.0]  # cumulative log-probability of each live beam
        self.histories: list[list[TokenLogprob]] = [[]]  # generated tokens of each live beam
        self.kept: list[Hypothesis | None] = [None] * self.width  # by kernel slot
        self.at_limit: list[Hypothesis] = []  # beams stopped by the length limit
        self.done = False

    @property
    def num_live(self) -> int:
        return len(self.histories)

    def step(self, logits: torch.Tensor) -> list[tuple[int, int]]:
        """Advances the search by one token. `logits` [num_live, vocab] are the live beams' next-token
        logits. Returns (parent row, token) of each next beam, W of them, or [] once the search is
        done (then `best` has the result)."""
        if self.done:
            raise RuntimeError("the beam search is already done")
        width, live, cur_len = self.width, self.num_live, len(self.histories[0]) + 1
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        rows, scores = logprobs, self.scores
        if live < width:  # the first step: W copies of the prompt beam, only one alive
            rows = logprobs[:1].expand(width, -1).contiguous()
            scores = [0.0] + [_DEAD] * (width - 1)
        p = self.params
        out = ops.beam_search_step(
            rows, torch.tensor(scores, dtype=torch.float32), self.state, self.eos_token_ids, cur_len,
            p.length_penalty, p.early_stopping, self.max_new_tokens,
        )
        top = torch.topk(logprobs, p.logprobs) if p.logprobs else None

        def source(row: int) -> int:
            return min(row, live - 1)  # the first step's copies are all the prompt beam

        def grown(row: int, token_id: int) -> list[TokenLogprob]:  # a beam's history plus one token
            row = source(row)
            best = list(zip(top.indices[row].tolist(), top.values[row].tolist())) if top is not None else []
            return self.histories[row] + [TokenLogprob(token_id, float(logprobs[row, token_id]), best)]

        for j in range(int(out.fin_count[0])):
            slot = int(out.fin_slots[0, j])
            if slot >= 0:
                cum = float(out.fin_logprobs[0, j])
                self.kept[slot] = Hypothesis(grown(int(out.fin_parents[0, j]), int(out.fin_tokens[0, j])), cum,
                                             self._normalise(cum, cur_len), FinishReason.EOS)
        parents, tokens = out.next_parents[0].tolist(), out.next_tokens[0].tolist()
        next_scores = out.next_scores[0].tolist()
        if cur_len >= self.max_new_tokens:
            # Candidates of rank < W without EOS are the first W - fin_count next beams.
            for j in range(width - int(out.fin_count[0])):
                self.at_limit.append(Hypothesis(grown(parents[j], tokens[j]), next_scores[j],
                                                self._normalise(next_scores[j], cur_len), FinishReason.LENGTH))
            self.done = True
            return []
        self.done = bool(out.done[0]) or self._cannot_improve(next_scores[0], cur_len)
        if self.done:
            return []
        self.histories = [grown(parent, t) for parent, t in zip(parents, tokens)]
        self.scores = next_scores
        return [(source(parent), t) for parent, t in zip(parents, tokens)]

    def best(self) -> list[Hypothesis]:
        """The n best finished hypotheses, best first."""
        finished = [h for h in self.kept if h is not None] + self.at_limit
        return sorted(finished, key=lambda h: h.score, reverse=True)[: self.params.n]

    def _normalise(self, cumulative: float, length: int) -> float:
        # The same float32 expression as HF, so that comparisons round the same way.
        return float(torch.tensor(cumulative, dtype=torch.float32) / (length**self.params.length_penalty))

    def _cannot_improve(self, best_running: float, cur_len: int) -> bool:
        kept = [h.score for h in self.kept if h is not None]
        if len(kept) < self.width:
            return False
        p = self.params
        if p.early_stopping is True:
            return True
        length = self.max_new_tokens if p.early_stopping == "never" and p.length_penalty > 0 else cur_len
        return not self._normalise(best_running, length) > min(kept)
