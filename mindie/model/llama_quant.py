"""The Llama-family decoder over weights kept in their ggml formats, one C++ call per step.

Same interface as `LlamaModel` (allocate_kv_cache, forward over AttentionMetadata), but the whole
layer loop runs in `_C.LlamaForward`: int8 activations against the quantized weights (two planes, or
one with activation_bits=8; bf16 ones for prompt rows when the dtype is bfloat16 and the CPU's bf16
dot products are the faster form, see `prompt_rows_in_bf16`), float32 everywhere
else, and a KV cache in `kv_dtype`. A row's path depends only on that row, so its logits do not
depend on the rest of the batch.
"""

from __future__ import annotations

import functools
import os
from collections import Counter

import torch

from mindie import _C, ops
from mindie.model.config import ModelConfig
from mindie.model.llama import AttentionMetadata, layer_rope_tables, norm_names
from mindie.model.moe import EXPERT_PROJECTIONS, expert_name, router_name
from mindie.model.quantized import QuantizedWeight

# The int8 form's prompt tile makes one int16 product per weight and value (its planes as one int16,
# vpdpwssd or vpmaddwd), so it wins on products per second where its instruction runs more of them
# than vdpbf16ps; the margin keeps CPUs where the two are even (AMD Zen 4/5: 32 pairs a vector
# either way) on the bf16 form whatever the noise of the measurement.
_INT8_MARGIN = 1.5


def int8_prompt_instruction(planes: int, vnni: bool = True) -> str:
    """The dot-product instruction the active kernel variant's int8 prompt tile multiplies with, for
    rows of `planes` planes (vnni=False: as after _C.set_vnni(False)). One plane takes a byte tile, a
    byte product per weight (vpdpbusd with VNNI, else vpmaddubsw); two planes one int16 product per
    weight (128 * hi + lo as one value)."""
    feature = {"avx512": "avx512_vnni", "avx2": "avx_vnni"}.get(_C.get_isa())
    has_vnni = vnni and feature is not None and _C.cpu_features()[feature]
    if planes == 1 and feature is not None:
        return "vpdpbusd" if has_vnni else "vpmaddubsw"
    return "vpdpwssd" if has_vnni else "vpmaddwd"


@functools.cache
def prompt_rows_in_bf16(planes: int = 2) -> bool:
    """Whether prompt rows take the bf16 form (with the bfloat16 dtype): where the active kernels have
    native bf16 dot products and those are the faster of the two forms here, the int8 form's rows
    quantized with `planes` planes. On an Intel Sapphire Rapids core vdpbf16ps runs about one every
    two cycles against two vpdpbusd, but its AMX tiles (tdpbf16ps) do 8 times the int8 form's
    products; on AMD Zen 4/5 vdpbf16ps and vpdpbusd are even and bf16 stays against two planes. One
    plane takes one byte product per weight on AVX-512 VNNI (the byte tile, vpdpbusd), twice the
    int16 products of two. Measured once (tens of ms) with the register-only loops of _C.dot_peak;
    MINDIE_PROMPT_FORM=bf16|int8 decides instead."""
    forced = os.environ.get("MINDIE_PROMPT_FORM", "")
    if forced not in ("", "bf16", "int8"):
        raise ValueError(f"MINDIE_PROMPT_FORM must be bf16 or int8, got {forced!r}")
    if not _C.qmatmul_bf16_native() or forced:
        return _C.qmatmul_bf16_native() and forced != "int8"
    # Each form's peak as its kernels run here: dot_peak gives 0.0 for VNNI and AMX tiles where the kernels
    # do not use them (set_vnni(False), set_amx(False)), and then the instruction they run instead counts.
    int8_peak = (_C.dot_peak(int8_prompt_instruction(planes), 1, 0.03)
                 or _C.dot_peak(int8_prompt_instruction(planes, vnni=False), 1, 0.03))
    bf16_peak = _C.dot_peak("tdpbf16ps", 1, 0.03) or _C.dot_peak("vdpbf16ps", 1, 0.03)
    return int8_peak < _INT8_MARGIN * bf16_peak


# --activation-bits: 16, two int8 planes (about 15 bits; generated tokens keep float32's top-1), or 8,
# one plane as llama.cpp quantizes activations (half the byte products).
ACTIVATION_PLANES = {16: 2, 8: 1}


def activation_planes(activation_bits: int) -> int:
    """The int8 planes a row is quantized into for `activation_bits`; ValueError for other bits."""
    if activation_bits not in ACTIVATION_PLANES:
        raise ValueError(f"activation_bits must be one of {sorted(ACTIVATION_PLANES)}, got {activation_bits!r}")
    return ACTIVATION_PLANES[activation_bits]


