"""Engine configuration: MindIE's ModelDeployConfig / ScheduleConfig keys, with their ranges.

`EngineConfig.from_mindie` takes the keys as MindIE spells them (`cacheBlockSize`,
`maxPrefillTokens`, ...). An unknown key or an out-of-range value raises ValueError naming the
key and its allowed range. Unlike MindIE, maxPrefillTokens may be smaller than maxInputTokenLen:
long prompts are prefilled in chunks (SplitFuse is always on).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from mindie.engine.scheduler import SchedulerConfig

# MindIE key -> (EngineConfig field, minimum, maximum)
_KEYS: dict[str, tuple[str, float, float]] = {
    "cacheBlockSize": ("block_size", 1, 128),
    "maxSeqLen": ("max_seq_len", 1, 2**31 - 1),
    "maxInputTokenLen": ("max_input_token_len", 1, 4194304),
    "maxIterTimes": ("max_iter_times", 1, 2**31 - 1),
    "maxPrefillTokens": ("max_prefill_tokens", 1, 4194304),
    "maxPrefillBatchSize": ("max_prefill_batch_size", 0, 819200),
    "maxBatchSize": ("max_batch_size", 1, 819200),
    "maxPreemptCount": ("max_preempt_count", 0, 819200),
    "kvCacheMemGB": ("kv_cache_mem_gb", 0.001, 1024),
    "numKvBlocks": ("num_kv_blocks", 1, 2**31 - 1),
    "enablePrefixCache": ("enable_prefix_caching", 0, 1),
}


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 128
    max_seq_len: int = 2560
    max_input_token_len: int = 2048
    max_iter_times: int = 512
    max_prefill_tokens: int = 8192
    max_prefill_batch_size: int = 50
    max_batch_size: int = 200
    # MindIE's default 0 disables preemption because its preemption swaps to host memory; here a
    # preempted sequence is recomputed, which needs no extra memory, so it is on by default.
    max_preempt_count: int = 200
    kv_cache_mem_gb: float = 2.0  # KV pool budget, both K and V of every layer
    num_kv_blocks: int | None = None  # overrides the budget (tests)
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        for key, (name, lo, hi) in _KEYS.items():
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) and name != "enable_prefix_caching":
                raise ValueError(f"{key} must be a number in [{lo}, {hi}], got {value!r}")
            if not lo <= value <= hi:
                raise ValueError(f"{key} must be in [{lo}, {hi}], got {value!r}")
        if self.max_iter_times > self.max_seq_len:
            raise ValueError(f"maxIterTimes must be in [1, maxSeqLen={self.max_seq_len}], got {self.max_iter_times}")

    @classmethod
    def from_mindie(cls, keys: dict[str, Any]) -> EngineConfig:
        unknown = sorted(set(keys) - set(_KEYS))
        if unknown:
            raise ValueError(f"unknown engine config key(s) {unknown}; known: {sorted(_KEYS)}")
        known = {f.name for f in fields(cls)}
        return cls(**{_KEYS[k][0]: v for k, v in keys.items() if _KEYS[k][0] in known})

    @property
    def max_input_len(self) -> int:
        """Longest accepted prompt: min(maxInputTokenLen, maxSeqLen - 1)."""
        return min(self.max_input_token_len, self.max_seq_len - 1)

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            max_prefill_tokens=self.max_prefill_tokens,
            max_batch_size=self.max_batch_size,
            max_prefill_batch_size=self.max_prefill_batch_size or self.max_batch_size,
            max_preempt_count=self.max_preempt_count,
        )
