"""The quantized path (GGUF weights in their formats, int8 activations, the C++ step) against the
exact path (the same weights dequantized, float32 torch), on the embedded SmolLM2 and a fixed text."""

from __future__ import annotations

import math
import os
from pathlib import Path

import gguf
import pytest
import torch
from helpers.tiny_gguf import write_gguf
from helpers.tiny_models import run_greedy

from mindie import _C, LLM, SamplingParams
from mindie.model import llama_quant
from mindie.model.llama import AttentionMetadata
from mindie.model.llama_quant import QuantizedLlamaModel
from mindie.model.loader import default_model_path, load_model

TEXT = (Path(__file__).parent / "data" / "perplexity.txt").read_text()
# (dtype, prompt-row form): with bfloat16 both forms, whichever the CPU's measured default is (bf16
# only where the CPU has native bf16 dot products).
DTYPE_FORMS = [("float32", "int8"), ("bfloat16", "bf16"), ("bfloat16", "int8")]


def force_prompt_form(monkeypatch: pytest.MonkeyPatch, form: str) -> None:
    monkeypatch.setattr(llama_quant, "prompt_rows_in_bf16", lambda: form == "bf16" and _C.qmatmul_bf16_native())


@pytest.fixture(scope="module")
def exact():
    return load_model(None, "float32", "none")


@pytest.fixture(scope="module")
def text_ids(exact) -> list[int]:
    return exact.tokenizer.encode(TEXT)


def prompt_logits(model, ids: list[int], block_size: int = 16) -> torch.Tensor:
    """Teacher-forced logits of every position, the prompt in one prefill."""
    n = len(ids)
    blocks = math.ceil(n / block_size)
    caches = model.allocate_kv_cache(blocks, block_size)
    meta = AttentionMetadata(
        positions=torch.arange(n), slot_mapping=torch.arange(n),
        block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        query_start_loc=torch.tensor([0, n], dtype=torch.int32), seq_lens=torch.tensor([n], dtype=torch.int32),
        logits_indices=torch.arange(n), prompt_lens=torch.tensor([n], dtype=torch.int32))
    return model.forward(torch.tensor(ids), meta, caches)


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    lp = torch.log_softmax(logits[:-1].double(), dim=-1).gather(1, torch.tensor(ids[1:])[:, None])
    return math.exp(-lp.mean().item())


@pytest.mark.parametrize("dtype,form", DTYPE_FORMS)
def test_perplexity_and_top1_match_the_exact_path(exact, text_ids, dtype, form, monkeypatch):
    force_prompt_form(monkeypatch, form)
    quant = load_model(None, dtype)
    assert isinstance(quant.model, QuantizedLlamaModel)
    want = prompt_logits(exact.model, text_ids)
    got = prompt_logits(quant.model, text_ids)
    assert len(text_ids) > 400
    assert abs(perplexity(got, text_ids) / perplexity(want, text_ids) - 1) < 0.01
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.99


def assert_greedy_until_a_near_tie(exact_model, quant_model, prompts: list[list[int]], new_tokens: int) -> None:
    """Greedy tokens agree with the exact path up to the first step where the exact path's top-1 and
    top-2 logits are closer than 0.1 (there, either choice is within rounding)."""
    got, _ = run_greedy(quant_model, prompts, new_tokens, block_size=16)
    for prompt, tokens in zip(prompts, got):
        logits = prompt_logits(exact_model, prompt + tokens)[len(prompt) - 1:-1]
        for step, token in enumerate(tokens):
            top2 = logits[step].topk(2)
            if token != top2.indices[0].item():
                assert (top2.values[0] - top2.values[1]).item() < 0.1, (step, token)
                break


def test_greedy_equals_exact_until_a_near_tie(exact, smollm):
    tok = exact.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])),
               tok.encode("def fibonacci(n):"), tok.encode(TEXT[:400])]
    assert_greedy_until_a_near_tie(exact.model, smollm.model, prompts, 48)


