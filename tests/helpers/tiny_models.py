"""Tiny random Hugging Face models written to disk, and a greedy loop over our model that drives the
paged cache directly (the engine's tests go through the scheduler instead)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from mindie.model.llama import AttentionMetadata, LlamaModel

TINY = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)


LLAMA_TOKENIZER = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True,
                   "chat_template": "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                                    "{% if add_generation_prompt %}<assistant>{% endif %}"}
# Qwen3's ChatML turns and its thinking switch: with enable_thinking false the prompt closes an empty
# think block, so the model answers at once (the shape of Qwen3's own template, shortened).
QWEN3_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{%- endif %}")
QWEN3_TOKENIZER = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "add_bos_token": False,
                   "chat_template": QWEN3_TEMPLATE}
QWEN3_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN3_EOS = 256 + QWEN3_SPECIALS.index("<|im_end|>")
# Qwen3's think tags are added tokens but not special ones: decoding keeps them in the text.
QWEN3_PLAIN = ("<think>", "</think>")


# Gemma's turns (the shape of Gemma 3's own template, shortened): <bos> first, the reply ends at <end_of_turn>
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{%- for m in messages %}{{- '<start_of_turn>' + ('model' if m['role'] == 'assistant' else "
    "m['role']) + '\n' + m['content'] + '<end_of_turn>\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\n' }}{%- endif %}")
GEMMA3_TOKENIZER = {"bos_token": "<bos>", "eos_token": "<end_of_turn>", "add_bos_token": False,
                    "chat_template": GEMMA3_TEMPLATE}
GEMMA3_SPECIALS = ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>")
# Gemma 3's shape in small: six layers, so llama.cpp's default pattern (five sliding, one global) holds;
# a window of 11, below the tests' prompts and not a multiple of their KV block sizes; head_dim not
# hidden / heads, query_pre_attn_scalar equal to it (as in every Gemma 3 but the 27B, and as llama.cpp
# reads a GGUF); linear scaling of the global layers' rotary; the final logits soft-capped.
GEMMA3 = dict(num_hidden_layers=6, head_dim=32, query_pre_attn_scalar=32, sliding_window=11,
              final_logit_softcapping=30.0, tie_word_embeddings=True,
              bos_token_id=256 + GEMMA3_SPECIALS.index("<bos>"),
              eos_token_id=256 + GEMMA3_SPECIALS.index("<end_of_turn>"), pad_token_id=256,
              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
# Phi-4-mini's shape in small: three quarters of each head rotate (12 of 16 dimensions), LongRoPE with
# its factors distinct per frequency and original_max_position_embeddings 32, so the parity test's
# generations cross it (max_position_embeddings 512 makes the attention factor sqrt(1 + ln 16 / ln 32));
# Phi-3-mini-4k's sliding window (every layer), here 24: below the prompts plus their generations.
PHI3_ROTARY_HALF = 6
PHI3 = dict(original_max_position_embeddings=32, sliding_window=24, tie_word_embeddings=True,
            bos_token_id=256, eos_token_id=257, pad_token_id=None,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                             "short_factor": [1.0 + 0.1 * i for i in range(PHI3_ROTARY_HALF)],
                             "long_factor": [1.0 + 3.0 * i for i in range(PHI3_ROTARY_HALF)]})
# Mistral v0.1's window on every layer, here 10: below the tests' prompts plus their generations and not
# a multiple of their KV block sizes.
MISTRAL = dict(sliding_window=10, rope_theta=10000.0, tie_word_embeddings=False)


def write_byte_tokenizer(path: Path, specials: tuple[str, ...] = ("<s>", "</s>"), plain: tuple[str, ...] = (),
                         config: dict[str, object] = LLAMA_TOKENIZER) -> None:
    """A byte-level BPE over the 256 byte symbols, no merges, then the special tokens and the added
    non-special ones (`plain`), with `config` as tokenizer_config.json."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in specials])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def make_tiny(path: Path, arch: str, seed: int) -> Path:
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    torch.manual_seed(seed)
    if arch == "gemma3":
        model = Gemma3ForCausalLM(Gemma3TextConfig(**{**TINY, **GEMMA3}))
    elif arch == "phi3":
        model = Phi3ForCausalLM(Phi3Config(**TINY, **PHI3))
    elif arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**TINY, rope_theta=10000.0, tie_word_embeddings=False))
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(**TINY, **MISTRAL))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**TINY, rope_theta=1000000.0, tie_word_embeddings=True))
    elif arch == "qwen3":  # head_dim 32 is not hidden / heads (16), as in the real models (128 against 64 or 80)
        model = Qwen3ForCausalLM(Qwen3Config(**TINY, head_dim=32, rope_theta=1000000.0, tie_word_embeddings=False,
                                             bos_token_id=None, eos_token_id=QWEN3_EOS))
    elif arch == "qwen3_moe":  # 8 experts, 2 per token, renormalised as Qwen3-30B-A3B; layer 1 a dense MLP
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
            **{**TINY, "num_hidden_layers": 3}, head_dim=32, rope_theta=1000000.0, tie_word_embeddings=False,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1],
            bos_token_id=None, eos_token_id=QWEN3_EOS))
    else:  # mixtral: 4 experts of intermediate_size, 2 per token, in every layer
        model = MixtralForCausalLM(MixtralConfig(**TINY, rope_theta=1000000.0, tie_word_embeddings=False,
                                                 num_local_experts=4, num_experts_per_tok=2))
    # Larger-than-init weights make the logits decisive, so greedy ties are not a coin toss.
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0 if p.dim() > 1 else 1.0)
            if arch.startswith("qwen3") and p.dim() == 1:  # norms away from ones, so that q_norm / k_norm count
                p.uniform_(0.5, 1.5)
            if arch == "gemma3" and p.dim() == 1:  # Gemma's (1 + w) norms are zeros at init
                p.uniform_(-0.5, 0.5)
        if arch == "gemma3":  # its tied head reads unit-RMS rows: larger rows make the logits decisive
            model.get_input_embeddings().weight.mul_(4.0)
    model.save_pretrained(path, safe_serialization=True)
    if arch == "gemma3":
        write_byte_tokenizer(path, GEMMA3_SPECIALS, config=GEMMA3_TOKENIZER)
    elif arch.startswith("qwen3"):
        write_byte_tokenizer(path, QWEN3_SPECIALS, QWEN3_PLAIN, QWEN3_TOKENIZER)
    else:
        write_byte_tokenizer(path)
    return path


