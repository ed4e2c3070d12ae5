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
) -> None: ...