@pytest.fixture(scope="module")
def tiny_qwen3_q8_gguf(tiny_qwen3_dir, tmp_path_factory) -> Path:
    return write_gguf(tiny_qwen3_dir, tmp_path_factory.mktemp("gguf") / "tiny-qwen3.Q8_0.gguf",
                      gguf.GGMLQuantizationType.Q8_0)


@pytest.mark.parametrize("source,quantization", [("gguf", "auto"), ("dir", "q8_0"), ("dir", "q4_0")])
@pytest.mark.parametrize("dtype,form", DTYPE_FORMS)
def test_qwen3_quantized_follows_the_exact_path(tiny_qwen3, tiny_qwen3_dir, tiny_qwen3_q8_gguf, source,
                                                quantization, dtype, form, monkeypatch):
    """Qwen3 on the C++ step (q/k head norms in it): a Q8_0 GGUF kept in its format, and the Hugging Face
    checkpoint quantized at load. With 8-bit weights: greedy-equal to the exact path until a near tie,
    teacher-forced perplexity within 1% of the exact path's and the same top-1 at 95% of positions
    (0.36 with the q/k head norms left out)."""
    force_prompt_form(monkeypatch, form)
    path = tiny_qwen3_q8_gguf if source == "gguf" else tiny_qwen3_dir
    quant = load_model(str(path), dtype, quantization)
    assert isinstance(quant.model, QuantizedLlamaModel) and quant.config.qk_norm
    assert set(quant.model.weight_formats) == {"Q8_0" if quantization == "auto" else quantization.upper()}
    ids = torch.randint(0, quant.config.vocab_size, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    want, got = prompt_logits(tiny_qwen3.model, ids), prompt_logits(quant.model, ids)
    top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    if quantization == "q4_0":  # 4-bit weights move a random model's top-1 often (0.36 without the head norms)
        assert top1 >= 0.5
        return
    assert abs(perplexity(got, ids) / perplexity(want, ids) - 1) < 0.01 and top1 >= 0.95
    prompts = [[1, 2, 3, 4, 5], list(range(40, 77)), list(range(200, 213))]
    assert_greedy_until_a_near_tie(tiny_qwen3.model, quant.model, prompts, 24)


@pytest.fixture(scope="module")
def tiny_gemma3_q8_gguf(tiny_gemma3_dir, tmp_path_factory) -> Path:
    return write_gguf(tiny_gemma3_dir, tmp_path_factory.mktemp("gguf") / "tiny-gemma3.Q8_0.gguf",
                      gguf.GGMLQuantizationType.Q8_0)


@pytest.mark.parametrize("source,quantization", [("gguf", "auto"), ("dir", "q8_0"), ("dir", "q4_0")])
@pytest.mark.parametrize("dtype,form", DTYPE_FORMS)
def test_gemma3_quantized_follows_the_exact_path(tiny_gemma3, tiny_gemma3_dir, tiny_gemma3_q8_gguf, source,
                                                 quantization, dtype, form, monkeypatch):
    """Gemma 3 on the C++ step (GeGLU, sandwich norms, embedding scale, sliding layers with their own
    rotary, soft-capped logits), under the rules of the Qwen3 test above. The 300-token prompt runs far
    past the window of 11."""
    force_prompt_form(monkeypatch, form)
    path = tiny_gemma3_q8_gguf if source == "gguf" else tiny_gemma3_dir
    quant = load_model(str(path), dtype, quantization)
    assert isinstance(quant.model, QuantizedLlamaModel) and quant.config.sliding_window == 11
    assert set(quant.model.weight_formats) == {"Q8_0" if quantization == "auto" else quantization.upper()}
    ids = torch.randint(0, quant.config.vocab_size, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    want, got = prompt_logits(tiny_gemma3.model, ids), prompt_logits(quant.model, ids)
    top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    if quantization == "q4_0":
        assert top1 >= 0.5
        return
    assert abs(perplexity(got, ids) / perplexity(want, ids) - 1) < 0.01 and top1 >= 0.95
    prompts = [[1, 2, 3, 4, 5], list(range(40, 77)), list(range(200, 213))]
    assert_greedy_until_a_near_tie(tiny_gemma3.model, quant.model, prompts, 24)


def test_weights_stay_in_their_formats(smollm):
    model = smollm.model
    assert isinstance(model, QuantizedLlamaModel)
    assert model.weight_formats == {"Q4_1": 210, "Q8_0": 1}  # the file's own: no dense copy
    assert model.weight_bytes <= 1.15 * os.path.getsize(default_model_path())


def test_hf_checkpoint_quantized_at_load(tiny_llama_dir):
    dense = load_model(str(tiny_llama_dir), "float32", "none")
    prompts = [[1, 2, 3, 4, 5], list(range(40, 77))]
    want, _ = run_greedy(dense.model, prompts, 8)
    for quantization in ("q8_0", "q4_0"):
        quant = load_model(str(tiny_llama_dir), "float32", quantization)
        assert isinstance(quant.model, QuantizedLlamaModel)
        assert set(quant.model.weight_formats) == {quantization.upper()}
        got, _ = run_greedy(quant.model, prompts, 8)
        if quantization == "q8_0":  # 8-bit weights keep a tiny random model's greedy path
            assert got == want
    with pytest.raises(ValueError, match="quantization must be one of"):
        load_model(str(tiny_llama_dir), "float32", "q3_k")
    with pytest.raises(ValueError, match="applies to Hugging Face checkpoints"):
        load_model(None, "float32", "q8_0")


@pytest.mark.parametrize("dtype,form", DTYPE_FORMS)
def test_prompt_and_generated_rows_keep_their_bits_in_mixed_steps(dtype, form, monkeypatch):
    """In 8-token chunks, the short prompt decodes while the long one is still prefilling (in the bf16
    form, its rows take the bf16 path beside the other's int8 decode row): each sequence's tokens and
    log-probabilities are the same bits as when it runs alone."""
    force_prompt_form(monkeypatch, form)
    model = load_model(None, dtype).model
    short, long = list(range(1000, 1005)), list(range(2000, 2037))
    together, together_lp = run_greedy(model, [short, long], 12, block_size=16, chunk=8)
    for i, prompt in enumerate((short, long)):
        alone, alone_lp = run_greedy(model, [prompt], 12, block_size=16, chunk=8)
        assert together[i] == alone[0] and together_lp[i] == alone_lp[0]


def test_seeded_request_is_batch_invariant_on_default_settings():
    """Default settings (dtype auto, the GGUF's own formats): a seeded request samples the same tokens
    alone and as one of 16 requests of different lengths."""
    llm = LLM(enablePrefixCache=False)
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    target = {"prompt_token_ids": list(range(1000, 1040))}
    alone = llm.generate(target, params, use_tqdm=False)[0].outputs[0].token_ids
    gen = torch.Generator().manual_seed(0)
    others = [{"prompt_token_ids": torch.randint(100, 40000, (int(n),), generator=gen).tolist()}
              for n in torch.randint(1, 200, (15,), generator=gen)]
    for position in (0, 7, 15):
        batch = others[:position] + [target] + others[position:]
        per = [SamplingParams(max_tokens=8 + i, temperature=0.8, seed=i) for i in range(15)]
        results = llm.generate(batch, per[:position] + [params] + per[position:], use_tqdm=False)
        assert results[position].outputs[0].token_ids == alone


def test_prompt_form_is_measured_or_forced(monkeypatch):
    """Prompt rows are bf16 only where the kernels have native bf16 dot products; there the faster form
    by the register-only peaks, unless MINDIE_PROMPT_FORM names one; any other value is an error."""
    decide = llama_quant.prompt_rows_in_bf16.__wrapped__
    monkeypatch.setenv("MINDIE_PROMPT_FORM", "int8")
    assert decide() is False
    monkeypatch.setenv("MINDIE_PROMPT_FORM", "bf16")
    assert decide() == _C.qmatmul_bf16_native()
    monkeypatch.setenv("MINDIE_PROMPT_FORM", "fp8")
    with pytest.raises(ValueError, match="bf16 or int8"):
        decide()
    monkeypatch.delenv("MINDIE_PROMPT_FORM")
    assert decide() in ((True, False) if _C.qmatmul_bf16_native() else (False,))
