"""Reads a GGUF file: model shape, weights under Hugging Face names (float32, or kept in their ggml
format for the quantized path), tokenizer metadata.

llama.cpp's converter permutes the q/k projection rows of Llama-architecture models for its
interleaved rotary layout; they are permuted back here so one model definition (Hugging Face
rotate_half layout) serves GGUF and safetensors weights alike.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mindie.model.config import SUPPORTED_ARCHITECTURES, LongRope, ModelConfig, every_layer_window
from mindie.model.fused import fused_parts, split_fused
from mindie.model.gguf_header import GGUFHeader, read_header
from mindie.model.moe import expert_name
from mindie.model.quantized import GGML_F16, GGML_F32, QUANTIZED_FORMATS, QuantizedWeight, from_gguf_tensor

# What the exact path dequantizes (with the gguf package): every format the quantized path reads.
_SUPPORTED_QUANTS = {"F32", "F16", "BF16", *QUANTIZED_FORMATS.values()}

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",  # the MoE router
}
# MoE experts: one 3-D tensor [experts, rows, cols] per projection, split into one matrix per expert
_EXPERT_NAMES = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj",
                 "ffn_down_exps.weight": "down_proj"}
# Gemma 3's sandwich layers: llama.cpp's ffn_norm is the MLP's pre-norm, as for Llama, but Hugging
# Face names that one pre_feedforward_layernorm and post_attention_layernorm the attention output's.
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# Phi-3: fused q/k/v, and ffn_up holding gate then up (2 x intermediate rows), split at load (fused.py)
_PHI3_LAYER_NAMES = {**_LAYER_NAMES, "attn_qkv.weight": "self_attn.qkv_proj.weight",
                     "ffn_up.weight": "mlp.gate_up_proj.weight"}
# LongRoPE's factors, one per rotary frequency: read into the config, not weights
_ROPE_FACTORS = {"long": "rope_factors_long.weight", "short": "rope_factors_short.weight"}
# Architectures whose `attention.sliding_window` applies to every layer (0 or absent: none). llama.cpp's
# converter writes it for Phi-3 only (a Mistral becomes `llama` without its window, and llama.cpp then
# attends to every key); a file that carries it for llama / mistral gets the window transformers applies.
_EVERY_LAYER_WINDOW = ("llama", "mistral", "phi3")
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass
class GGUFContents:
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # float32, Hugging Face names
    metadata: dict[str, Any]  # tokenizer.* and general.* fields


def layer_names(arch: str) -> dict[str, str]:
    """GGUF -> Hugging Face names of a layer's tensors (under blk.N. and model.layers.N.)."""
    return {"gemma3": _GEMMA3_LAYER_NAMES, "phi3": _PHI3_LAYER_NAMES}.get(arch, _LAYER_NAMES)


