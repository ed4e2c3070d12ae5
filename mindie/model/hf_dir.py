"""Reads a Hugging Face model directory: config.json and *.safetensors."""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch

from mindie.model.config import LongRope, ModelConfig, every_layer_window

_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                  "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3moe", "MixtralForCausalLM": "llama",
                  "Gemma3ForCausalLM": "gemma3", "Phi3ForCausalLM": "phi3",
                  "Qwen2VLForConditionalGeneration": "qwen2", "Qwen2_5_VLForConditionalGeneration": "qwen2",
                  # a Llama language model beside mindie.model.idefics3's vision encoder
                  "Idefics3ForConditionalGeneration": "llama", "SmolVLMForConditionalGeneration": "llama",
                  # a Qwen2 language model beside mindie.model.qwen2_audio's audio encoder
                  "Qwen2AudioForConditionalGeneration": "qwen2"}
# Architectures whose every layer attends within config.json's sliding_window, with the window
# transformers' config class gives one that has no such key (MistralConfig: 4096; null: none).
_EVERY_LAYER_WINDOW = {"MistralForCausalLM": 4096, "MixtralForCausalLM": None, "Phi3ForCausalLM": None}
# Vision-language architectures: a Qwen2 language model plus mindie.model.qwen2_vl's vision tower
VISION_ARCHITECTURES = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


# Qwen2-Audio-7B's config.json writes only the text config's fields that differ from Qwen2Config's
# defaults (no hidden_size, layer or head counts): transformers fills these in
_TEXT_DEFAULTS = {"qwen2_audio": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                                  "num_key_value_heads": 32, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
                                  "max_position_embeddings": 32768, "tie_word_embeddings": False}}


def read_optional_json(path: str, name: str) -> dict[str, Any]:
    """The JSON file `name` of the directory `path` (a preprocessor config); {} where it has none."""
    file = os.path.join(path, name)
    if not os.path.isfile(file):
        return {}
    with open(file, encoding="utf-8") as f:
        return json.load(f)


