"""A GGUF of a served Qwen3, Qwen3-MoE or Gemma 3 model's shape with random weights, in llama.cpp's
tensor names and keys (as convert_hf_to_gguf.py writes them), for speed comparisons against
llama.cpp at the sizes people serve (issue 27).

    python benchmarks/make_family_gguf.py SHAPE OUT.gguf [--source GGUF]

SHAPE is one of SHAPES below; qwen3-30b-a3b-32e is Qwen3-30B-A3B's layers with 32 of its 128 experts
(8 active per token, about 8.8 B parameters). The tokenizer and chat template come from SOURCE
(default: the embedded SmolLM2), its vocabulary padded with control tokens to the model's own size,
so that the embedding and lm_head have the real shapes. Weights are F16 draws (std 0.02), norms 1
(Gemma's stored as 1 + 0, as the converter shifts them). Quantize the file with llama-quantize from
../shared/tools/build-llamacpp.sh (Q4_K_M, Q4_0, ...). Tensors are written one at a time, so a file
takes no more memory to write than its largest tensor.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import dataclass

import gguf
import numpy as np


@dataclass(frozen=True)
class Shape:
    arch: str  # the GGUF architecture: qwen3 | qwen3moe | gemma3
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int  # a dense MLP's width; an MoE layer's experts are expert_ffn wide
    vocab: int
    tied: bool
    rope_theta: float
    experts: int = 0
    experts_used: int = 0
    expert_ffn: int = 0
    sliding_window: int = 0  # Gemma 3: every sixth layer global (llama.cpp's default pattern)


# The public configs' shapes.
SHAPES = {
    "qwen3-1.7b": Shape("qwen3", 2048, 28, 16, 8, 128, 6144, 151936, True, 1e6),
    "qwen3-4b": Shape("qwen3", 2560, 36, 32, 8, 128, 9728, 151936, True, 1e6),
    "qwen3-30b-a3b-32e": Shape("qwen3moe", 2048, 48, 32, 4, 128, 6144, 151936, False, 1e6, experts=32,
                               experts_used=8, expert_ffn=768),
    "gemma-3-1b": Shape("gemma3", 1152, 26, 4, 1, 256, 6912, 262144, True, 1e6, sliding_window=512),
}


def copy_tokenizer(w: gguf.GGUFWriter, source: str, vocab: int) -> None:
    """SOURCE's tokenizer.* keys, its token list padded to `vocab` with control tokens."""
    src = gguf.GGUFReader(source)
    for name, field in src.fields.items():
        if not name.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            vals = [field.parts[i] for i in field.data]
            vals = [bytes(v).decode("utf-8", "replace") for v in vals] if sub == gguf.GGUFValueType.STRING else \
                [v.tolist()[0] for v in vals]
            if name == "tokenizer.ggml.tokens":
                vals += [f"<|pad_{i}|>" for i in range(vocab - len(vals))]
            elif name == "tokenizer.ggml.token_type":
                vals += [int(gguf.TokenType.CONTROL)] * (vocab - len(vals))
            w.add_key_value(name, vals, vtype, sub_type=sub)
        elif vtype == gguf.GGUFValueType.STRING:
            w.add_key_value(name, bytes(field.parts[field.data[0]]).decode("utf-8", "replace"), vtype)
        else:
            w.add_key_value(name, field.parts[field.data[0]].tolist()[0], vtype)


def tensors(s: Shape) -> Iterator[tuple[str, tuple[int, ...], bool]]:
    """(name, numpy shape, is a norm) of every tensor, in the converter's order."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    yield "token_embd.weight", (s.vocab, s.hidden), False
    for i in range(s.layers):
        p = f"blk.{i}."
        yield p + "attn_norm.weight", (s.hidden,), True
        yield p + "attn_q.weight", (q, s.hidden), False
        yield p + "attn_k.weight", (kv, s.hidden), False
        yield p + "attn_v.weight", (kv, s.hidden), False
        yield p + "attn_q_norm.weight", (s.head_dim,), True
        yield p + "attn_k_norm.weight", (s.head_dim,), True
        yield p + "attn_output.weight", (s.hidden, q), False
        if s.arch == "gemma3":
            yield p + "post_attention_norm.weight", (s.hidden,), True
        yield p + "ffn_norm.weight", (s.hidden,), True
        if s.experts:
            yield p + "ffn_gate_inp.weight", (s.experts, s.hidden), False
            yield p + "ffn_gate_exps.weight", (s.experts, s.expert_ffn, s.hidden), False
            yield p + "ffn_up_exps.weight", (s.experts, s.expert_ffn, s.hidden), False
            yield p + "ffn_down_exps.weight", (s.experts, s.hidden, s.expert_ffn), False
        else:
            yield p + "ffn_gate.weight", (s.ffn, s.hidden), False
            yield p + "ffn_up.weight", (s.ffn, s.hidden), False
            yield p + "ffn_down.weight", (s.hidden, s.ffn), False
        if s.arch == "gemma3":
            yield p + "post_ffw_norm.weight", (s.hidden,), True
    yield "output_norm.weight", (s.hidden,), True
    if not s.tied:
        yield "output.weight", (s.vocab, s.hidden), False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out")
    ap.add_argument("--source", help="GGUF whose tokenizer to copy (default: the embedded SmolLM2)")
    args = ap.parse_args()
    if args.source is None:
        from mindie.model.loader import default_model_path

        args.source = str(default_model_path())
    s = SHAPES[args.shape]
    w = gguf.GGUFWriter(args.out, s.arch)
    copy_tokenizer(w, args.source, s.vocab)
    w.add_name(f"synthetic-{args.shape}")
    w.add_context_length(32768)
    w.add_embedding_length(s.hidden)
    w.add_block_count(s.layers)
    w.add_feed_forward_length(s.ffn)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    if s.experts:
        w.add_expert_count(s.experts)
        w.add_expert_used_count(s.experts_used)
        w.add_expert_feed_forward_length(s.expert_ffn)
    if s.sliding_window:
        w.add_sliding_window(s.sliding_window)
    listed = list(tensors(s))
    for name, shape, norm in listed:
        dtype = np.float32 if norm or name.endswith("ffn_gate_inp.weight") else np.float16
        w.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for name, shape, norm in listed:
        if norm:
            w.write_tensor_data(np.ones(shape, np.float32))
            continue
        data = rng.standard_normal(shape, dtype=np.float32)
        data *= 0.02
        w.write_tensor_data(data if name.endswith("ffn_gate_inp.weight") else data.astype(np.float16))
    w.close()


if __name__ == "__main__":
    main()
