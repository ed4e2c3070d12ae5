"""Reads a GGUF file: model shape, float32 weights under Hugging Face names, tokenizer metadata.

llama.cpp's converter permutes the q/k projection rows of Llama-architecture models for its
interleaved rotary layout; they are permuted back here so one model definition (Hugging Face
rotate_half layout) serves GGUF and safetensors weights alike.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mindie.model.config import ModelConfig
from mindie.model.gguf_header import read_header

_SUPPORTED_QUANTS = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0"}

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
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
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


def _hf_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise ValueError(f"GGUF tensor {name!r} is not part of a supported Llama-family model")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of llama.cpp's permute(): interleaved rotary pairs back to rotate_half halves."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(path: str) -> GGUFContents:
    import gguf  # a runtime dependency, imported where it is needed

    header = read_header(path)
    fields = header.fields
    arch = fields.get("general.architecture")
    if arch not in ("llama", "mistral", "qwen2"):
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (llama, mistral, qwen2)")

    def meta(key: str, default: Any = None) -> Any:
        return fields.get(f"{arch}.{key}", default)

    tokens = fields.get("tokenizer.ggml.tokens") or []
    heads = int(meta("attention.head_count"))
    kv_heads = int(meta("attention.head_count_kv", heads))
    hidden = int(meta("embedding_length"))
    names = {t.name for t in header.tensors}
    eos = fields.get("tokenizer.ggml.eos_token_id")
    bos = fields.get("tokenizer.ggml.bos_token_id")
    config = ModelConfig(
        architecture=arch,
        vocab_size=int(meta("vocab_size", len(tokens))),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_layers=int(meta("block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(meta("attention.key_length", hidden // heads)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position=int(meta("context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
    )
    weights: dict[str, torch.Tensor] = {}
    for t in header.tensors:
        try:
            qtype = gguf.GGMLQuantizationType(t.qtype)
        except ValueError:
            qtype = None
        if qtype is None or qtype.name not in _SUPPORTED_QUANTS:
            raise ValueError(f"{path}: tensor {t.name} has ggml type {t.qtype}; supported: {sorted(_SUPPORTED_QUANTS)}")
        w = np.asarray(gguf.quants.dequantize(header.tensor_bytes(t), qtype), dtype=np.float32)
        w = w.reshape([int(x) for x in reversed(t.shape)] if len(t.shape) > 1 else [int(t.shape[0])])
        if arch == "llama" and t.name.endswith("attn_q.weight"):
            w = _unpermute(w, heads)
        elif arch == "llama" and t.name.endswith("attn_k.weight"):
            w = _unpermute(w, kv_heads)
        # F32/F16 tensors come back as read-only views of the memory-mapped file.
        weights[_hf_name(t.name)] = torch.from_numpy(np.array(w, dtype=np.float32, order="C", copy=True))
    metadata = {k: v for k, v in fields.items() if k.startswith(("tokenizer.", "general."))}
    return GGUFContents(config, weights, metadata)