def language_model_names(weights: dict[str, torch.Tensor], towers: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """A multimodal checkpoint's tensors with the language model under the names LlamaModel reads
    (`model.*`, `lm_head.weight`) beside its encoder's (`towers`: their prefixes, e.g. `visual.`),
    from either layout: the model's own (`language_model.model.*`, `language_model.lm_head.*`) or
    the one transformers 5 writes (`model.language_model.*`, `model.<tower>*`)."""
    out = {}
    for name, w in weights.items():
        if name.startswith("language_model."):
            name = name.removeprefix("language_model.")
        elif name.startswith("model.language_model."):
            name = "model." + name.removeprefix("model.language_model.")
        elif name.startswith(tuple("model." + t for t in towers)):
            name = name.removeprefix("model.")
        out[name] = w
    return out


def take_weight(weights: dict[str, torch.Tensor], name: str, dtype: torch.dtype) -> torch.Tensor:
    """Checkpoint tensor `name` as a contiguous tensor in `dtype`; KeyError naming it when absent."""
    if name not in weights:
        raise KeyError(f"weight {name!r} missing from the checkpoint")
    return weights[name].to(dtype).contiguous()


def read_raw_config(path: str) -> dict[str, Any]:
    """config.json; a vision-language model's `text_config` (transformers 5 nests it there) lifted
    to the top level, where older checkpoints keep those keys."""
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    if not isinstance(cfg.get("text_config"), dict):
        return cfg
    return {**cfg, **_TEXT_DEFAULTS.get(cfg.get("model_type", ""), {}), **cfg["text_config"]}


# Gemma 3's layer pattern when config.json lists no layer_types: five sliding layers, then a global one
GEMMA3_SLIDING_PATTERN = 6


def _gemma3_fields(path: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's ModelConfig fields. Rotary per layer type: transformers 5 nests it in rope_parameters
    under full_attention / sliding_attention; older config.json files have rope_theta, rope_scaling
    (the global layers') and rope_local_base_freq."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:
        full, local = params["full_attention"], params.get("sliding_attention") or {}
    else:
        full = {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta", 1_000_000.0)}
        local = {"rope_theta": cfg.get("rope_local_base_freq", 10_000.0)}
    kind = full.get("rope_type", full.get("type", "default"))
    if kind not in ("default", "linear") or local.get("rope_type", "default") != "default":
        raise ValueError(f"{path}: rope scaling {full} / {local} is not supported yet")
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % GEMMA3_SLIDING_PATTERN else "full_attention"
                                       for i in range(n)]
    return dict(
        rope_theta=float(full.get("rope_theta", 1_000_000.0)),
        rope_linear_factor=float(full.get("factor", 1.0)) if kind == "linear" else 1.0,
        rope_local_theta=float(local.get("rope_theta", 10_000.0)),
        hidden_act="gelu_tanh",
        embed_scale=float(cfg["hidden_size"]) ** 0.5,
        sandwich_norms=True,
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or cfg.get("head_dim") or 256),
        sliding_window=int(cfg.get("sliding_window") or 0),
        sliding_layers=tuple(t == "sliding_attention" for t in types),
        final_logit_softcap=float(cfg.get("final_logit_softcapping") or 0.0),
        attn_logit_softcap=float(cfg.get("attn_logit_softcapping") or 0.0),
    )


def _phi3_fields(path: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Phi-3 / Phi-4-mini's ModelConfig fields: partial rotary and LongRoPE (transformers 5's
    rope_parameters, or rope_scaling with the older type names)."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "longrope", "su", "yarn"):  # Phi3Config reads su and yarn as longrope
        raise ValueError(f"{path}: Phi-3 rope type {kind!r} is not supported (default, longrope)")
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    longrope = None
    if kind != "default":
        original = int(rope.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"])
        # transformers' _compute_longrope_parameters: the factor defaults to the context's growth
        factor = float(rope.get("factor") or int(cfg["max_position_embeddings"]) / original)
        attention = rope.get("attention_factor")
        if attention is None:
            attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0
        longrope = LongRope(tuple(float(f) for f in rope["short_factor"]),
                            tuple(float(f) for f in rope["long_factor"]), original, float(attention))
    return dict(
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        partial_rotary_dim=int(head_dim * partial),
        longrope=longrope,
    )


def read_config(path: str) -> ModelConfig:
    cfg = read_raw_config(path)
    names = cfg.get("architectures") or []
    arch = next((_ARCHITECTURES[n] for n in names if n in _ARCHITECTURES), None)
    if arch is None:
        raise ValueError(
            f"{path}: config.json architectures {names} not supported; supported: {sorted(_ARCHITECTURES)}"
        )
    heads = int(cfg["num_attention_heads"])
    extra = _gemma3_fields(path, cfg) if arch == "gemma3" else _phi3_fields(path, cfg) if arch == "phi3" else {}
    rope = {} if extra else cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    mrope = tuple(int(n) for n in rope.get("mrope_section") or ())
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", "mrope", None):
        raise ValueError(f"{path}: rope scaling {rope} is not supported yet")
    theta = extra.pop("rope_theta", None) or rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    windowed = next((n for n in names if n in _EVERY_LAYER_WINDOW), None)
    if windowed:
        extra.update(every_layer_window(cfg.get("sliding_window", _EVERY_LAYER_WINDOW[windowed]),
                                        int(cfg["num_hidden_layers"])))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
        rope_theta=float(theta),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
        mrope_section=mrope if any(n in VISION_ARCHITECTURES for n in names) else (),
        qk_norm=arch in ("qwen3", "qwen3moe", "gemma3"),
        **_moe_fields(cfg),
        **extra,
    )


def _moe_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's MoE fields: Qwen3-MoE names them all; Mixtral has num_local_experts experts of
    intermediate_size in every layer and always renormalises the top-k weights."""
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if experts == 0:
        return {}
    return dict(
        num_experts=experts,
        num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
        mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
    )


# Mixtral's checkpoint names for its MoE MLP, as Qwen3-MoE's (the names the models read)
_MIXTRAL_NAMES = ((".block_sparse_moe.", ".mlp."), (".w1.weight", ".gate_proj.weight"),
                  (".w3.weight", ".up_proj.weight"), (".w2.weight", ".down_proj.weight"))


def _canonical_name(name: str) -> str:
    if ".block_sparse_moe." not in name:
        return name
    for old, new in _MIXTRAL_NAMES:
        name = name.replace(old, new)
    return name


def shift_gemma_norms(weights: dict[str, torch.Tensor]) -> None:
    """Gemma's RMSNorm multiplies by (1 + weight); stored as the multiplier (what llama.cpp's converter
    writes too), one kernel serves every family."""
    for name, w in weights.items():
        if name.endswith("norm.weight"):
            weights[name] = w.float() + 1.0


def read_weights(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        weights.update({_canonical_name(k): w for k, w in load_file(os.path.join(path, name)).items()})
    return weights
