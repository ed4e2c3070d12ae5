# Typed stub of the compiled extension. Tensor arguments accept anything with __dlpack__ on the CPU.
from typing import Any

Tensor = Any

# --- runtime ---
def set_num_threads(num_threads: int) -> None: ...
def get_num_threads() -> int: ...
def available_isas() -> list[str]: ...
def get_isa() -> str: ...
def set_isa(name: str) -> None: ...

# --- KV cache ---
def reshape_and_cache(
    key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor
) -> None: ...
def copy_blocks(src_cache: Tensor, dst_cache: Tensor, block_mapping: Tensor) -> None: ...

# --- attention ---
def paged_attention(
    out: Tensor,
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_tables: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    scale: float,
    partition_size: int = 0,
    window: int = 0,
    softcap: float = 0.0,
) -> None: ...

# --- layers ---
def rms_norm(out: Tensor, x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> None: ...
def head_rms_norm(x: Tensor, weight: Tensor, eps: float) -> None: ...
def rotary_embedding(
    positions: Tensor, query: Tensor, key: Tensor, cos_sin_cache: Tensor, neox: bool = True
) -> None: ...
def silu_and_mul(out: Tensor, x: Tensor) -> None: ...
def moe_route(weights: Tensor, experts: Tensor, logits: Tensor, normalize: bool) -> None: ...
def moe_combine(out: Tensor, y: Tensor, weights: Tensor, experts: Tensor) -> None: ...
def gelu_tanh_and_mul(out: Tensor, x: Tensor) -> None: ...
def linear(out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> None: ...

# --- encoder layers ---
def layer_norm(
    out: Tensor, x: Tensor, weight: Tensor, bias: Tensor, eps: float, residual: Tensor | None = None
) -> None: ...
def gelu_tanh(out: Tensor, x: Tensor) -> None: ...

# --- sampling ---
MAX_TOP_LOGPROBS: int

def sample(
    out_tokens: Tensor,
    out_logprobs: Tensor,
    out_top_logprobs: Tensor,
    out_top_ids: Tensor,
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    seed: Tensor,
    step: Tensor,
    repetition_penalty: Tensor | None,
    presence_penalty: Tensor | None,
    frequency_penalty: Tensor | None,
    prompt_tokens: Tensor | None,
    prompt_offsets: Tensor | None,
    output_tokens: Tensor | None,
    output_offsets: Tensor | None,
    num_logprobs: int,
) -> None: ...

# --- beam search ---
def beam_search_step(
    logprobs: Tensor,
    beam_scores: Tensor,
    eos_token_ids: Tensor,
    cur_len: int,
    length_penalty: float,
    early_stopping: bool | str,
    max_len: int,
    pad_token_id: int,
    hyp_scores: Tensor,
    hyp_order: Tensor,
    num_hyps: Tensor,
    worst_score: Tensor,
    done: Tensor,
    next_parents: Tensor,
    next_tokens: Tensor,
    next_scores: Tensor,
    fin_parents: Tensor,
    fin_tokens: Tensor,
    fin_logprobs: Tensor,
    fin_scores: Tensor,
    fin_slots: Tensor,
    fin_count: Tensor,
) -> None: ...

# --- constrained decoding ---
def apply_token_bitmask(logits: Tensor, bitmask: Tensor, mask_index: Tensor) -> None: ...
