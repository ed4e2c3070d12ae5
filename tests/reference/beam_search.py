"""Reference for ``mindie.ops.beam_search_step``: Hugging Face transformers' beam search step
(``_beam_search`` candidate selection + ``BeamSearchScorer.process`` + ``BeamHypotheses``), reduced
to what one step needs and written out here so the tests do not depend on transformers.

Two deliberate, documented differences from HF: ties in the top-K are broken by the lower flat
index (a stable sort; torch.topk leaves them unspecified) and a group that is already done gets
parent ``g * W`` (HF writes 0) for its padding beams.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class BeamHypotheses:
    """HF ``BeamHypotheses``: the ``num_beams`` best finished hypotheses of one group."""

    num_beams: int
    length_penalty: float
    early_stopping: bool | str
    max_length: int = 0  # generated-length limit, used by "never" with length_penalty > 0
    beams: list[tuple[float, tuple[int, ...]]] = field(default_factory=list)
    worst_score: float = 1e9

    def __len__(self) -> int:
        return len(self.beams)

    def add(self, hyp: tuple[int, ...], sum_logprobs: float, generated_len: int) -> None:
        score = sum_logprobs / (generated_len**self.length_penalty)
        if len(self) < self.num_beams or score > self.worst_score:
            self.beams.append((score, hyp))
            if len(self) > self.num_beams:
                sorted_next_scores = sorted([(s, idx) for idx, (s, _) in enumerate(self.beams)])
                del self.beams[sorted_next_scores[0][1]]
                self.worst_score = sorted_next_scores[1][0]
            else:
                self.worst_score = min(score, self.worst_score)

    def is_done(self, best_sum_logprobs: float, cur_len: int) -> bool:
        if len(self) < self.num_beams:
            return False
        if self.early_stopping is True:
            return True
        if self.early_stopping is False:
            return self.worst_score >= best_sum_logprobs / cur_len**self.length_penalty
        # "never": the best attainable score, depending on the sign of length_penalty
        if self.length_penalty > 0.0:
            highest_attainable_score = best_sum_logprobs / self.max_length**self.length_penalty
        else:
            highest_attainable_score = best_sum_logprobs / cur_len**self.length_penalty
        return self.worst_score >= highest_attainable_score


@dataclass
class StepResult:
    next_parents: torch.Tensor  # int64 [G, W]
    next_tokens: torch.Tensor  # int64 [G, W]
    next_scores: torch.Tensor  # float32 [G, W]
    finished: list[
        list[tuple[int, int, float, float]]
    ]  # per group: (parent, token, logprob, score)
    done: list[bool]


def beam_search_step(
    logprobs: torch.Tensor,
    beam_scores: torch.Tensor,
    hyps: list[BeamHypotheses],
    done: list[bool],
    sequences: list[tuple[int, ...]],
    eos_token_ids: list[int],
    cur_len: int,
    pad_token_id: int,
) -> StepResult:
    """One step for G = len(hyps) groups of W beams; ``hyps`` and ``done`` are updated in place.
    ``sequences[r]`` is the token sequence of beam row r (what a finished hypothesis stores)."""
    groups, width = len(hyps), hyps[0].num_beams
    vocab = logprobs.shape[1]
    # _beam_search: add the beams' scores, flatten each group, keep max(2, 1 + n_eos) * W.
    scores = (logprobs + beam_scores[:, None]).view(groups, width * vocab)
    keep = max(2, 1 + len(eos_token_ids)) * width
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :keep]
    top_scores = scores.gather(1, order)
    next_parents = torch.zeros(groups, width, dtype=torch.int64)
    next_tokens = torch.zeros(groups, width, dtype=torch.int64)
    next_scores = torch.zeros(groups, width, dtype=torch.float32)
    finished: list[list[tuple[int, int, float, float]]] = [[] for _ in range(groups)]
    # BeamSearchScorer.process
    for g in range(groups):
        if done[g]:
            next_parents[g] = g * width
            next_tokens[g] = pad_token_id
            next_scores[g] = 0.0
            continue
        beam_idx = 0
        for rank in range(keep):
            flat, score = int(order[g, rank]), top_scores[g, rank]
            token, parent = flat % vocab, g * width + flat // vocab
            if token in eos_token_ids:
                if rank >= width:
                    continue
                hyps[g].add(sequences[parent] + (token,), score.item(), cur_len)
                finished[g].append(
                    (parent, token, score.item(), score.item() / cur_len ** hyps[g].length_penalty)
                )
            else:
                next_parents[g, beam_idx] = parent
                next_tokens[g, beam_idx] = token
                next_scores[g, beam_idx] = score
                beam_idx += 1
            if beam_idx == width:
                break
        done[g] = done[g] or hyps[g].is_done(top_scores[g].max().item(), cur_len)
    return StepResult(next_parents, next_tokens, next_scores, finished, list(done))
