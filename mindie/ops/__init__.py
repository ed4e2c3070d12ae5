"""Typed wrappers over ``mindie._C``: they allocate outputs and call the kernels, nothing else.

Tensors are torch CPU tensors; the kernels read and write their memory in place through DLPack.
One module per kernel family (attention and the KV cache, layers, encoder layers, quantized weights,
sampling); callers use them through this package, as ``ops.paged_attention``.
"""

from mindie.ops.attention import copy_blocks, paged_attention, reshape_and_cache
from mindie.ops.encoder import gelu_tanh_, layer_norm
from mindie.ops.layers import gelu_tanh_and_mul, head_rms_norm, linear, rms_norm, rotary_embedding, silu_and_mul
from mindie.ops.memory import kv_caches_on_huge_pages
from mindie.ops.moe import moe_combine, moe_route
from mindie.ops.quant import (
    dequantize,
    pack_panels,
    qmatmul,
    qmatmul_batch,
    qmatmul_bf16,
    qmatmul_group,
    quantize_activations,
    round_to_bf16,
)
from mindie.ops.sampling import (
    BeamSearchState,
    BeamStepOutput,
    SampleOutput,
    apply_token_bitmask,
    beam_search_step,
    sample,
)

__all__ = [
    "copy_blocks",
    "paged_attention",
    "reshape_and_cache",
    "head_rms_norm",
    "linear",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "gelu_tanh_and_mul",
    "gelu_tanh_",
    "layer_norm",
    "moe_combine",
    "moe_route",
    "dequantize",
    "pack_panels",
    "qmatmul",
    "qmatmul_bf16",
    "qmatmul_batch",
    "qmatmul_group",
    "quantize_activations",
    "round_to_bf16",
    "BeamSearchState",
    "BeamStepOutput",
    "SampleOutput",
    "apply_token_bitmask",
    "beam_search_step",
    "sample",
    "kv_caches_on_huge_pages",
]