def run_greedy(
    model: LlamaModel,
    prompts: list[list[int]],
    new_tokens: int,
    block_size: int = 4,
    chunk: int | None = None,
) -> tuple[list[list[int]], list[list[float]]]:
    """All prompts in one batch; each step feeds every sequence's pending tokens (at most `chunk`
    per prefill step), so prefill chunks and decode tokens share steps. Returns the generated ids
    and their log-probabilities."""
    max_len = max(len(p) for p in prompts) + new_tokens
    blocks_per_seq = math.ceil(max_len / block_size)
    caches = model.allocate_kv_cache(blocks_per_seq * len(prompts) + 1, block_size)
    # Sequences get interleaved, non-contiguous blocks: block b of seq s is b * n + s + 1.
    n = len(prompts)
    tables = torch.tensor([[b * n + s + 1 for b in range(blocks_per_seq)] for s in range(n)], dtype=torch.int32)
    seqs = [list(p) for p in prompts]
    computed = [0] * n
    out: list[list[int]] = [[] for _ in prompts]
    logprobs: list[list[float]] = [[] for _ in prompts]
    while any(len(o) < new_tokens for o in out):
        ids, positions, slots, starts, lens, last = [], [], [], [0], [], []
        active = [s for s in range(n) if len(out[s]) < new_tokens]
        for s in active:
            pending = seqs[s][computed[s]:]
            if chunk is not None:
                pending = pending[:chunk]
            pos = list(range(computed[s], computed[s] + len(pending)))
            ids += pending
            positions += pos
            slots += [int(tables[s, p // block_size]) * block_size + p % block_size for p in pos]
            computed[s] += len(pending)
            starts.append(starts[-1] + len(pending))
            lens.append(computed[s])
            last.append(starts[-1] - 1)
        meta = AttentionMetadata(
            positions=torch.tensor(positions),
            slot_mapping=torch.tensor(slots),
            block_tables=tables[active].contiguous(),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            logits_indices=torch.tensor(last),
            prompt_lens=torch.tensor([len(prompts[s]) for s in active], dtype=torch.int32),
        )
        logits = model.forward(torch.tensor(ids), meta, caches)
        lp = torch.log_softmax(logits, dim=-1)
        for row, s in enumerate(active):
            if computed[s] < len(seqs[s]):
                continue  # mid-prefill: this chunk's last logits are not a next token
            token = int(logits[row].argmax())
            seqs[s].append(token)
            out[s].append(token)
            logprobs[s].append(float(lp[row, token]))
    return out, logprobs


def hf_greedy(hf_model, prompt: list[int], new_tokens: int, first_call: int | None = None
              ) -> tuple[list[int], list[float]]:
    """Reference: transformers' forward with its own KV cache, one token at a time; the prompt in one
    call, or its first `first_call` tokens in one and the rest in the next."""
    tokens, logprobs = [], []
    with torch.no_grad():
        out = hf_model(torch.tensor([prompt[:first_call]]), use_cache=True)
        if first_call is not None:
            out = hf_model(torch.tensor([prompt[first_call:]]), past_key_values=out.past_key_values, use_cache=True)
        for _ in range(new_tokens):
            logits = out.logits[0, -1].float()
            token = int(logits.argmax())
            tokens.append(token)
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            out = hf_model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, logprobs
