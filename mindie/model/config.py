"""The shape of a Llama-family decoder, read from a model's own metadata."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "qwen3moe", "gemma3", "phi3")


def every_layer_window(window: int | None, num_layers: int) -> dict[str, Any]:
    """ModelConfig's window fields for a family whose every layer slides once it has a window
    (Mistral, Mixtral, Phi-3: transformers masks each layer with config.sliding_window); 0 or None:
    every layer global."""
    window = int(window or 0)
    return dict(sliding_window=window, sliding_layers=(True,) * num_layers if window else ())


@dataclass(frozen=True)
class LongRope:
    """Phi-3's LongRoPE (transformers' `longrope`): each rotary frequency divided by its short factor
    at positions below original_max, by its long factor from there on, and cos/sin times
    attention_factor everywhere (see mindie.model.llama.rope_cos_sin for how positions choose)."""
    short_factor: tuple[float, ...]  # one per rotary frequency (rotary_dim / 2)
    long_factor: tuple[float, ...]
    original_max: int  # original_max_position_embeddings
    attention_factor: float


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # llama (Mixtral too) | mistral | qwen2 | qwen3 | qwen3moe | gemma3 | phi3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 has biases on the q/k/v projections
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Qwen2-VL's multimodal rotary: how many of the head_dim / 2 frequencies follow the (t, h, w)
    # position each; () for 1-D rotary
    mrope_section: tuple[int, ...] = ()
    # Qwen3: an RMSNorm over each q and k head (weights q_norm / k_norm [head_dim]) between the
    # projection and rotary
    qk_norm: bool = False
    # Mixture of experts (Qwen3-MoE, Mixtral; 0 experts: every MLP is dense): a layer's MLP is
    # num_experts experts of moe_intermediate_size, each row running its num_experts_per_tok most
    # probable ones, their weights renormalised to sum to 1 with norm_topk_prob. Layers in
    # mlp_only_layers, or whose index + 1 is not a multiple of decoder_sparse_step, keep a dense MLP
    # of intermediate_size (Qwen3-MoE's knobs, as transformers reads them).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # Gemma 3. The MLP gate's activation: silu, or gelu_tanh (GeGLU, transformers' gelu_pytorch_tanh).
    hidden_act: str = "silu"
    embed_scale: float = 1.0  # token embeddings are multiplied by it (Gemma: sqrt(hidden_size))
    # RMSNorms on the attention and MLP outputs before each residual add, beside the usual pre-norms
    sandwich_norms: bool = False
    # The attention scale is query_pre_attn_scalar ** -0.5 (Gemma); None: head_dim ** -0.5
    query_pre_attn_scalar: float | None = None
    # Layers with sliding_layers[i] true see the last sliding_window keys only (0 or (): none do)
    sliding_window: int = 0
    sliding_layers: tuple[bool, ...] = ()
    rope_local_theta: float | None = None  # the sliding layers' rotary base; None: rope_theta
    rope_linear_factor: float = 1.0  # linear rotary scaling of the global layers (positions / factor)
    # Soft-capping: x -> cap * tanh(x / cap) on the final logits and on attention scores; 0: off
    final_logit_softcap: float = 0.0
    attn_logit_softcap: float = 0.0
    # Phi-3 / Phi-4-mini. Partial rotary: only the first rotary_dim dimensions of each head rotate
    # (head_dim * partial_rotary_factor); 0: all of them.
    partial_rotary_dim: int = 0
    longrope: LongRope | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"hidden activation {self.hidden_act!r} is not supported (silu, gelu_tanh)")
        if self.sliding_layers and len(self.sliding_layers) != self.num_layers:
            raise ValueError(f"{len(self.sliding_layers)} layer types for {self.num_layers} layers")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"rotary dimensions {self.rotary_dim} must be even and in (0, head_dim {self.head_dim}]")
        if self.longrope and not (len(self.longrope.short_factor) == len(self.longrope.long_factor)
                                  == self.rotary_dim // 2):
            raise ValueError(f"LongRoPE needs {self.rotary_dim // 2} short and long factors")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    def is_moe_layer(self, layer: int) -> bool:
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def rotary_dim(self) -> int:
        """How many leading dimensions of each q/k head rotate."""
        return self.partial_rotary_dim or self.head_dim

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_window(self, layer: int) -> int:
        """The sliding window of a layer; 0 for a global one."""
        return self.sliding_window if self.sliding_layers and self.sliding_layers[layer] else 0

    @property
    def kv_window(self) -> int:
        """The window every layer attends within (Phi-3), 0 where some layer is global (Gemma 3's
        every sixth) or none slides: only then are a sequence's keys before it dead in every layer,
        with one block table shared by all of them."""
        return self.sliding_window if self.sliding_layers and all(self.sliding_layers) else 0

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim
