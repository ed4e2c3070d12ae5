"""Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2, Qwen3, Gemma 3, Phi-3, and the MoE ones:
Qwen3-MoE, Mixtral) over a paged KV cache.

One forward pass takes a flattened batch: the new tokens of every sequence back to back, with
their positions, cache slots and block tables (`AttentionMetadata`). Prefill chunks and decode
tokens mix freely; nothing is padded. Dense projections run in torch; rotary, cache writes,
attention, RMSNorm and the gated activation run in `mindie.ops`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mindie import ops
from mindie.model.config import ModelConfig
from mindie.model.hf_dir import take_weight
from mindie.model.moe import MoeWeights, expert_name, moe_mlp, router_name


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # int64 [tokens]
    slot_mapping: torch.Tensor  # int64 [tokens]; block * block_size + offset
    block_tables: torch.Tensor  # int32 [seqs, max_blocks]
    query_start_loc: torch.Tensor  # int32 [seqs + 1]
    seq_lens: torch.Tensor  # int32 [seqs]; cached tokens after this step
    logits_indices: torch.Tensor  # int64 [rows]; token rows whose next-token logits are wanted
    # int32 [seqs]: a row at a position below its sequence's entry is a prompt token, which the C++ step
    # may compute in bf16 (QuantizedLlamaModel); None: every row is a generated token.
    prompt_lens: torch.Tensor | None = None
    # Media (mindie.engine.media_step): these rows take these embeddings instead of their tokens'
    # (an image's encoder output at its placeholder tokens) ...
    media_rows: torch.Tensor | None = None  # int64 [k]
    media_embeds: torch.Tensor | None = None  # [k, hidden]
    # ... and each row's own rotary cos/sin [tokens, head_dim] (multimodal rotary positions) in
    # place of the table row at its position. None: `positions` index the model's table.
    rope_cos_sin: torch.Tensor | None = None


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [q_size + 2 * kv_size, hidden]
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # [head_dim] (Qwen3); None: no per-head q/k norm
    k_norm: torch.Tensor | None
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor | None  # [2 * intermediate, hidden]; None in an MoE layer
    down: torch.Tensor | None
    cos_sin: torch.Tensor  # this layer's rotary table (Gemma 3's sliding layers have their own)
    window: int = 0  # sliding window; 0: global attention
    post_attn_norm: torch.Tensor | None = None  # sandwich norms (Gemma 3); None: none
    post_ffn_norm: torch.Tensor | None = None
    moe: MoeWeights | None = None  # an MoE layer's router and experts


# Up to this many token rows, bf16 projections use ops.linear (streams the weight at memory speed);
# above it torch's GEMM, which is compute-bound and fast there.
SMALL_BATCH_ROWS = 8


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if x.shape[0] <= SMALL_BATCH_ROWS and weight.dtype == torch.bfloat16:
        return ops.linear(x, weight, bias)
    return F.linear(x, weight, bias)


def rope_cos_sin(config: ModelConfig, max_position: int, theta: float | None = None,
                 linear_factor: float = 1.0) -> torch.Tensor:
    """[max_position, rotary_dim] float32: cos of each frequency, then sin (Hugging Face values).
    `theta` (default: the config's rope_theta) and linear scaling, which divides the frequencies.

    LongRoPE (Phi-3): row p takes the short factors below original_max and the long ones from there
    on, both times attention_factor. transformers chooses per forward call by its largest position,
    so one token at a time (its forward with a KV cache) gives exactly these rows: a sequence's keys
    at positions below original_max keep their short rotation. Its one-call prefill of a longer prompt,
    and generate(), which recomputes the cache once the sequence grows past original_max, rotate every
    position by the long factors instead; a table per position keeps a row independent of its
    sequence's length and of its batch (vLLM picks long for a whole batch once any row is past it)."""
    d = config.rotary_dim
    exponents = torch.arange(0, d, 2, dtype=torch.int64).float() / d
    base = (theta or config.rope_theta) ** exponents
    positions = torch.arange(max_position, dtype=torch.int64).float()
    lr = config.longrope
    if lr is None:
        freqs = torch.outer(positions, 1.0 / base / linear_factor)
        return torch.cat([freqs.cos(), freqs.sin()], dim=-1).contiguous()
    # transformers' order of operations: 1 / (factor * base ** exponent)
    short = 1.0 / (torch.tensor(lr.short_factor, dtype=torch.float32) * base)
    long = 1.0 / (torch.tensor(lr.long_factor, dtype=torch.float32) * base)
    freqs = torch.where((positions < lr.original_max)[:, None], torch.outer(positions, short),
                        torch.outer(positions, long))
    return torch.cat([freqs.cos() * lr.attention_factor, freqs.sin() * lr.attention_factor], dim=-1).contiguous()


def layer_rope_tables(config: ModelConfig) -> list[torch.Tensor]:
    """Each layer's rotary table: the global one (rope_theta, linear scaling), or on Gemma 3's sliding
    layers the local one (rope_local_theta, unscaled); layers share the tensors."""
    full = rope_cos_sin(config, config.max_position, linear_factor=config.rope_linear_factor)
    if config.rope_local_theta is None:
        return [full] * config.num_layers
    local = rope_cos_sin(config, config.max_position, config.rope_local_theta)
    return [local if config.layer_window(i) else full for i in range(config.num_layers)]


def norm_names(config: ModelConfig) -> dict[str, str]:
    """A layer's norm slots -> their checkpoint names under model.layers.N. `post_norm` is the MLP's
    pre-norm: Llama calls it post_attention_layernorm, while Gemma's sandwich layers give that name
    to the norm of the attention output and call the MLP's pre_feedforward_layernorm."""
    if not config.sandwich_norms:
        return {"input_norm": "input_layernorm", "post_norm": "post_attention_layernorm"}
    return {"input_norm": "input_layernorm", "post_norm": "pre_feedforward_layernorm",
            "post_attn_norm": "post_attention_layernorm", "post_ffn_norm": "post_feedforward_layernorm"}


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dtype must be float32 or bfloat16, got {dtype}")
        self.config = config
        self.dtype = dtype
        self.kv_dtype = dtype

        def take(name: str) -> torch.Tensor:
            return take_weight(weights, name, dtype)

        self.embed = take("model.embed_tokens.weight")
        self.lm_head = self.embed if config.tie_word_embeddings else take("lm_head.weight")
        self.final_norm = take("model.norm.weight")
        self.layers: list[_Layer] = []
        tables = layer_rope_tables(config)
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            attn = p + "self_attn."
            bias = None
            if config.qkv_bias:
                bias = torch.cat([take(attn + f"{n}_proj.bias") for n in "qkv"]).contiguous()
            moe = config.is_moe_layer(i)
            norms = {slot: take(p + name + ".weight") for slot, name in norm_names(config).items()}
            self.layers.append(
                _Layer(
                    qkv=torch.cat([take(attn + f"{n}_proj.weight") for n in "qkv"]).contiguous(),
                    qkv_bias=bias,
                    q_norm=take(attn + "q_norm.weight") if config.qk_norm else None,
                    k_norm=take(attn + "k_norm.weight") if config.qk_norm else None,
                    o_proj=take(attn + "o_proj.weight"),
                    gate_up=None if moe else torch.cat([take(p + "mlp.gate_proj.weight"),
                                                        take(p + "mlp.up_proj.weight")]).contiguous(),
                    down=None if moe else take(p + "mlp.down_proj.weight"),
                    moe=MoeWeights(
                        router=take(router_name(i)),
                        gate_up=torch.stack([
                            torch.cat([take(expert_name(i, e, "gate_proj")), take(expert_name(i, e, "up_proj"))])
                            for e in range(config.num_experts)]),
                        down=torch.stack([take(expert_name(i, e, "down_proj")) for e in range(config.num_experts)]),
                    ) if moe else None,
                    cos_sin=tables[i],
                    window=config.layer_window(i),
                    **norms,
                )
            )
        self.scale = config.attn_scale
        # transformers scales the embedding in the weights' dtype
        self.embed_scale = torch.tensor(config.embed_scale, dtype=torch.float32).to(dtype)
        self.activation = ops.gelu_tanh_and_mul if config.hidden_act == "gelu_tanh" else ops.silu_and_mul

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        c = self.config
        shape = (num_blocks, block_size, c.num_kv_heads, c.head_dim)
        return ops.kv_caches_on_huge_pages(len(self.layers), shape, self.dtype)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Returns float32 logits [len(meta.logits_indices), vocab]."""
        c = self.config
        tokens = input_ids.shape[0]
        hidden = self.embed.index_select(0, input_ids)
        if c.embed_scale != 1.0:
            hidden.mul_(self.embed_scale)
        if meta.media_rows is not None and meta.media_embeds is not None:
            hidden.index_copy_(0, meta.media_rows, meta.media_embeds.to(self.dtype))
        positions, rows_cos_sin = meta.positions, None
        if meta.rope_cos_sin is not None:  # row i rotates by its own table row i
            positions, rows_cos_sin = torch.arange(tokens, dtype=torch.int64), meta.rope_cos_sin
        residual: torch.Tensor | None = None
        attn_out = torch.empty(tokens, c.num_heads, c.head_dim, dtype=self.dtype)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            if residual is None:
                residual = hidden
                x = ops.rms_norm(hidden, layer.input_norm, c.rms_norm_eps)
            else:
                x = ops.rms_norm(hidden, layer.input_norm, c.rms_norm_eps, residual=residual)
            qkv = linear(x, layer.qkv, layer.qkv_bias)
            q = qkv[:, : c.q_size].view(tokens, c.num_heads, c.head_dim)
            k = qkv[:, c.q_size : c.q_size + c.kv_size].view(tokens, c.num_kv_heads, c.head_dim)
            v = qkv[:, c.q_size + c.kv_size :].view(tokens, c.num_kv_heads, c.head_dim)
            if layer.q_norm is not None and layer.k_norm is not None:
                ops.head_rms_norm(q, layer.q_norm, c.rms_norm_eps)
                ops.head_rms_norm(k, layer.k_norm, c.rms_norm_eps)
            ops.rotary_embedding(positions, q, k, layer.cos_sin if rows_cos_sin is None else rows_cos_sin)
            ops.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
            ops.paged_attention(
                q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, self.scale, out=attn_out,
                window=layer.window, softcap=c.attn_logit_softcap,
            )
            hidden = linear(attn_out.view(tokens, c.q_size), layer.o_proj)
            if layer.post_attn_norm is not None:
                hidden = ops.rms_norm(hidden, layer.post_attn_norm, c.rms_norm_eps)
            x = ops.rms_norm(hidden, layer.post_norm, c.rms_norm_eps, residual=residual)
            if layer.moe is not None:
                hidden = moe_mlp(x, layer.moe, c.num_experts_per_tok, c.norm_topk_prob)
            else:
                assert layer.gate_up is not None and layer.down is not None
                hidden = linear(self.activation(linear(x, layer.gate_up)), layer.down)
            if layer.post_ffn_norm is not None:
                hidden = ops.rms_norm(hidden, layer.post_ffn_norm, c.rms_norm_eps)
        assert residual is not None
        rows = meta.logits_indices
        final = ops.rms_norm(hidden.index_select(0, rows), self.final_norm, c.rms_norm_eps,
                             residual=residual.index_select(0, rows))
        logits = linear(final, self.lm_head).float()
        if c.final_logit_softcap:
            logits = torch.tanh(logits / c.final_logit_softcap) * c.final_logit_softcap
        return logits
