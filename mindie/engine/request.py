"""The engine's one request type, shared by every API flavour, and what the engine reports back.

A protocol family's parse validates its own body and builds an `EngineRequest` (unnamed until the
server admits it); the engine turns each request into a `Sequence` (its runtime state) and emits
`RequestOutput`s: one per step while it runs, the last with a finish reason (a beam-search
request: one per returned hypothesis, all at its end). This module loads neither torch nor the
kernels, so processes that only route requests can use these types.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mindie.structured.grammar import Grammar

SEED_MAX = 2**64 - 1  # seeds are uint64, as MindIE documents them
# The sampling kernel's limit on top-N log-probabilities (kMaxTopLogprobs in kernels/cpu/sampling.h),
# restated so that this module loads without the kernels; a test checks that they agree.
MAX_TOP_LOGPROBS = 20
MAX_N = 128  # MindIE's default maxN: samples (n / best_of) per request
# Bounds on the work a request sizes (seeds 002 and 004): stop strings, their total characters, and
# stop token ids. One stop string may be 32768 characters (a string `stop` on /v1/completions);
# the API routes bound the strings of a list at 1024 characters each.
MAX_STOP_STRINGS, MAX_STOP_CHARS_TOTAL, MAX_STOP_TOKEN_IDS = 1024, 32768, 1024
MAX_STOP_LIST_ITEM_CHARS = 1024


class FinishReason(enum.StrEnum):
    EOS = "eos"  # an end-of-sequence token or one of stop_token_ids
    STOP = "stop"  # a stop string
    LENGTH = "length"  # max_tokens, maxIterTimes or maxSeqLen reached
    ABORT = "abort"  # cancelled by the client or by its timeout
    # PD, on D: preempted there and sent back to be recomputed by a prefill node (MindIE's retry:);
    # D turns it into a retry record, it never reaches a client.
    RECOMPUTE = "recompute"


def _check(ok: bool, name: str, rule: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name} must be {rule}, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """What to generate and how. Defaults follow vLLM; 0 / -1 mean "off" where noted."""

    max_tokens: int | None = 16  # None: up to maxIterTimes / maxSeqLen
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0  # 1.0: off
    repetition_penalty: float = 1.0  # Hugging Face semantics over prompt + output
    presence_penalty: float = 0.0  # OpenAI semantics over output
    frequency_penalty: float = 0.0
    seed: int | None = None  # None: a random seed, reported back
    do_sample: bool = True  # False: greedy whatever the temperature
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    # (token id, bias) pairs added to the logits before anything else looks at them, as OpenAI's
    # logit_bias: -100 bans a token, +100 all but forces it
    logit_bias: tuple[tuple[int, float], ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop_token_ids cannot be sampled before this many tokens (vLLM's)
    skip_special_tokens: bool = True
    logprobs: int | None = None  # top-N log-probabilities per token, 0..20; None: none
    # Log-probabilities of the prompt's tokens (each given the tokens before it) with top-N, 0..20;
    # None: none. The prompt is then computed in full, never taken from the prefix cache.
    prompt_logprobs: int | None = None
    n: int = 1  # samples returned
    best_of: int | None = None  # samples generated (>= n); the n with the best cumulative logprob return
    # Beam search with width best_of or n, returning the n best hypotheses when the request ends
    # (mindie/sampling/beam.py). It is deterministic: temperature, top_k, top_p, do_sample and
    # seed are ignored; penalties and stop strings, which would change what the search ranks,
    # are refused.
    use_beam_search: bool = False
    length_penalty: float = 1.0  # hypothesis score = sum of logprobs / length ** length_penalty
    early_stopping: bool | str = False  # True, False or "never", as Hugging Face generate()

    def __post_init__(self) -> None:
        _check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
               "max_tokens", "an integer >= 1", self.max_tokens)
        _check(math.isfinite(self.temperature) and self.temperature >= 0, "temperature", "in [0, inf)",
               self.temperature)
        _check(isinstance(self.top_k, int) and self.top_k >= -1, "top_k", "-1, 0 (off) or >= 1", self.top_k)
        _check(0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        _check(math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
               "in (0, inf)", self.repetition_penalty)
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", "in [-2, 2]", self.presence_penalty)
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "in [-2, 2]", self.frequency_penalty)
        _check(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed <= SEED_MAX), "seed",
               "in [0, 2^64-1]", self.seed)
        _check(self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS, "logprobs",
               f"in [0, {MAX_TOP_LOGPROBS}]", self.logprobs)
        _check(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS, "prompt_logprobs",
               f"in [0, {MAX_TOP_LOGPROBS}]", self.prompt_logprobs)
        _check(len(self.stop) <= MAX_STOP_STRINGS and all(isinstance(s, str) and s for s in self.stop)
               and sum(len(s) for s in self.stop) <= MAX_STOP_CHARS_TOTAL,
               "stop", f"at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_CHARS_TOTAL} "
               "characters in all", self.stop if len(self.stop) <= 4 and sum(map(len, self.stop)) <= 200
               else f"{len(self.stop)} strings of {sum(map(len, self.stop))} characters")
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS and all(
            isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} non-negative integers",
            self.stop_token_ids if len(self.stop_token_ids) <= 8 else f"{len(self.stop_token_ids)} ids")
        _check(all(isinstance(t, int) and t >= 0 and isinstance(b, (int, float)) and -100 <= b <= 100
                   for t, b in self.logit_bias) and len({t for t, _ in self.logit_bias}) == len(self.logit_bias),
               "logit_bias", "distinct non-negative token ids, each with a bias in [-100, 100]",
               self.logit_bias if len(self.logit_bias) <= 8 else f"{len(self.logit_bias)} entries")
        _check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens and (
            self.max_tokens is None or self.min_tokens <= self.max_tokens), "min_tokens",
            f"in [0, max_tokens={self.max_tokens}]", self.min_tokens)
        _check(isinstance(self.n, int) and 1 <= self.n <= MAX_N, "n", f"in [1, {MAX_N}]", self.n)
        _check(self.best_of is None or (isinstance(self.best_of, int) and self.n <= self.best_of <= MAX_N),
               "best_of", f"in [n={self.n}, {MAX_N}]", self.best_of)
        _check(isinstance(self.use_beam_search, bool), "use_beam_search", "true or false", self.use_beam_search)
        _check(isinstance(self.length_penalty, (int, float)) and not isinstance(self.length_penalty, bool)
               and math.isfinite(self.length_penalty),
               "length_penalty", "a finite number", self.length_penalty)
        _check(isinstance(self.early_stopping, bool) or self.early_stopping == "never", "early_stopping",
               'true, false or "never"', self.early_stopping)
        if self.use_beam_search:
            for name, neutral in (("repetition_penalty", 1.0), ("presence_penalty", 0.0),
                                  ("frequency_penalty", 0.0)):
                _check(getattr(self, name) == neutral, name, f"{neutral} with use_beam_search", getattr(self, name))
            _check(self.prompt_logprobs is None, "prompt_logprobs", "unset with use_beam_search", self.prompt_logprobs)
            _check(not self.stop, "stop", "empty with use_beam_search", self.stop)
            _check(not self.logit_bias, "logit_bias", "empty with use_beam_search", self.logit_bias)
            _check(self.min_tokens == 0, "min_tokens", "0 with use_beam_search", self.min_tokens)

    @property
    def num_samples(self) -> int:
        """Sequences generated for the request: best_of, or n."""
        return self.best_of or self.n

    @property
    def num_outputs(self) -> int:
        """Samples that produce outputs: every one generated, or a beam search's n best."""
        return self.n if self.use_beam_search else self.num_samples

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0


@dataclass(frozen=True)
class Continuation:
    """Outputs a request already produced elsewhere, which the engine continues after as if it had
    produced them itself (PD: D going on from P's first token, P recomputing what a D sent back):
    the detokenizer, stop strings, grammar and penalties see them, max_tokens counts them, and the
    seeded sampler, which draws by (seed, tokens so far), makes the same draws from there on."""

    output_token_ids: list[int]
    seed: int
    cumulative_logprob: float


@dataclass(frozen=True)
class MediaItem:
    """One image (or clip) of a prompt: its placeholder tokens are prompt positions
    [offset, offset + num_tokens), whose embeddings the model's encoder output replaces."""

    kind: str  # "image" or "video"
    offset: int
    num_tokens: int
    # sha256 of the preprocessed content: the prefix cache keys these tokens by it (Sequence.cache_keys)
    content_hash: bytes
    data: Any  # the model's preprocessed input (qwen2_vl_processor.VisualInput); None once encoded


@dataclass
class MediaInputs:
    """A prompt's media, one description for every model family that reads them."""

    items: tuple[MediaItem, ...]
    # Multimodal rotary (Qwen2-VL's M-RoPE): int64 [3, prompt tokens] (t, h, w) positions; a
    # generated token at index i sits at i + rope_delta on all three axes. None: 1-D positions.
    positions: Any = None
    rope_delta: int = 0
    # Encoder outputs by item index, filled the first time a step computes the item's tokens and
    # kept with the request, so recompute after preemption and sibling samples never re-encode.
    embeddings: dict[int, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(item.num_tokens for item in self.items)

    def handover_json(self) -> dict[str, Any]:
        """What a decode node needs of these media (PD): where their tokens are, their content
        hashes (its prefix-cache keys) and the rotary delta of generated tokens. No pixels, no
        prompt positions: a decode node computes generated tokens only."""
        return {"ropeDelta": self.rope_delta,
                "items": [[i.kind, i.offset, i.num_tokens, i.content_hash.hex()] for i in self.items]}

    @staticmethod
    def from_handover_json(raw: Any) -> MediaInputs:
        """ValueError if `raw` is not what handover_json writes."""
        try:
            items = tuple(MediaItem(str(kind), int(offset), int(n), bytes.fromhex(digest), None)
                          for kind, offset, n, digest in raw["items"])
            return MediaInputs(items, None, int(raw["ropeDelta"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"media: {exc}") from None


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 5  # 1 (first) .. 5, as MindIE
    arrival_time: float = field(default_factory=time.monotonic)
    prompt_text: str | None = None
    # What every sample's output must follow (a compiled mindie.structured Grammar): the sampler
    # masks each step's logits to the tokens it allows, and the sample ends when it is complete.
    grammar: Grammar | None = None
    # Prefill/decode disaggregation, on P: after the first token the engine stops the request and
    # keeps its prompt's KV blocks pinned under a lease (`RequestOutput.kv`) for D to pull.
    handoff: bool = False
    continuation: Continuation | None = None
    # PD, on D: a preempted sequence is not recomputed here (that is a prefill node's work) but
    # ends with FinishReason.RECOMPUTE, for the coordinator to send back to a prefill node.
    recompute_elsewhere: bool = False
    # A test hook (a decode node's MINDIE_PD_PREEMPT_AT): with recompute_elsewhere, the sequence
    # is preempted as soon as it has this many outputs, as if the KV cache had run short.
    preempt_at: int | None = None
    media: MediaInputs | None = None  # images in the prompt; None for text

    def __post_init__(self) -> None:
        _check(1 <= self.priority <= 5, "priority", "in [1, 5]", self.priority)
        _check(len(self.prompt_token_ids) > 0, "prompt", "non-empty", "")


@dataclass(frozen=True)
class KVExport:
    """A handed-off request's KV on P: `block_ids` hold positions [0, num_tokens) in order and stay
    pinned under `lease_id` until the engine is told to release it."""

    lease_id: str
    block_ids: list[int]
    num_tokens: int


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # top-N (id, logprob), best first; empty unless asked


@dataclass
class RequestOutput:
    """What one step produced for one sample of a request (the deltas), plus its running totals.
    A request with best_of = k has samples 0..k-1; `request_done` marks the output after which
    no sample of the request produces anything more."""

    request_id: str
    index: int
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprob]
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    cumulative_logprob: float
    seed: int
    # One entry per token of new_token_ids (MindIE usage.batch_size / queue_wait_time): the size
    # of the step that computed the token, and the token's own wait, from the sample being ready
    # for it (arrival, or its previous token) to the start of that step.
    batch_sizes: list[int]
    queue_waits_s: list[float]
    first_token_latency_s: float | None  # set on the output that carries the first token
    num_cached_prompt_tokens: int = 0
    request_done: bool = False
    # On sample 0's first output when asked for: one entry per prompt token, None for the first
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Beam search only: the hypothesis' rank score, cumulative_logprob (the plain sum of its
    # token log-probabilities) / num_output_tokens ** length_penalty, as Hugging Face reports it
    # in sequences_scores. A beam request's outputs come at its end, one per hypothesis, best
    # first, each with all its tokens and text.
    beam_score: float | None = None
    # A handoff request's last output on P: no finish reason, request_done set, and its KV here.
    kv: KVExport | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
