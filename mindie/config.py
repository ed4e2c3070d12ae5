"""Engine configuration: MindIE's ModelDeployConfig / ScheduleConfig keys, with their ranges.

`EngineConfig.from_mindie` takes the keys as MindIE spells them (`cacheBlockSize`,
`maxPrefillTokens`, ...). An unknown key or an out-of-range value raises ConfigError (a
ValueError) naming the key and its allowed range. Unlike MindIE, maxPrefillTokens may be smaller than maxInputTokenLen:
long prompts are prefilled in chunks (SplitFuse is always on). A step computes at most
prefillChunkSize tokens, decodes and prompt chunks together; unset, it is what the CPU needs to
run its matmuls at their full rate (DEFAULT_STEP_TOKENS), at most maxPrefillTokens.

The token limits (maxSeqLen, maxInputTokenLen, maxIterTimes) may be left unset: the engine then
fits them to the model it runs and to its KV cache (`EngineConfig.limits`), where MindIE has
fixed defaults (2560, 2048, 512) that would cut a long-context model's prompts short.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from mindie.config_keys import ConfigError, Key
from mindie.engine.scheduler import DEFAULT_STEP_TOKENS, SchedulerConfig

_INT_MAX = 2**31 - 1
# MindIE key -> (EngineConfig field, its type and range); config.json's sections use these same keys
ENGINE_KEYS: dict[str, tuple[str, Key]] = {
    "cacheBlockSize": ("block_size", Key("int", lo=1, hi=128)),
    "maxSeqLen": ("max_seq_len", Key("int", lo=2, hi=_INT_MAX)),  # a one-token prompt and one output token
    "maxInputTokenLen": ("max_input_token_len", Key("int", lo=1, hi=4194304)),
    "maxIterTimes": ("max_iter_times", Key("int", lo=1, hi=_INT_MAX)),
    "maxPrefillTokens": ("max_prefill_tokens", Key("int", lo=1, hi=4194304)),
    "prefillChunkSize": ("prefill_chunk_size", Key("int", lo=1, hi=4194304)),
    "maxPrefillBatchSize": ("max_prefill_batch_size", Key("int", lo=0, hi=819200)),
    "maxBatchSize": ("max_batch_size", Key("int", lo=1, hi=819200)),
    "maxPreemptCount": ("max_preempt_count", Key("int", lo=0, hi=819200)),
    "kvCacheMemGB": ("kv_cache_mem_gb", Key("num", lo=0.001, hi=1024)),
    "numKvBlocks": ("num_kv_blocks", Key("int", lo=1, hi=_INT_MAX)),
    "enablePrefixCache": ("enable_prefix_caching", Key("bool")),
}

DEFAULT_MAX_ITER_TIMES = 512  # MindIE's default maxIterTimes


@dataclass(frozen=True)
class TokenLimits:
    """The token limits an engine runs with, every one set, and where maxSeqLen came from."""

    max_seq_len: int  # prompt + output of one sequence
    max_input_token_len: int
    max_iter_times: int  # output tokens of one request
    model_context: int  # the model's context length (max_position_embeddings / <arch>.context_length)
    kv_tokens: int  # what the KV cache holds: blocks x block size
    configured: bool  # maxSeqLen was set rather than fitted

    @property
    def max_input_len(self) -> int:
        """Longest accepted prompt: min(maxInputTokenLen, maxSeqLen - 1)."""
        return min(self.max_input_token_len, self.max_seq_len - 1)

    def describe(self) -> str:
        """One start-up line: the limits, and why maxSeqLen is what it is."""
        if self.configured:
            why = f"configured; the model's context length is {self.model_context}"
        elif self.max_seq_len < self.model_context:
            why = f"what the KV cache holds; the model's context length is {self.model_context}"
        else:
            why = "the model's context length"
        return (f"maxSeqLen {self.max_seq_len} ({why}; the KV cache holds {self.kv_tokens} tokens), "
                f"maxInputTokenLen {self.max_input_token_len}, maxIterTimes {self.max_iter_times}")


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 128
    max_seq_len: int | None = None  # None: fitted to the model and the KV cache, see limits()
    max_input_token_len: int | None = None  # None: maxSeqLen - 1
    max_iter_times: int | None = None  # None: 512, at most maxSeqLen
    max_prefill_tokens: int = 8192
    prefill_chunk_size: int | None = None  # None: DEFAULT_STEP_TOKENS, at most maxPrefillTokens
    max_prefill_batch_size: int = 50
    max_batch_size: int = 200
    # MindIE's default 0 disables preemption because its preemption swaps to host memory; here a
    # preempted sequence is recomputed, which needs no extra memory, so it is on by default.
    max_preempt_count: int = 200
    kv_cache_mem_gb: float = 2.0  # KV pool budget, both K and V of every layer
    num_kv_blocks: int | None = None  # overrides the budget (tests)
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        for key, (name, spec) in ENGINE_KEYS.items():
            if getattr(self, name) is not None:
                spec.parse(key, getattr(self, name))
        if self.max_seq_len is not None and self.max_iter_times is not None and self.max_iter_times > self.max_seq_len:
            raise ValueError(f"maxIterTimes must be in [1, maxSeqLen={self.max_seq_len}], got {self.max_iter_times}")
        if self.prefill_chunk_size is not None and self.prefill_chunk_size > self.max_prefill_tokens:
            raise ValueError(f"prefillChunkSize must be in [1, maxPrefillTokens={self.max_prefill_tokens}], "
                             f"got {self.prefill_chunk_size}")

    @classmethod
    def from_mindie(cls, keys: dict[str, Any]) -> EngineConfig:
        unknown = sorted(set(keys) - set(ENGINE_KEYS))
        if unknown:
            raise ConfigError(f"unknown engine config key(s) {unknown}; known: {sorted(ENGINE_KEYS)}")
        return cls(**{ENGINE_KEYS[k][0]: v for k, v in keys.items()})

    def limits(self, model_context: int, kv_tokens: int, window_fits: bool = False) -> TokenLimits:
        """The token limits for a model of `model_context` positions over a KV cache that holds
        `kv_tokens`. An unset maxSeqLen is the model's context length, or what the cache holds if
        that is less (a sequence longer than the cache could never run) unless `window_fits` (every
        layer slides and the cache holds a window's blocks: a sequence gives back what its window
        passed, so its length is not the cache's to bound); an unset maxInputTokenLen is
        maxSeqLen - 1; an unset maxIterTimes is 512, at most maxSeqLen. A set maxSeqLen wins
        (requests stay bounded by the model's context length all the same). ValueError if a set
        maxIterTimes exceeds a fitted maxSeqLen."""
        seq_len = self.max_seq_len or (model_context if window_fits else min(model_context, kv_tokens))
        if self.max_iter_times is not None and self.max_iter_times > seq_len:
            raise ValueError(f"maxIterTimes must be in [1, maxSeqLen={seq_len}] (maxSeqLen is unset: the model's "
                             f"context length {model_context}, at most the {kv_tokens} tokens the KV cache holds), "
                             f"got {self.max_iter_times}")
        return TokenLimits(
            max_seq_len=seq_len,
            max_input_token_len=self.max_input_token_len or seq_len - 1,
            max_iter_times=self.max_iter_times or min(DEFAULT_MAX_ITER_TIMES, seq_len),
            model_context=model_context,
            kv_tokens=kv_tokens,
            configured=self.max_seq_len is not None,
        )

    def with_limits(self, limits: TokenLimits) -> EngineConfig:
        """This config with every token limit set, as `limits` has them (what the server reports)."""
        return replace(self, max_seq_len=limits.max_seq_len, max_input_token_len=limits.max_input_token_len,
                       max_iter_times=limits.max_iter_times)

    @property
    def step_tokens(self) -> int:
        """Tokens one step computes at most, decodes and prompt chunks together."""
        return self.prefill_chunk_size or min(DEFAULT_STEP_TOKENS, self.max_prefill_tokens)

    def describe_steps(self) -> str:
        """One start-up line: a step's token budget, and where it came from."""
        why = "prefillChunkSize" if self.prefill_chunk_size else f"the CPU's default {DEFAULT_STEP_TOKENS}"
        return (f"at most {self.step_tokens} tokens a step ({why}, at most maxPrefillTokens "
                f"{self.max_prefill_tokens}), maxBatchSize {self.max_batch_size}")

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            step_tokens=self.step_tokens,
            max_batch_size=self.max_batch_size,
            max_prefill_batch_size=self.max_prefill_batch_size or self.max_batch_size,
            max_preempt_count=self.max_preempt_count,
        )
