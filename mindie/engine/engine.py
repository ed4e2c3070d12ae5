"""The engine: requests in, one step at a time, outputs out.

step() = expire timeouts -> schedule -> run the model -> sample -> update sequences and emit
outputs. Everything else hangs off those five lines.
"""

from __future__ import annotations

import secrets
import time

import torch

from mindie.config import EngineConfig
from mindie.engine.block_manager import BlockManager
from mindie.engine.detokenizer import IncrementalDetokenizer
from mindie.engine.request import EngineRequest, FinishReason, RequestOutput, TokenLogprob
from mindie.engine.scheduler import Scheduler
from mindie.engine.sequence import Sequence
from mindie.model.loader import LoadedModel
from mindie.model.runner import ModelRunner
from mindie.sampling.sampler import sample


def kv_bytes_per_block(loaded: LoadedModel, block_size: int) -> int:
    c = loaded.config
    return 2 * c.num_layers * block_size * c.num_kv_heads * c.head_dim * loaded.model.embed.element_size()


class LLMEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.config = config
        num_blocks = config.num_kv_blocks or max(
            1, int(config.kv_cache_mem_gb * 2**30) // kv_bytes_per_block(loaded, config.block_size)
        )
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler_config(), self.blocks)
        self.runner = ModelRunner(loaded.model, self.blocks)
        self.requests: dict[str, list[Sequence]] = {}  # request id -> its unfinished samples
        self.eos_token_ids = frozenset(loaded.config.eos_token_ids) | frozenset(self.tokenizer.eos_token_ids)

    # --- requests ------------------------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> None:
        """Queues a request; raises ValueError (naming the field and range) if it cannot run."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        prompt_len = len(request.prompt_token_ids)
        if prompt_len > self.config.max_input_len:
            raise ValueError(
                f"prompt has {prompt_len} tokens; the limit is min(maxInputTokenLen, maxSeqLen - 1) = "
                f"{self.config.max_input_len}"
            )
        vocab = self.loaded.config.vocab_size
        bad = next((t for t in request.prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is out of range [0, {vocab})")
        max_new = min(request.params.max_tokens or self.config.max_iter_times, self.config.max_iter_times)
        max_total = min(prompt_len + max_new, self.config.max_seq_len, self.loaded.config.max_position)
        capacity = self.blocks.num_blocks * self.blocks.block_size
        if max_total > capacity:
            max_total = capacity
        if max_total <= prompt_len:
            raise ValueError(
                f"prompt has {prompt_len} tokens, leaving no room for output within maxSeqLen="
                f"{self.config.max_seq_len} and the KV cache ({capacity} tokens)"
            )
        base_seed = request.params.seed if request.params.seed is not None else secrets.randbits(63)
        samples: list[Sequence] = []
        for index in range(request.params.num_samples):
            detok = IncrementalDetokenizer(
                self.tokenizer,
                request.prompt_token_ids,
                skip_special_tokens=request.params.skip_special_tokens,
                stop=request.params.stop,
                include_stop_str_in_output=request.params.include_stop_str_in_output,
            )
            seed = (base_seed + index) % 2**63  # distinct, reproducible draws per sample
            samples.append(Sequence(request, index, seed, max_total, detok,
                                    admit_after=samples[0] if samples else None))
        self.requests[request.request_id] = samples
        for seq in samples:
            self.scheduler.add(seq)

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Stops every sample of a request in any phase and frees their blocks; returns their
        final outputs (empty if the request is unknown or already finished)."""
        return [self._finish(seq, FinishReason.ABORT, [], [], "", 0) for seq in list(self.requests.get(request_id, []))]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- the step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        outputs = self._expire_timeouts()
        scheduled = self.scheduler.schedule()
        if not scheduled.scheduled:
            return outputs
        logits, seqs = self.runner.execute(scheduled)
        self.scheduler.after_step(scheduled)
        if seqs:
            outputs += self._update(seqs, logits, batch_size=len(scheduled.scheduled))
        return outputs

    def _expire_timeouts(self) -> list[RequestOutput]:
        now = time.monotonic()
        expired = [s for samples in self.requests.values() for s in samples if s.timed_out(now)]
        return [self._finish(s, FinishReason.ABORT, [], [], "", 0) for s in expired]

    def _update(self, seqs: list[Sequence], logits: torch.Tensor, batch_size: int) -> list[RequestOutput]:
        sampled = sample(logits, seqs)
        tokens = sampled.token_ids.tolist()
        logprobs = sampled.logprobs.tolist()
        top_ids, top_lps = sampled.top_ids.tolist(), sampled.top_logprobs.tolist()
        now = time.monotonic()
        outputs = []
        for row, seq in enumerate(seqs):
            token, params = tokens[row], seq.request.params
            n_top = params.logprobs or 0
            lp = TokenLogprob(token, logprobs[row], list(zip(top_ids[row][:n_top], top_lps[row][:n_top])))
            seq.token_ids.append(token)
            seq.cumulative_logprob += lp.logprob
            if seq.first_token_time is None:
                seq.first_token_time = now
            delta = seq.detokenizer.append([token])
            reason = self._finish_reason(seq, token, delta.stop_string is not None)
            if reason is None:
                outputs.append(self._output(seq, [token], [lp], delta.text, None, batch_size))
            else:
                outputs.append(self._finish(seq, reason, [token], [lp], delta.text, batch_size))
        return outputs

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
                text: str, batch_size: int) -> RequestOutput:
        if reason is not FinishReason.STOP:
            text += seq.detokenizer.flush()
        seq.finish_reason = reason
        self.scheduler.remove(seq)
        samples = self.requests[seq.request.request_id]
        samples.remove(seq)
        if not samples:
            del self.requests[seq.request.request_id]
        return self._output(seq, tokens, lps, text, reason, batch_size, request_done=not samples)

    def _output(self, seq: Sequence, tokens: list[int], lps: list[TokenLogprob], text: str,
                reason: FinishReason | None, batch_size: int, request_done: bool = False) -> RequestOutput:
        first = seq.first_token_time is not None and seq.num_output_tokens == len(tokens) and tokens
        queue_wait = (seq.first_scheduled_time or time.monotonic()) - seq.request.arrival_time
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
            batch_size=batch_size,
            queue_wait_s=queue_wait,
            first_token_latency_s=(seq.first_token_time - seq.request.arrival_time) if first else None,
            num_cached_prompt_tokens=seq.num_cached_prompt_tokens,
            request_done=request_done,
        )