def _hf_name(name: str, arch: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    layer = layer_names(arch)
    if m is None or m.group(2) not in layer:
        raise ValueError(f"GGUF tensor {name!r} is not part of a supported Llama-family model")
    return f"model.layers.{m.group(1)}.{layer[m.group(2)]}"


def _expert_names(name: str, experts: int) -> list[str] | None:
    """The per-expert names of a 3-D expert tensor; None for any other tensor."""
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    if m is None or m.group(2) not in _EXPERT_NAMES:
        return None
    return [expert_name(int(m.group(1)), e, _EXPERT_NAMES[m.group(2)]) for e in range(experts)]


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of llama.cpp's permute(): interleaved rotary pairs back to rotate_half halves."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _config(path: str, header: GGUFHeader) -> ModelConfig:
    fields = header.fields
    arch = fields.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported ({', '.join(SUPPORTED_ARCHITECTURES)})")

    def meta(key: str, default: Any = None) -> Any:
        return fields.get(f"{arch}.{key}", default)

    tokens = fields.get("tokenizer.ggml.tokens") or []
    heads = int(meta("attention.head_count"))
    hidden = int(meta("embedding_length"))
    names = {t.name for t in header.tensors}
    eos = fields.get("tokenizer.ggml.eos_token_id")
    bos = fields.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(meta("vocab_size", len(tokens))),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_layers=int(meta("block_count")),
        num_heads=heads,
        num_kv_heads=int(meta("attention.head_count_kv", heads)),
        head_dim=int(meta("attention.key_length", hidden // heads)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position=int(meta("context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
        qk_norm="blk.0.attn_q_norm.weight" in names,
        **_moe_fields(meta, names),
        **(_gemma3_fields(meta, hidden) if arch == "gemma3" else {}),
        **(_phi3_fields(meta, header) if arch == "phi3" else {}),
        **(every_layer_window(meta("attention.sliding_window", 0), int(meta("block_count")))
           if arch in _EVERY_LAYER_WINDOW else {}),
    )


def _moe_fields(meta: Any, names: set[str]) -> dict[str, Any]:
    """ModelConfig's MoE fields from llama.cpp's keys; a layer without a router (ffn_gate_inp) keeps
    a dense MLP. llama.cpp renormalises the top-k weights of qwen3moe and llama (Mixtral) models."""
    experts = int(meta("expert_count", 0))
    if experts == 0:
        return {}
    layers = int(meta("block_count"))
    return dict(
        num_experts=experts,
        num_experts_per_tok=int(meta("expert_used_count")),
        moe_intermediate_size=int(meta("expert_feed_forward_length", meta("feed_forward_length"))),
        norm_topk_prob=bool(meta("expert_weights_norm", True)),
        mlp_only_layers=tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in names),
    )


# llama.cpp's Gemma 3 defaults for what its converter does not write: every sixth layer global, the
# sliding layers' rotary base 10000
_GEMMA3_SLIDING_PATTERN = 6
_GEMMA3_LOCAL_THETA = 10_000.0
_GEMMA3_27B_LAYERS = 62


def _gemma3_fields(meta: Callable[..., Any], hidden: int) -> dict[str, Any]:
    """Gemma 3's ModelConfig fields from `<arch>.*` metadata. The converter writes no
    query_pre_attn_scalar; llama.cpp takes head_dim, except for the 27B (62 layers) hidden / heads,
    which is what those models' configs say."""
    layers = int(meta("block_count"))
    heads = int(meta("attention.head_count"))
    pattern = meta("attention.sliding_window_pattern", _GEMMA3_SLIDING_PATTERN)
    if isinstance(pattern, list):  # one flag per layer
        sliding = tuple(bool(p) for p in pattern)
    else:
        sliding = tuple(bool((i + 1) % int(pattern)) for i in range(layers))
    scaling = meta("rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise ValueError(f"Gemma 3 rope scaling {scaling!r} is not supported yet")
    return dict(
        hidden_act="gelu_tanh",
        embed_scale=float(hidden) ** 0.5,
        sandwich_norms=True,
        query_pre_attn_scalar=float(hidden // heads) if layers == _GEMMA3_27B_LAYERS else None,
        sliding_window=int(meta("attention.sliding_window", 0)),
        sliding_layers=sliding,
        rope_local_theta=float(meta("rope.freq_base_swa", _GEMMA3_LOCAL_THETA)),
        rope_linear_factor=float(meta("rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0,
        final_logit_softcap=float(meta("final_logit_softcapping", 0.0)),
        attn_logit_softcap=float(meta("attn_logit_softcapping", 0.0)),
    )


def _phi3_fields(meta: Callable[..., Any], header: GGUFHeader) -> dict[str, Any]:
    """Phi-3's ModelConfig fields as llama.cpp's converter writes them: rope.dimension_count (partial
    rotary), rope_factors_long / rope_factors_short with rope.scaling.original_context_length and
    attn_factor (LongRoPE); its window is _EVERY_LAYER_WINDOW's (0: none, Phi-4)."""
    factors = {kind: t for t in header.tensors for kind, name in _ROPE_FACTORS.items() if t.name == name}
    longrope = None
    if factors:
        if len(factors) != 2 or any(t.qtype != GGML_F32 for t in factors.values()):
            raise ValueError("Phi-3 LongRoPE needs F32 rope_factors_long and rope_factors_short")
        short, long = (tuple(np.asarray(header.tensor_bytes(factors[k]), dtype=np.float32).reshape(-1).tolist())
                       for k in ("short", "long"))
        longrope = LongRope(short, long, int(meta("rope.scaling.original_context_length")),
                            float(meta("rope.scaling.attn_factor", 1.0)))
    return dict(
        partial_rotary_dim=int(meta("rope.dimension_count", 0)),
        longrope=longrope,
    )


def _heads_to_unpermute(config: ModelConfig, name: str) -> int | None:
    """llama.cpp permutes q/k rows of Llama-architecture models; the head count to undo it with."""
    if config.architecture != "llama":
        return None
    if name.endswith("attn_q.weight"):
        return config.num_heads
    if name.endswith("attn_k.weight"):
        return config.num_kv_heads
    return None


def _metadata(header: GGUFHeader) -> dict[str, Any]:
    return {k: v for k, v in header.fields.items() if k.startswith(("tokenizer.", "general."))}


def read_gguf(path: str) -> GGUFContents:
    """Every tensor dequantized to float32: the exact path, for parity with transformers."""
    import gguf  # a runtime dependency, imported where it is needed

    header = read_header(path)
    config = _config(path, header)
    weights: dict[str, torch.Tensor] = {}
    for t in header.tensors:
        if t.name in _ROPE_FACTORS.values():
            continue  # in the config
        try:
            qtype = gguf.GGMLQuantizationType(t.qtype)
        except ValueError:
            qtype = None
        if qtype is None or qtype.name not in _SUPPORTED_QUANTS:
            raise ValueError(f"{path}: tensor {t.name} has ggml type {t.qtype}; supported: {sorted(_SUPPORTED_QUANTS)}")
        w = np.asarray(gguf.quants.dequantize(header.tensor_bytes(t), qtype), dtype=np.float32)
        w = w.reshape([int(x) for x in reversed(t.shape)] if len(t.shape) > 1 else [int(t.shape[0])])
        heads = _heads_to_unpermute(config, t.name)
        if heads is not None:
            w = _unpermute(w, heads)
        # F32/F16 tensors come back as read-only views of the memory-mapped file.
        experts = _expert_names(t.name, config.num_experts)
        if experts is not None:
            weights.update({n: torch.from_numpy(np.array(w[e], dtype=np.float32, copy=True))
                            for e, n in enumerate(experts)})
            continue
        weights[_hf_name(t.name, config.architecture)] = torch.from_numpy(
            np.array(w, dtype=np.float32, order="C", copy=True))
    split_fused(config, weights)
    return GGUFContents(config, weights, _metadata(header))


@dataclass
class QuantizedGGUFContents:
    config: ModelConfig
    matrices: dict[str, QuantizedWeight]  # 2-D weights in their file format, Hugging Face names
    vectors: dict[str, torch.Tensor]  # norms and biases, float32
    metadata: dict[str, Any]


def read_gguf_quantized(path: str) -> QuantizedGGUFContents:
    """Matrices copied out of the file in their own format (no dense copy); only llama.cpp's q/k row
    permutation is undone, which moves whole rows of blocks."""
    header = read_header(path)
    config = _config(path, header)
    matrices: dict[str, QuantizedWeight] = {}
    vectors: dict[str, torch.Tensor] = {}
    raw: np.ndarray | None = None
    for t in header.tensors:
        if t.name in _ROPE_FACTORS.values():
            continue  # in the config
        raw = header.tensor_bytes(t)
        if len(t.shape) == 1:
            if t.qtype not in (GGML_F32, GGML_F16):
                raise ValueError(f"{path}: 1-D tensor {t.name} has ggml type {t.qtype}; expected F32 or F16")
            vectors[_hf_name(t.name, config.architecture)] = torch.from_numpy(
                np.array(raw, dtype=np.float32).reshape(-1))
            continue
        experts = _expert_names(t.name, config.num_experts)
        if experts is not None:  # each expert its own matrix: a step reads only its routed experts' bytes
            for e, name in enumerate(experts):  # (a view held past the loop would keep the mapping open)
                expert = raw.reshape(len(experts), int(t.shape[1]), -1)[e]
                matrices[name] = from_gguf_tensor(t.qtype, expert, int(t.shape[0])).packed_in_panels()
            del expert
            continue
        rows = int(np.prod(t.shape[1:]))
        name = _hf_name(t.name, config.architecture)
        parts = fused_parts(config, name)
        if parts is not None:  # whole rows of blocks: exact
            if rows != parts[-1][2]:
                raise ValueError(f"{path}: tensor {t.name}: {rows} rows, expected {parts[-1][2]}")
            for part, start, end in parts:
                matrices[part] = from_gguf_tensor(t.qtype, raw.reshape(rows, -1)[start:end],
                                                  int(t.shape[0])).packed_in_panels()
            continue
        try:
            w = from_gguf_tensor(t.qtype, raw.reshape(rows, -1), int(t.shape[0]))
        except ValueError as e:
            raise ValueError(f"{path}: tensor {t.name}: {e}") from None
        heads = _heads_to_unpermute(config, t.name)
        if heads is not None:
            w = w.permute_rows(_unpermute(np.arange(rows), heads))
        matrices[name] = w.packed_in_panels()
    metadata = _metadata(header)
    del raw  # the last view into the mapping
    header.data.close()  # every tensor was copied: the mapping would only keep the file resident
    return QuantizedGGUFContents(config, matrices, vectors, metadata)
