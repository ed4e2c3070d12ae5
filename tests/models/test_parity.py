"""Greedy output of our model equals Hugging Face transformers on the same float32 weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.tiny_models import hf_greedy, run_greedy

from mindie.model.llama import LlamaModel
from mindie.model.loader import default_model_path, load_weights

NEW_TOKENS = 64


def hf_model_from_dir(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def prompts_for(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (1, 5, 13, 30)]


# (our model's fixture, the Hugging Face directory transformers loads): Qwen3, Qwen3-MoE, Mixtral and
# the rest from their directories and from the GGUF files llama.cpp's converter would write of them.
MODELS = [("tiny_llama", "tiny_llama_dir"), ("tiny_qwen2", "tiny_qwen2_dir"), ("tiny_qwen3", "tiny_qwen3_dir"),
          ("tiny_qwen3_from_gguf", "tiny_qwen3_dir"), ("tiny_qwen3_moe", "tiny_qwen3_moe_dir"),
          ("tiny_qwen3_moe_from_gguf", "tiny_qwen3_moe_dir"), ("tiny_mixtral", "tiny_mixtral_dir"),
          ("tiny_mixtral_from_gguf", "tiny_mixtral_dir"),
          ("tiny_gemma3", "tiny_gemma3_dir"),
          ("tiny_gemma3_from_gguf", "tiny_gemma3_dir"), ("tiny_phi3", "tiny_phi3_dir"),
          ("tiny_phi3_from_gguf", "tiny_phi3_dir"), ("tiny_mistral", "tiny_mistral_dir"),
          ("tiny_mistral_from_gguf", "tiny_mistral_dir")]


@pytest.mark.parametrize("model,hf_dir", MODELS)
@pytest.mark.parametrize("chunk,block_size", [(None, 4), (3, 4), (None, 16), (7, 1)])
def test_tiny_models_match_transformers(model, hf_dir, chunk, block_size, request):
    path = request.getfixturevalue(hf_dir)
    ours = request.getfixturevalue(model)
    hf = hf_model_from_dir(path)
    prompts = prompts_for(ours.config.vocab_size)
    got, got_lp = run_greedy(ours.model, prompts, NEW_TOKENS, block_size=block_size, chunk=chunk)
    for prompt, tokens, lps in zip(prompts, got, got_lp):
        want, want_lp = hf_greedy(hf, prompt, NEW_TOKENS)
        assert tokens == want
        assert max(abs(a - b) for a, b in zip(lps, want_lp)) < 1e-3


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen3", "tiny_qwen3_moe", "tiny_mixtral", "tiny_gemma3",
                                   "tiny_phi3", "tiny_mistral"])
def test_batch_of_one_equals_batch_of_many(model, request):
    ours = request.getfixturevalue(model)
    prompts = prompts_for(ours.config.vocab_size)
    together, _ = run_greedy(ours.model, prompts, 16)
    alone = [run_greedy(ours.model, [p], 16)[0][0] for p in prompts]
    assert together == alone


@pytest.mark.parametrize("hf_dir", ["tiny_gemma3_dir", "tiny_mistral_dir"])
def test_parity_prompts_depend_on_the_window(hf_dir, request):
    """The parity prompts run past the tiny Gemma 3's and Mistral's windows: attending to every key
    instead moves their log-probabilities far past the parity test's 1e-3, so that test checks the
    windowed attention (and that transformers applies the window)."""
    config, weights, _ = load_weights(str(request.getfixturevalue(hf_dir)))
    prompts = prompts_for(config.vocab_size)
    _, windowed = run_greedy(LlamaModel(config, weights, torch.float32), prompts, 16)
    _, unwindowed = run_greedy(LlamaModel(dataclasses.replace(config, sliding_window=0), weights, torch.float32),
                               prompts, 16)
    assert max(abs(a - b) for w, u in zip(windowed, unwindowed) for a, b in zip(w, u)) > 0.05


@pytest.mark.parametrize("stored,window,gguf_window", [(10, 10, 10), (None, 0, 0), ("absent", 4096, 0)])
def test_mistral_window_as_transformers_reads_it(stored, window, gguf_window, tiny_mistral_dir, tmp_path):
    """Every layer of a Mistral slides with config.json's sliding_window; null (v0.2 on) is none, and a
    config without the key has MistralConfig's 4096, as transformers reads it. A GGUF carries it as
    llama.attention.sliding_window; one without the key (llama.cpp's converter writes none) has none."""
    import json
    import shutil

    from helpers.tiny_gguf import write_gguf
    from transformers import AutoConfig

    from mindie.model.gguf_file import read_gguf
    from mindie.model.hf_dir import read_config

    path = shutil.copytree(tiny_mistral_dir, tmp_path / "mistral")
    cfg = json.loads((path / "config.json").read_text())
    if stored == "absent":
        del cfg["sliding_window"]
    else:
        cfg["sliding_window"] = stored
    (path / "config.json").write_text(json.dumps(cfg))
    config = read_config(str(path))
    assert (AutoConfig.from_pretrained(path).sliding_window or 0) == window
    assert config.kv_window == window and config.sliding_layers == ((True,) * 2 if window else ())
    assert read_gguf(str(write_gguf(path, tmp_path / "mistral.gguf"))).config.kv_window == gguf_window


def test_phi3_parity_prompts_depend_on_the_long_factors_and_window(tiny_phi3_dir):
    """The parity prompts (all below original_max_position_embeddings 32) generate past it: rotating
    by the short factors there instead, or attending past the window of 24, moves the log-probabilities
    far past the parity test's 1e-3, so that test checks both."""
    config, weights, _ = load_weights(str(tiny_phi3_dir))
    assert config.longrope is not None and config.rotary_dim == 12 < config.head_dim
    prompts = prompts_for(config.vocab_size)
    _, want = run_greedy(LlamaModel(config, weights, torch.float32), prompts, 16)
    short_only = dataclasses.replace(config.longrope, long_factor=config.longrope.short_factor)
    for changed in (dataclasses.replace(config, longrope=short_only), dataclasses.replace(config, sliding_window=0)):
        _, got = run_greedy(LlamaModel(changed, weights, torch.float32), prompts, 16)
        assert max(abs(a - b) for w, u in zip(want, got) for a, b in zip(w, u)) > 0.05


@pytest.mark.parametrize("model", ["tiny_phi3", "tiny_phi3_from_gguf"])
def test_phi3_prompt_past_original_max(model, tiny_phi3_dir, request):
    """A prompt longer than original_max_position_embeddings (40 > 32). transformers chooses LongRoPE's
    factors per forward call by its largest position: its one-call prefill rotates every prompt position
    by the long factors, where our table keeps the short ones below 32 (mindie.model.llama.rope_cos_sin).
    Ours equals transformers fed the first 32 tokens in one call and the rest in the next (its per-call
    choice then gives our table's rows), and differs from its one-call prefill."""
    ours = request.getfixturevalue(model)
    hf = hf_model_from_dir(tiny_phi3_dir)
    prompt = torch.randint(0, ours.config.vocab_size, (40,), generator=torch.Generator().manual_seed(11)).tolist()
    got, got_lp = run_greedy(ours.model, [prompt], 16, chunk=7)
    want, want_lp = hf_greedy(hf, prompt, 16, first_call=32)
    assert got[0] == want and max(abs(a - b) for a, b in zip(got_lp[0], want_lp)) < 1e-3
    _, one_call_lp = hf_greedy(hf, prompt, 16)
    assert abs(one_call_lp[0] - got_lp[0][0]) > 1e-2


def test_phi3_unsupported_rope_type_is_refused(tiny_phi3_dir, tmp_path):
    import json
    import shutil

    from mindie.model.hf_dir import read_config

    path = shutil.copytree(tiny_phi3_dir, tmp_path / "phi3-dynamic")
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_parameters"]["rope_type"] = "dynamic"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="rope type 'dynamic' is not supported"):
        read_config(str(path))


def test_embedded_model_matches_transformers():
    """SmolLM2-135M-Instruct from its GGUF (Q4_1/Q8_0 dequantized to float32) against
    transformers' LlamaForCausalLM holding the same weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c, weights, tok = load_weights(default_model_path())
    model = LlamaModel(c, weights, torch.float32)
    hf = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
            num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
            head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
            max_position_embeddings=c.max_position, tie_word_embeddings=c.tie_word_embeddings,
        )
    ).eval()
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    hf.tie_weights()
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])),
        tok.encode("def fibonacci(n):"),
    ]
    got, got_lp = run_greedy(model, prompts, NEW_TOKENS, block_size=16)
    for prompt, tokens, lps in zip(prompts, got, got_lp):
        want, want_lp = hf_greedy(hf, prompt, NEW_TOKENS)
        assert tokens == want
        assert max(abs(a - b) for a, b in zip(lps, want_lp)) < 1e-3
    assert "Paris" in tok.decode(got[0])


def test_gemma3_chat_template_from_directory_and_gguf(tiny_gemma3, tiny_gemma3_from_gguf):
    messages = [{"role": "user", "content": "Hi"}]
    text = tiny_gemma3.tokenizer.apply_chat_template(messages)
    assert text == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert tiny_gemma3_from_gguf.tokenizer.apply_chat_template(messages) == text
    assert tiny_gemma3.tokenizer.encode(text) == tiny_gemma3_from_gguf.tokenizer.encode(text)
