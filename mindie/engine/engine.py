"""The engine: requests in, one step at a time, outputs out.

step() = schedule -> run the model -> sample -> update sequences and emit outputs. Everything
else hangs off those four lines. (A request's time limits are the server's: it aborts the request.)
Beam-search groups live in `beams` (engine/beam_search.py), the prefill/decode hand-off of KV in
`handoff` (engine/handoff.py); both share the engine's `requests` map and its scheduler.
"""

from __future__ import annotations

import dataclasses
import functools
import secrets
import time

import torch

from mindie.config import EngineConfig, TokenLimits
from mindie.engine.beam_search import BeamSearches
from mindie.engine.block_manager import BlockManager
from mindie.engine.detokenizer import DetokenizerDelta, IncrementalDetokenizer
from mindie.engine.handoff import KVHandoff, continued_sequence
from mindie.engine.request import EngineRequest, FinishReason, RequestOutput, SamplingParams, TokenLogprob
from mindie.engine.runner import ModelRunner, PromptLogits
from mindie.engine.scheduler import Scheduler, window_blocks
from mindie.engine.sequence import Sequence, StepInfo
from mindie.engine.stats import EngineStats
from mindie.model.loader import LoadedModel
from mindie.sampling.sampler import sample


def kv_bytes_per_block(loaded: LoadedModel, block_size: int) -> int:
    c = loaded.config
    element = torch.empty((), dtype=loaded.model.kv_dtype).element_size()
    return 2 * c.num_layers * block_size * c.num_kv_heads * c.head_dim * element


def max_total_tokens(request: EngineRequest, width: int, limits: TokenLimits, blocks: BlockManager,
                     max_position: int, window_peak: int = 0) -> int:
    """Prompt + the most tokens the request may reach; ValueError if that leaves no output.
    `window_peak`: the most blocks a sequence holds at once on a model whose every layer slides
    (scheduler.window_blocks; 0: no window, a sequence holds a block per block_size tokens)."""
    prompt_len = len(request.prompt_token_ids)
    params = request.params
    max_new = min(params.max_tokens or limits.max_iter_times, limits.max_iter_times)
    max_total = min(prompt_len + max_new, limits.max_seq_len, max_position)
    # All beams of a group must fit at once even sharing no block (as when they are recomputed
    # after a preemption), so that a group alone in the pool always completes. A sequence that
    # gives back what its window passed fits at any length once its window's blocks do; one
    # handed off after its first step keeps every block for the export.
    per_seq = blocks.num_blocks // width
    capacity = per_seq * blocks.block_size
    releases = 0 < window_peak <= per_seq and not request.handoff
    if max_total > capacity and not releases:
        max_total = capacity
    if max_total <= prompt_len:
        raise ValueError(
            f"prompt has {prompt_len} tokens, leaving no room for output within maxSeqLen="
            f"{limits.max_seq_len} and the KV cache ({capacity} tokens)"
        )
    return max_total


class LLMEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        """ValueError if the config's token limits do not fit the model and its KV cache."""
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        num_blocks = config.num_kv_blocks or max(
            1, int(config.kv_cache_mem_gb * 2**30) // kv_bytes_per_block(loaded, config.block_size)
        )
        window = loaded.config.kv_window
        window_peak = window_blocks(window, config.block_size, config.step_tokens) if window else 0
        self.limits = config.limits(loaded.config.max_position, num_blocks * config.block_size,
                                    window_fits=0 < window_peak <= num_blocks)
        self.config = config.with_limits(self.limits)
        self.kv_cache_bytes = num_blocks * kv_bytes_per_block(loaded, config.block_size)
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(dataclasses.replace(config.scheduler_config(), window=window), self.blocks)
        self.runner = ModelRunner(loaded.model, self.blocks)
        self.requests: dict[str, list[Sequence]] = {}  # request id -> its unfinished samples or live beams
        self.eos_token_ids = frozenset(loaded.config.eos_token_ids) | frozenset(self.tokenizer.eos_token_ids)
        # Not a bound method: the parts must not refer back to the engine, so that a dropped engine
        # (and its KV cache) is freed at once rather than by a later cycle collection.
        self._max_total = functools.partial(max_total_tokens, limits=self.limits, blocks=self.blocks,
                                            max_position=loaded.config.max_position, window_peak=window_peak)
        vocab = loaded.config.vocab_size
        self.beams = BeamSearches(self.scheduler, self.requests, self.tokenizer, self.eos_token_ids, vocab)
        self.handoff = KVHandoff(self.blocks, self.scheduler, self.requests, self.tokenizer, vocab, self._max_total)

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
        if request.media is not None and not hasattr(self.loaded.model, "encode_media"):
            raise ValueError(f"the served model ({self.loaded.name}) reads text only; it takes no images")
        max_total = self._max_total(request, width)
        if request.handoff and (width > 1 or params.num_samples > 1):
            raise ValueError("only a single-sample request can be handed off after its first token")
        if request.handoff and self.handoff.holds_lease(request.request_id):
            raise ValueError(f"request id {request.request_id!r} still has KV blocks held for a decode node")
        base_seed = params.seed if params.seed is not None else secrets.randbits(64)
        if request.grammar is not None and params.use_beam_search:
            raise ValueError("use_beam_search cannot be combined with structured output or required tool calls")
        if params.use_beam_search:
            self.beams.add(request, max_total, base_seed)
            return
        if request.continuation is not None:  # P recomputing what a decode node sent back
            seq = continued_sequence(request, max_total, self.tokenizer, vocab)
            self.requests[request.request_id] = [seq]
            self.scheduler.add(seq)
            return
        samples: list[Sequence] = []
        for index in range(request.params.num_samples):
            detok = IncrementalDetokenizer.for_request(self.tokenizer, request)
            seed = (base_seed + index) % 2**64  # distinct, reproducible draws per sample
            matcher = request.grammar.matcher() if request.grammar is not None else None
            samples.append(Sequence(request, index, seed, max_total, detok,
                                    admit_after=samples[0] if samples else None, matcher=matcher))
        self.requests[request.request_id] = samples
        for seq in samples:
            self.scheduler.add(seq)

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Stops every sample of a request in any phase and frees their blocks; returns their
        final outputs (empty if the request is unknown or already finished)."""
        if request_id in self.beams:
            return self.beams.finish(request_id, FinishReason.ABORT)
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
        return outputs + self.beams.update([seqs[r] for r in beam_rows], logits[beam_rows], step)

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
                # token of a shortest completion replaces one that would leave no room to finish
                # (and, behind a reasoning gate, `</think>` one that would end the sample unanswered).
                forced = seq.matcher.fit_budget(token, seq.max_total_tokens - len(seq.token_ids),
                                                self._ends_sample(params, token))
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
                export = self.handoff.export(seq)
                out = seq.output([token], [lp], delta.text, None, (step.batch_size, wait_s), request_done=True)
                outputs.append(dataclasses.replace(out, kv=export))
            elif reason is None:
                outputs.append(seq.output([token], [lp], delta.text, None, (step.batch_size, wait_s)))
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

    def _ends_sample(self, params: SamplingParams, token: int) -> bool:
        """Whether `token` ends a sample of a request with `params` (a stop token, or EOS unless ignored)."""
        return token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids)

    def _finish_reason(self, seq: Sequence, token: int, stop_string_hit: bool) -> FinishReason | None:
        params = seq.request.params
        if stop_string_hit:
            return FinishReason.STOP
        if self._ends_sample(params, token):
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
        return seq.output(tokens, lps, text, reason, timing, request_done=not samples)