class QuantizedLlamaModel:
    def __init__(self, config: ModelConfig, matrices: dict[str, QuantizedWeight],
                 vectors: dict[str, torch.Tensor], kv_dtype: torch.dtype, activation_bits: int = 16) -> None:
        if kv_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dtype must be float32 or bfloat16, got {kv_dtype}")
        self.config = config
        self.dtype = kv_dtype
        self.kv_dtype = kv_dtype
        self.activation_planes = activation_planes(activation_bits)

        def matrix(name: str) -> QuantizedWeight:
            if name not in matrices:
                raise KeyError(f"weight {name!r} missing from the checkpoint")
            return matrices[name]

        def vector(name: str) -> torch.Tensor | None:
            v = vectors.get(name)
            return None if v is None else v.float().contiguous()

        self.embed = matrix("model.embed_tokens.weight")
        self.lm_head = self.embed if config.tie_word_embeddings else matrix("lm_head.weight")
        self.matrices = {"model.embed_tokens.weight": self.embed, "lm_head.weight": self.lm_head}
        self._layers: list[dict[str, object]] = []
        tables = layer_rope_tables(config)
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            layer: dict[str, object] = {slot: vector(p + name + ".weight") for slot, name in norm_names(config).items()}
            layer["cos_sin"] = tables[i]
            layer["window"] = config.layer_window(i)
            moe = config.is_moe_layer(i)
            for key, name in (("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"), ("v", "self_attn.v_proj"),
                              ("o", "self_attn.o_proj"), ("gate", "mlp.gate_proj"), ("up", "mlp.up_proj"),
                              ("down", "mlp.down_proj")):
                if moe and name.startswith("mlp."):
                    continue
                w = matrix(p + name + ".weight")
                self.matrices[p + name + ".weight"] = w
                layer[key] = w.spec()
            if moe:  # the router, then per expert (gate, up, down): see _C.LlamaForward
                for name in [router_name(i)] + [expert_name(i, e, n) for e in range(config.num_experts)
                                                for n in EXPERT_PROJECTIONS]:
                    self.matrices[name] = matrix(name)
                layer["router"] = self.matrices[router_name(i)].spec()
                layer["experts"] = [tuple(self.matrices[expert_name(i, e, n)].spec() for n in EXPERT_PROJECTIONS)
                                    for e in range(config.num_experts)]
            for key in "qkv":
                layer[f"{key}_bias"] = vector(p + f"self_attn.{key}_proj.bias") if config.qkv_bias else None
            for key in ("q_norm", "k_norm"):
                layer[key] = vector(p + f"self_attn.{key}.weight") if config.qk_norm else None
            self._layers.append(layer)
        final_norm = vector("model.norm.weight")
        norm_keys = (*norm_names(config), *(("q_norm", "k_norm") if config.qk_norm else ()))
        norms = [layer[k] for layer in self._layers for k in norm_keys]
        if final_norm is None or any(n is None for n in norms):
            raise KeyError("norm weights missing from the checkpoint")
        self._final_norm = final_norm
        self._cos_sin = tables[0]  # the step's default table; every layer names its own as well
        self._step: _C.LlamaForward | None = None
        self._caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def bf16_prompts(self) -> bool:
        """Whether prompt rows enter the projections as bf16 (else as int8, as generated rows do)."""
        return self.kv_dtype == torch.bfloat16 and prompt_rows_in_bf16(self.activation_planes)

    @property
    def weight_formats(self) -> dict[str, int]:
        """Format name -> number of matrices in it (start-up log)."""
        return dict(Counter(w.format_name for w in {id(w): w for w in self.matrices.values()}.values()))

    @property
    def weight_bytes(self) -> int:
        unique = {id(w): w for w in self.matrices.values()}.values()
        return sum(w.nbytes for w in unique) + sum(
            t.numel() * 4 for layer in self._layers for k, t in layer.items()
            if k != "cos_sin" and isinstance(t, torch.Tensor))

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        c = self.config
        shape = (num_blocks, block_size, c.num_kv_heads, c.head_dim)
        caches = ops.kv_caches_on_huge_pages(c.num_layers, shape, self.kv_dtype)
        dims = {
            "hidden": c.hidden_size, "intermediate": c.intermediate_size, "vocab": c.vocab_size,
            "heads": c.num_heads, "kv_heads": c.num_kv_heads, "head_dim": c.head_dim, "eps": c.rms_norm_eps,
            "attn_scale": c.attn_scale, "block_size": block_size, "cos_sin": self._cos_sin,
            "gelu": c.hidden_act == "gelu_tanh", "embed_scale": c.embed_scale,
            "attn_softcap": c.attn_logit_softcap, "final_softcap": c.final_logit_softcap,
            "kv_dtype": "bfloat16" if self.kv_dtype == torch.bfloat16 else "float32",
            "bf16_prompts": self.bf16_prompts, "activation_planes": self.activation_planes,
            "expert_intermediate": c.moe_intermediate_size, "experts_per_tok": c.num_experts_per_tok,
            "norm_topk_prob": c.norm_topk_prob,
        }
        step = _C.LlamaForward(dims, self._layers, self.embed.spec(), self.lm_head.spec(), self._final_norm)
        step.set_kv_caches([k for k, _ in caches], [v for _, v in caches])
        self._step, self._caches = step, caches
        return caches

    def last_step_experts(self) -> list[list[int]]:
        """Per layer, the experts (ascending ids) the last forward ran; empty for dense layers."""
        if self._step is None:
            raise ValueError("no step has run: allocate_kv_cache first")
        return self._step.last_step_experts()

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Returns float32 logits [len(meta.logits_indices), vocab]."""
        if self._step is None or kv_caches is not self._caches:
            raise ValueError("forward needs the KV caches this model allocated (allocate_kv_cache)")
        logits = torch.empty(meta.logits_indices.shape[0], self.config.vocab_size, dtype=torch.float32)
        embeds = None if meta.media_embeds is None else meta.media_embeds.float().contiguous()
        self._step.run(logits, input_ids, meta.positions, meta.slot_mapping, meta.block_tables,
                       meta.query_start_loc, meta.seq_lens, meta.logits_indices, meta.prompt_lens,
                       meta.rope_cos_sin, meta.media_rows, embeds)
        return logits
