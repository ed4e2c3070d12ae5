"""The engine: requests in, one step at a time, outputs out.

step() = schedule -> run the model -> sample -> update sequences and emit outputs. Everything
else hangs off those four lines. (A request's time limits are the server's: it aborts the request.)

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
import secrets
import time
from typing import NamedTuple

import torch

from mindie.config import EngineConfig
from mindie.engine.block_manager import BlockManager
from mindie.engine.detokenizer import DetokenizerDelta, IncrementalDetokenizer
from mindie.engine.request import EngineRequest, FinishReason, KVExport, RequestOutput, TokenLogprob
from mindie.engine.runner import ModelRunner, PromptLogits
from mindie.engine.scheduler import Scheduler
from mindie.engine.sequence import Sequence
from mindie.engine.stats import EngineStats
from mindie.model.loader import LoadedModel
from mindie.sampling.beam import BeamSearch
from mindie.sampling.sampler import sample

LEASE_PREFIX = "pd-lease:"  # block-table ids of P's pinned exports, apart from any sequence's


def _seq_id(request_id: str) -> str:
    return f"{request_id}#0"


class StepInfo(NamedTuple):
    """What every token computed in one step reports: the step's size and when it started."""

    batch_size: int
    started: float  # time.monotonic() at the start of the step

    def wait_s(self, ready_time: float) -> float:
        return max(0.0, self.started - ready_time)


def kv_bytes_per_block(loaded: LoadedModel, block_size: int) -> int:
    c = loaded.config
    element = torch.empty((), dtype=loaded.model.kv_dtype).element_size()
    return 2 * c.num_layers * block_size * c.num_kv_heads * c.head_dim * element


class LLMEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        """ValueError if the config's token limits do not fit the model and its KV cache."""
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        num_blocks = config.num_kv_blocks or max(
            1, int(config.kv_cache_mem_gb * 2**30) // kv_bytes_per_block(loaded, config.block_size)
        )
        self.limits = config.limits(loaded.config.max_position, num_blocks * config.block_size)
        self.config = config.with_limits(self.limits)
        self.kv_cache_bytes = num_blocks * kv_bytes_per_block(loaded, config.block_size)
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler_config(), self.blocks)
        self.runner = ModelRunner(loaded.model, self.blocks)
        self.requests: dict[str, list[Sequence]] = {}  # request id -> its unfinished samples or live beams
        self.beam_searches: dict[str, BeamSearch] = {}  # request id -> its search, for beam requests
        self._beam_logits: dict[Sequence, torch.Tensor] = {}  # computed beams waiting for their siblings
        self._beam_ids = itertools.count(1)  # sequence index of forked beams (the prompt's is 0)
        # request id -> (batch size, queue wait) of each beam step so far: a hypothesis of length
        # L reports the first L of them
        self._beam_steps: dict[str, list[tuple[int, float]]] = {}
        self.eos_token_ids = frozenset(loaded.config.eos_token_ids) | frozenset(self.tokenizer.eos_token_ids)
        self.reserved: set[str] = set()  # D: request ids holding blocks for KV being pulled

    # --- requests ------------------------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> None:
        """Queues a request; raises ValueError (naming the field and range) if it cannot run."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        params = request.params
        width = params.num_samples if params.use_beam_search else 1
        if width > self.config.max_batch_size:
            raise ValueError(f"beam width (best_of or n) is {width}; the limit is maxBatchSize="
                             f"{self.config.max_batch_size}")
        prompt_len = len(request.prompt_token_ids)
        if prompt_len > self.limits.max_input_len:
            raise ValueError(
                f"prompt has {prompt_len} tokens; the limit is min(maxInputTokenLen, maxSeqLen - 1) = "
                f"{self.limits.max_input_len}"
            )
        vocab = self.loaded.config.vocab_size
        bad = next((t for t in request.prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is out of range [0, {vocab})")
        max_total = self._max_total(request, width)
        if request.handoff and (width > 1 or params.num_samples > 1):
            raise ValueError("only a single-sample request can be handed off after its first token")
        if request.handoff and self.blocks.has(LEASE_PREFIX + request.request_id):
            raise ValueError(f"request id {request.request_id!r} still has KV blocks held for a decode node")
        base_seed = params.seed if params.seed is not None else secrets.randbits(64)
        if request.grammar is not None and params.use_beam_search:
            raise ValueError("use_beam_search cannot be combined with structured output or required tool calls")
        if params.use_beam_search:
            self._add_beam_search(request, max_total, base_seed)
            return
        if request.continuation is not None:
            seq = self._continued(request, max_total)
            self.requests[request.request_id] = [seq]
            self.scheduler.add(seq)
            return
        samples: list[Sequence] = []
        for index in range(request.params.num_samples):
            detok = IncrementalDetokenizer(
                self.tokenizer,
                request.prompt_token_ids,
                skip_special_tokens=request.params.skip_special_tokens,
                stop=request.params.stop,
                include_stop_str_in_output=request.params.include_stop_str_in_output,
            )
            seed = (base_seed + index) % 2**64  # distinct, reproducible draws per sample
            matcher = request.grammar.matcher() if request.grammar is not None else None
            samples.append(Sequence(request, index, seed, max_total, detok,
                                    admit_after=samples[0] if samples else None, matcher=matcher))
        self.requests[request.request_id] = samples
        for seq in samples:
            self.scheduler.add(seq)

    def _max_total(self, request: EngineRequest, width: int) -> int:
        """Prompt + the most tokens the request may reach; ValueError if that leaves no output."""
        prompt_len = len(request.prompt_token_ids)
        params = request.params
        max_new = min(params.max_tokens or self.limits.max_iter_times, self.limits.max_iter_times)
        max_total = min(prompt_len + max_new, self.limits.max_seq_len, self.loaded.config.max_position)
        # All beams of a group must fit at once even sharing no block (as when they are recomputed
        # after a preemption), so that a group alone in the pool always completes.
        capacity = self.blocks.num_blocks // width * self.blocks.block_size
        if max_total > capacity:
            max_total = capacity
        if max_total <= prompt_len:
            raise ValueError(
                f"prompt has {prompt_len} tokens, leaving no room for output within maxSeqLen="
                f"{self.limits.max_seq_len} and the KV cache ({capacity} tokens)"
            )
        return max_total

    # --- prefill/decode disaggregation ---------------------------------------------------------
    # P: a `handoff` request stops after its first token with its prompt's blocks pinned under a
    # lease (`_hand_off`); `release_kv` drops the lease once D has pulled them or the lease expired.
    # D: `reserve_kv` takes fresh blocks for the incoming KV (not registered in the prefix cache
    # until they hold it), the transport writes them, and `resume` turns them into a running
    # sequence that continues from the first token exactly as P's would have; `drop_reserved`
    # gives them back when the pull failed.

    def release_kv(self, lease_id: str) -> None:
        """Frees the blocks pinned under a lease; unknown (already released) leases are ignored."""
        if lease_id.startswith(LEASE_PREFIX) and self.blocks.has(lease_id):
            self.blocks.free(lease_id)

    def reserve_kv(self, request_id: str, token_ids: list[int], num_tokens: int) -> list[int] | None:
        """Fresh blocks for positions [0, num_tokens) of request_id's only sample, in order; None if
        the pool has too few now. ValueError if the id is in use."""
        seq_id = _seq_id(request_id)
        if request_id in self.requests or self.blocks.has(seq_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.blocks.allocate(seq_id, token_ids, num_tokens, reuse_prefix=False) is None:
            return None
        self.reserved.add(request_id)
        return self.blocks.block_table(seq_id)

    def drop_reserved(self, request_id: str) -> None:
        if request_id in self.reserved:
            self.reserved.discard(request_id)
            self.blocks.free(_seq_id(request_id))

    def resume(self, request: EngineRequest, num_cached_prompt_tokens: int = 0) -> None:
        """Runs a request handed off by P: its `continuation` holds the outputs emitted so far and
        its reserved blocks the KV of every token before the last of them (the prompt, and any
        outputs a recompute went over). ValueError (the reservation dropped) if it cannot run here."""
        rid = request.request_id
        if rid not in self.reserved:
            raise ValueError(f"request {rid!r} has no reserved KV blocks")
        try:
            if request.continuation is None:
                raise ValueError("a resumed request needs the outputs it continues after")
            seq = self._continued(request, self._max_total(request, 1))
        except ValueError:
            self.drop_reserved(rid)
            raise
        self.reserved.discard(rid)
        seq.num_computed_tokens = len(seq.token_ids) - 1
        seq.num_cached_prompt_tokens = num_cached_prompt_tokens  # P's prefix-cache hit, reported as is
        seq.first_scheduled_time = seq.first_token_time = seq.ready_time = time.monotonic()
        self.blocks.commit(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
        self.requests[rid] = [seq]
        self.scheduler.resume(seq)

    def _continued(self, request: EngineRequest, max_total: int) -> Sequence:
        """The one sample of a request that goes on after `request.continuation`'s outputs: the
        detokenizer and grammar matcher replayed over them one by one, as if it had sampled them."""
        cont = request.continuation
        assert cont is not None
        params = request.params
        if params.use_beam_search or params.num_samples != 1:
            raise ValueError("only a single-sample request can continue after outputs made elsewhere")
        if not cont.output_token_ids:
            raise ValueError("a continued request needs at least one output")
        vocab = self.loaded.config.vocab_size
        bad = next((t for t in cont.output_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"output token id {bad} is out of range [0, {vocab})")
        if len(request.prompt_token_ids) + len(cont.output_token_ids) >= max_total:
            raise ValueError("the request has no room left for output here")
        detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                       skip_special_tokens=params.skip_special_tokens, stop=params.stop,
                                       include_stop_str_in_output=params.include_stop_str_in_output)
        matcher = request.grammar.matcher() if request.grammar is not None else None
        for token in cont.output_token_ids:
            detok.append([token])
            if matcher is not None:
                matcher.advance(token)
        seq = Sequence(request, 0, cont.seed, max_total, detok, matcher=matcher,
                       token_ids=list(request.prompt_token_ids) + list(cont.output_token_ids))
        seq.cumulative_logprob = cont.cumulative_logprob
        return seq

    def _hand_off(self, seq: Sequence, tokens: list[int], lps: list[TokenLogprob], text: str,
                  timing: tuple[int, float]) -> RequestOutput:
        lease_id = LEASE_PREFIX + seq.request.request_id
        self.blocks.fork(seq.seq_id, lease_id)  # the lease holds the blocks once the sequence lets go
        export = KVExport(lease_id, self.blocks.block_table(lease_id), seq.num_computed_tokens)
        self.scheduler.remove(seq)
        del self.requests[seq.request.request_id]
        out = self._output(seq, tokens, lps, text, None, timing, request_done=True)
        return dataclasses.replace(out, kv=export)

    def _add_beam_search(self, request: EngineRequest, max_total: int, seed: int) -> None:
        params = request.params
        eos = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        vocab = self.loaded.config.vocab_size
        search = BeamSearch(params, [t for t in eos if t < vocab], max_total - len(request.prompt_token_ids))
        prompt = Sequence(request, 0, seed, max_total, detokenizer=None)
        prompt.lockstep = [prompt]  # one live beam until the first step
        self.requests[request.request_id] = prompt.lockstep
        self.beam_searches[request.request_id] = search
        self._beam_steps[request.request_id] = []
        self.scheduler.add(prompt)

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Stops every sample of a request in any phase and frees their blocks; returns their
        final outputs (empty if the request is unknown or already finished)."""
        if request_id in self.beam_searches:
            return self._finish_beams(request_id, FinishReason.ABORT)
        return [self._finish(seq, FinishReason.ABORT, [], [], "", None)
                for seq in list(self.requests.get(request_id, []))]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        sched, blocks = self.scheduler, self.blocks
        return EngineStats(running=len(sched.running), waiting=len(sched.waiting),
                           free_blocks=blocks.num_free_blocks(), total_blocks=blocks.num_blocks,
                           prefix_query_tokens=blocks.prefix_query_tokens, prefix_hit_tokens=blocks.prefix_hit_tokens,
                           num_preemptions=sched.num_preemptions)

    # --- the step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        started = time.monotonic()
        outputs = self._forced_preemptions()
        scheduled = self.scheduler.schedule()
        outputs += [self._send_back(seq) for seq in scheduled.preempted if seq.request.recompute_elsewhere]
        if not scheduled.scheduled:
            return outputs
        logits, seqs, prompt_logits = self.runner.execute(scheduled)
        for span in prompt_logits:
            self._record_prompt_logprobs(span)
        self.scheduler.after_step(scheduled)
        if seqs:
            outputs += self._update(seqs, logits, StepInfo(len(scheduled.scheduled), started))
        return outputs

    def _forced_preemptions(self) -> list[RequestOutput]:
        """The `preempt_at` test hook: preempted exactly as the scheduler would when short of blocks."""
        due = [seq for seq in self.scheduler.running if seq.request.recompute_elsewhere
               and seq.request.preempt_at is not None and seq.num_output_tokens >= seq.request.preempt_at]
        for seq in due:
            self.scheduler.preempt(seq)
        return [self._send_back(seq) for seq in due]

    def _send_back(self, seq: Sequence) -> RequestOutput:
        """A preempted sequence whose recompute is a prefill node's work ends here, its KV already freed."""
        return self._finish(seq, FinishReason.RECOMPUTE, [], [], "", None)

    def _update(self, seqs: list[Sequence], logits: torch.Tensor, step: StepInfo) -> list[RequestOutput]:
        beam_rows = [row for row, seq in enumerate(seqs) if seq.lockstep is not None]
        if not beam_rows:
            return self._sample(seqs, logits, step)
        plain = [row for row, seq in enumerate(seqs) if seq.lockstep is None]
        outputs = self._sample([seqs[r] for r in plain], logits[plain], step) if plain else []
        for row in beam_rows:
            self._beam_logits[seqs[row]] = logits[row]
        for request_id in dict.fromkeys(seqs[row].request.request_id for row in beam_rows):
            beams = self.requests[request_id]  # the group's lockstep list
            if all(beam.num_pending_tokens == 0 for beam in beams):
                outputs += self._beam_step(request_id, beams, step)
        return outputs

    def _beam_step(self, request_id: str, beams: list[Sequence], step: StepInfo) -> list[RequestOutput]:
        # The group waits as one: from the end of its previous step (its lead's ready time).
        self._beam_steps[request_id].append((step.batch_size, step.wait_s(beams[0].ready_time)))
        children = self.beam_searches[request_id].step(torch.stack([self._beam_logits.pop(b) for b in beams]))
        if not children:
            return self._finish_beams(request_id, None)
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

    def _finish_beams(self, request_id: str, reason: FinishReason | None) -> list[RequestOutput]:
        """Frees every beam and returns the n best hypotheses, best first (reason None: the search
        is done), or n empty outputs with `reason` (an abort)."""
        search = self.beam_searches.pop(request_id)
        beams = self.requests.pop(request_id)
        steps = self._beam_steps.pop(request_id)
        for beam in beams:
            self.scheduler.remove(beam)
            self._beam_logits.pop(beam, None)
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

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor, step: StepInfo) -> list[RequestOutput]:
        sampled = sample(logits, seqs, self.eos_token_ids)
        tokens = sampled.token_ids.tolist()
        logprobs = sampled.logprobs.tolist()
        top_ids, top_lps = sampled.top_ids.tolist(), sampled.top_logprobs.tolist()
        now = time.monotonic()
        outputs = []
        for row, seq in enumerate(seqs):
            token, params = tokens[row], seq.request.params
            n_top = params.logprobs or 0
            lp = TokenLogprob(token, logprobs[row], list(zip(top_ids[row][:n_top], top_lps[row][:n_top])))
            if seq.matcher is not None:
                # A structured output must parse however the budget ends: near its end, the next
                # token of a shortest completion replaces one that would leave no room to finish.
                forced = seq.matcher.fit_budget(token, seq.max_total_tokens - len(seq.token_ids))
                if forced != token:
                    token = forced
                    lp = TokenLogprob(token, torch.log_softmax(logits[row].float(), -1)[token].item(), lp.top)
            seq.token_ids.append(token)
            seq.cumulative_logprob += lp.logprob
            wait_s, seq.ready_time = step.wait_s(seq.ready_time), now
            if seq.first_token_time is None:
                seq.first_token_time = now
            if token in params.stop_token_ids and not params.include_stop_str_in_output:
                # a stop token ends the text without adding its own (as a stop string does)
                delta = DetokenizerDelta("", None)
            else:
                delta = seq.detokenizer.append([token])
            reason = self._finish_reason(seq, token, delta.stop_string is not None)
            if reason is None and seq.matcher is not None and (not seq.matcher.advance(token)
                                                               or seq.matcher.is_finished()):
                reason = FinishReason.EOS  # the value is complete (the mask allows nothing else)
            if reason is None and seq.request.handoff:
                outputs.append(self._hand_off(seq, [token], [lp], delta.text, (step.batch_size, wait_s)))
            elif reason is None:
                outputs.append(self._output(seq, [token], [lp], delta.text, None, (step.batch_size, wait_s)))
            else:
                outputs.append(self._finish(seq, reason, [token], [lp], delta.text, (step.batch_size, wait_s)))
        return outputs

    def _record_prompt_logprobs(self, span: PromptLogits) -> None:
        seq, n_top = span.seq, span.seq.request.params.prompt_logprobs or 0
        prompt = seq.request.prompt_token_ids
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = [None] * len(prompt)
        lps = torch.log_softmax(span.logits.float(), dim=-1)
        targets = torch.tensor(prompt[span.first_position + 1 : span.first_position + 1 + len(lps)])
        chosen = lps.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
        top_lp, top_id = lps.topk(n_top, dim=-1) if n_top else (None, None)
        for i, (token, lp) in enumerate(zip(targets.tolist(), chosen)):
            top = list(zip(top_id[i].tolist(), top_lp[i].tolist())) if n_top else []
            seq.prompt_logprobs[span.first_position + 1 + i] = TokenLogprob(token, lp, top)

    def _finish_reason(self, seq: Sequence, token: int, stop_string_hit: bool) -> FinishReason | None:
        params = seq.request.params
        if stop_string_hit:
            return FinishReason.STOP
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return FinishReason.EOS
        if len(seq.token_ids) >= seq.max_total_tokens:
            return FinishReason.LENGTH
        return None

    def _finish(self, seq: Sequence, reason: FinishReason, tokens: list[int], lps: list[TokenLogprob],
                text: str, timing: tuple[int, float] | None) -> RequestOutput:
        if reason not in (FinishReason.STOP, FinishReason.RECOMPUTE):  # a recompute goes on: hold text back
            text += seq.detokenizer.flush()
        seq.finish_reason = reason
        self.scheduler.remove(seq)
        samples = self.requests[seq.request.request_id]
        samples.remove(seq)
        if not samples:
            del self.requests[seq.request.request_id]
        return self._output(seq, tokens, lps, text, reason, timing, request_done=not samples)

    def _output(self, seq: Sequence, tokens: list[int], lps: list[TokenLogprob], text: str,
                reason: FinishReason | None, timing: tuple[int, float] | None,
                request_done: bool = False) -> RequestOutput:
        """`timing`: (batch size, queue wait) of the one new token; None when there is none."""
        first = seq.first_token_time is not None and seq.num_output_tokens == len(tokens) and tokens
        return RequestOutput(
            request_id=seq.request.request_id,
            index=seq.index,
            new_token_ids=tokens,
            new_text=text,
            new_logprobs=lps,
            finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            cumulative_logprob=seq.cumulative_logprob,
            seed=seq.seed,
            batch_sizes=[timing[0]] if timing else [],
            queue_waits_s=[timing[1]] if timing else [],
            first_token_latency_s=(seq.first_token_time - seq.request.arrival_time) if first else None,
            num_cached_prompt_tokens=seq.num_cached_prompt_tokens,
            request_done=request_done,
            prompt_logprobs=seq.prompt_logprobs if first and seq.index == 0 else None,
        )
