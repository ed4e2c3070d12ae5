"""The engine's beam-search requests, each run as a group of sequences in lockstep.

A beam-search request runs as a group of sequences, one per live beam (`Sequence.lockstep`). Once
every beam of the group is fully computed, its logits go to the request's `BeamSearch`
(mindie/sampling/beam.py), which picks the next beams; a parent chosen once continues as itself,
a parent chosen k > 1 times is forked k - 1 times (the children share its blocks copy-on-write),
and a parent not chosen is freed. The request emits nothing until the search is done, then its n
best hypotheses at once, best first, the last with `request_done`.
"""

from __future__ import annotations

import dataclasses
import itertools
import time

import torch

from mindie.engine.detokenizer import IncrementalDetokenizer
from mindie.engine.request import EngineRequest, FinishReason, RequestOutput
from mindie.engine.scheduler import Scheduler
from mindie.engine.sequence import Sequence, StepInfo
from mindie.sampling.beam import BeamSearch
from mindie.tokenizer import Tokenizer


class BeamSearches:
    """Owns every beam-search request's search state; the engine's `requests` map (shared) holds
    each group's lockstep list of live beams, as it holds a plain request's samples."""

    def __init__(self, scheduler: Scheduler, requests: dict[str, list[Sequence]], tokenizer: Tokenizer,
                 eos_token_ids: frozenset[int], vocab_size: int) -> None:
        self.scheduler = scheduler
        self.requests = requests
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.searches: dict[str, BeamSearch] = {}  # request id -> its search
        self.pending_logits: dict[Sequence, torch.Tensor] = {}  # computed beams waiting for their siblings
        self._beam_ids = itertools.count(1)  # sequence index of forked beams (the prompt's is 0)
        # request id -> (batch size, queue wait) of each beam step so far: a hypothesis of length
        # L reports the first L of them
        self._steps: dict[str, list[tuple[int, float]]] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.searches

    def add(self, request: EngineRequest, max_total: int, seed: int) -> None:
        params = request.params
        eos = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        search = BeamSearch(params, [t for t in eos if t < self.vocab_size],
                            max_total - len(request.prompt_token_ids))
        prompt = Sequence(request, 0, seed, max_total, detokenizer=None)
        prompt.lockstep = [prompt]  # one live beam until the first step
        self.requests[request.request_id] = prompt.lockstep
        self.searches[request.request_id] = search
        self._steps[request.request_id] = []
        self.scheduler.add(prompt)

    def update(self, beams: list[Sequence], logits: torch.Tensor, step: StepInfo) -> list[RequestOutput]:
        """Takes the next-token logits of beams computed this step (row i: beams[i]); steps every
        group whose beams are all computed now. Returns the outputs of searches that ended."""
        for beam, row in zip(beams, logits):
            self.pending_logits[beam] = row
        outputs = []
        for request_id in dict.fromkeys(beam.request.request_id for beam in beams):
            group = self.requests[request_id]  # the group's lockstep list
            if all(beam.num_pending_tokens == 0 for beam in group):
                outputs += self._step(request_id, group, step)
        return outputs

    def _step(self, request_id: str, beams: list[Sequence], step: StepInfo) -> list[RequestOutput]:
        # The group waits as one: from the end of its previous step (its lead's ready time).
        self._steps[request_id].append((step.batch_size, step.wait_s(beams[0].ready_time)))
        children = self.searches[request_id].step(torch.stack([self.pending_logits.pop(b) for b in beams]))
        if not children:
            return self.finish(request_id, None)
        # Fork before any token is appended: a child starts as an exact copy of its parent.
        continued: set[int] = set()
        next_beams = []
        for row, _ in children:
            parent = beams[row]
            if row in continued:
                child = dataclasses.replace(parent, index=next(self._beam_ids), token_ids=list(parent.token_ids))
                self.scheduler.fork(parent, child)
                next_beams.append(child)
            else:
                continued.add(row)
                next_beams.append(parent)
        for row, beam in enumerate(beams):
            if row not in continued:
                self.scheduler.remove(beam)
        now = time.monotonic()
        for beam, (_, token) in zip(next_beams, children):
            beam.token_ids.append(token)
            beam.ready_time = now
            if beam.first_token_time is None:
                beam.first_token_time = now
        beams[:] = next_beams  # the shared lockstep list, now in the search's row order
        return []

    def finish(self, request_id: str, reason: FinishReason | None) -> list[RequestOutput]:
        """Frees every beam and returns the n best hypotheses, best first (reason None: the search
        is done), or n empty outputs with `reason` (an abort)."""
        search = self.searches.pop(request_id)
        beams = self.requests.pop(request_id)
        steps = self._steps.pop(request_id)
        for beam in beams:
            self.scheduler.remove(beam)
            self.pending_logits.pop(beam, None)
        lead, params = beams[0], search.params
        hyps = search.best() if reason is None else []
        now = time.monotonic()
        outputs = []
        for index in range(params.n):
            hyp = hyps[index] if hyps else None
            tokens = hyp.token_ids if hyp else []
            detok = IncrementalDetokenizer(self.tokenizer, lead.request.prompt_token_ids,
                                           skip_special_tokens=params.skip_special_tokens)
            outputs.append(RequestOutput(
                request_id=request_id,
                index=index,
                new_token_ids=tokens,
                new_text=detok.append(tokens).text + detok.flush(),
                new_logprobs=hyp.logprobs if hyp else [],
                finish_reason=hyp.finish_reason if hyp else reason,
                num_prompt_tokens=lead.num_prompt_tokens,
                num_output_tokens=len(tokens),
                cumulative_logprob=hyp.cumulative_logprob if hyp else 0.0,
                seed=lead.seed,
                batch_sizes=[b for b, _ in steps[: len(tokens)]],
                queue_waits_s=[w for _, w in steps[: len(tokens)]],
                # The tokens reach the client now, all at once.
                first_token_latency_s=now - lead.request.arrival_time if tokens else None,
                num_cached_prompt_tokens=lead.num_cached_prompt_tokens,
                request_done=index == params.n - 1,
                beam_score=hyp.score if hyp else None,
            ))
        return outputs
