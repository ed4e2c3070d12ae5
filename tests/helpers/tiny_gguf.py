"""A GGUF file of a tiny Hugging Face model, as llama.cpp's convert_hf_to_gguf.py names and lays it out:
the model's shape under `<arch>.*`, tensors under llama.cpp's names (the inverse of the loader's table),
the byte-level tokenizer as `gpt2` metadata with its chat template."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import torch

from mindie.model import gguf_file
from mindie.model.hf_dir import read_weights

# Hugging Face model_type -> the GGUF architecture llama.cpp's converter writes (Mistral and Mixtral
# as llama, Mixtral with experts); it permutes the q/k rows of llama models only.
GGUF_ARCHITECTURES = {"mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe",
                      "mixtral": "llama", "gemma3_text": "gemma3", "phi3": "phi3"}
# llama.cpp's expert tensors: per MoE layer, one 3-D tensor per projection
_EXPERT_TENSORS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def _gguf_names(arch: str) -> dict[str, str]:
    """Hugging Face name -> GGUF name, with {} for the layer index."""
    names = {hf: name for name, hf in gguf_file._GLOBAL_NAMES.items()}
    names.update({f"model.layers.{{}}.{hf}": f"blk.{{}}.{name}" for name, hf in gguf_file.layer_names(arch).items()})
    return names


def _gguf_name(hf: str, table: dict[str, str]) -> str:
    parts = hf.split(".")
    if hf.startswith("model.layers."):
        return table[".".join([*parts[:2], "{}", *parts[3:]])].format(parts[2])
    return table[hf]


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's permute(): each head's rotate_half halves as interleaved rotary pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_tensors(weights: dict[str, torch.Tensor], cfg: dict, arch: str) -> dict[str, np.ndarray]:
    """GGUF name -> float32 values: llama.cpp's names, q/k permuted for llama, experts stacked,
    Gemma 3's norms shifted."""
    table = _gguf_names(arch)
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    out: dict[str, np.ndarray] = {}
    for name, tensor in sorted(weights.items()):
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue  # a tied model has no output.weight: llama.cpp reads token_embd.weight
        if ".mlp.experts." in name:
            continue  # stacked below
        if arch == "gemma3" and name.endswith("norm.weight"):
            tensor = tensor + 1  # the converter's norm_shift: Gemma3RMSNorm multiplies by 1 + weight
        data = tensor.to(torch.float32).numpy()
        gguf_name = _gguf_name(name, table)
        if arch == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            kv = gguf_name.endswith("attn_k.weight")
            data = _permute(data, cfg["num_key_value_heads"] if kv else cfg["num_attention_heads"])
        out[gguf_name] = data
    for layer in range(cfg["num_hidden_layers"] if experts else 0):
        if f"model.layers.{layer}.mlp.gate.weight" not in weights:
            continue  # a dense layer
        for projection, gguf_name in _EXPERT_TENSORS.items():
            out[f"blk.{layer}.{gguf_name}.weight"] = np.stack([
                weights[f"model.layers.{layer}.mlp.experts.{e}.{projection}.weight"].float().numpy()
                for e in range(experts)])
    return out


def _add_phi3(w: gguf.GGUFWriter, cfg: dict, head_dim: int) -> None:
    """As Phi3MiniModel.set_gguf_parameters and generate_extra_tensors: rotary dimensions, the window
    (0: none), and with LongRoPE the original context, the attention factor and both factor tensors."""
    rope = cfg["rope_parameters"]
    w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * head_dim))
    w.add_sliding_window(cfg.get("sliding_window") or 0)
    original = rope.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"]
    w.add_rope_scaling_orig_ctx_len(original)
    if not rope.get("long_factor"):
        return
    scale = cfg["max_position_embeddings"] / original
    w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0)
    w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
    w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))


def _write_tokenizer(w: gguf.GGUFWriter, hf_dir: Path, vocab_size: int, for_llama_cpp: bool) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    added = tok.get_added_tokens_decoder()
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.__getitem__)
    kinds = gguf.TokenType
    types = [int((kinds.CONTROL if added[i].special else kinds.USER_DEFINED) if i in added else kinds.NORMAL)
             for i in range(len(tokens))]
    # As llama.cpp's converter pads a vocabulary to the model's size: UNUSED tokens, never text.
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
    types += [int(kinds.UNUSED)] * (vocab_size - len(types))
    merges: list[str] = []
    if for_llama_cpp:
        # llama.cpp refuses a gpt2 vocabulary without merges (the tests' byte-level tokenizers have
        # none, and the gguf writer drops an empty list): one merge whose result is no token, so
        # that it never applies.
        merges = ["Ā Ā"]
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")  # llama.cpp's name (ours reads gpt2, gpt-2 and default alike)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(vocab[config["eos_token"]])
    if config.get("bos_token"):
        w.add_bos_token_id(vocab[config["bos_token"]])
    w.add_add_bos_token(bool(config.get("add_bos_token", False)))
    w.add_chat_template(config["chat_template"])


def write_gguf(hf_dir: Path, out: Path, matrix_type: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
               for_llama_cpp: bool = False) -> Path:
    """`hf_dir` (a Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral, Gemma 3 or Phi-3 checkpoint) as a GGUF file; matrices in
    `matrix_type` (F32, or a block format the gguf package quantizes to), norms, biases and routers
    F32, as llama.cpp keeps them. `for_llama_cpp`: the tokenizer as llama.cpp's loader needs it (see
    _write_tokenizer; benchmarks/llamacpp_reads_test_ggufs.py), not as the tests read it."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = GGUF_ARCHITECTURES[cfg["model_type"]]
    heads = cfg["num_attention_heads"]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(hf_dir.name)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    rope = cfg.get("rope_parameters") or {}
    full = rope.get("full_attention", rope)
    w.add_rope_freq_base(cfg.get("rope_theta") or full["rope_theta"])
    if full.get("rope_type") == "linear":  # as TextModel.set_gguf_parameters writes it
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    if arch == "gemma3":  # as Gemma3Model.set_gguf_parameters; llama.cpp's default layer pattern (every 6th global)
        w.add_sliding_window(cfg["sliding_window"])
        if cfg.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if arch == "phi3":
        _add_phi3(w, cfg, head_dim)
    if cfg["model_type"] == "mistral" and cfg.get("sliding_window"):
        # llama.cpp's converter drops Mistral's window; the file carries it under the key Phi-3's uses
        w.add_sliding_window(cfg["sliding_window"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if "moe_intermediate_size" in cfg:
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    _write_tokenizer(w, hf_dir, cfg["vocab_size"], for_llama_cpp)
    for name, data in _gguf_tensors(read_weights(str(hf_dir)), cfg, arch).items():
        # routers (ffn_gate_inp) stay F32, as llama.cpp's converter and llama-quantize keep them
        quantized = data.ndim > 1 and not name.endswith("ffn_gate_inp.weight")
        qtype = matrix_type if quantized else gguf.GGMLQuantizationType.F32
        if qtype != gguf.GGMLQuantizationType.F32:
            data = gguf.quants.quantize(data, qtype)
        w.add_tensor(name, np.ascontiguousarray(data), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
