"""The quantized path (GGUF weights in their formats, int8 activations, the C++ step) against the
exact path (the same weights dequantized, float32 torch), on the embedded SmolLM2 and a fixed text."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
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
from mindie.model.moe import EXPERT_PROJECTIONS, expert_name

TEXT = (Path(__file__).parent / "data" / "perplexity.txt").read_text()
# (dtype, prompt-row form): with bfloat16 both forms, whichever the CPU's measured default is (bf16
# only where the CPU has native bf16 dot products).
DTYPE_FORMS = [("float32", "int8"), ("bfloat16", "bf16"), ("bfloat16", "int8")]


def force_prompt_form(monkeypatch: pytest.MonkeyPatch, form: str) -> None:
    monkeypatch.setattr(llama_quant, "prompt_rows_in_bf16",
                        lambda planes=2: form == "bf16" and _C.qmatmul_bf16_native())


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


@pytest.mark.parametrize("dtype,form", DTYPE_FORMS)
def test_one_plane_activations_keep_perplexity_within_one_percent(exact, text_ids, dtype, form, monkeypatch):
    """activation_bits=8 (one int8 plane per row, as llama.cpp): the shipped text's perplexity within 1%
    of the exact path's and its top-1 at 95% of positions (96-98% on a Zen 5, against 99.8-100% with
    two planes); and its logits are not the two-plane ones: they move from them by far more than the
    two-plane ones move from the exact path (the lo plane is really dropped)."""
    force_prompt_form(monkeypatch, form)
    one = load_model(None, dtype, activation_bits=8)
    assert one.model.activation_planes == 1
    want = prompt_logits(exact.model, text_ids)
    got = prompt_logits(one.model, text_ids)
    two = prompt_logits(load_model(None, dtype).model, text_ids)
    assert abs(perplexity(got, text_ids) / perplexity(want, text_ids) - 1) < 0.01
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.95
    assert (got - two).abs().max().item() > 10 * (two - want).abs().mean().item()
    with pytest.raises(ValueError, match=r"activation_bits must be one of \[8, 16\], got 4"):
        load_model(None, dtype, activation_bits=4)


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
def q8_gguf(tmp_path_factory) -> Callable[[Path], Path]:
    """The Q8_0 GGUF of a tiny model's directory (routers F32, as llama.cpp keeps them), written once
    per module."""
    written: dict[Path, Path] = {}

    def get(hf_dir: Path) -> Path:
        if hf_dir not in written:
            out = tmp_path_factory.mktemp("gguf") / f"{hf_dir.name}.Q8_0.gguf"
            written[hf_dir] = write_gguf(hf_dir, out, gguf.GGMLQuantizationType.Q8_0)
        return written[hf_dir]
    return get


@pytest.mark.parametrize("family", ["tiny_qwen3", "tiny_qwen3_moe", "tiny_mixtral", "tiny_phi3", "tiny_mistral"])
@pytest.mark.parametrize("source,quantization", [("gguf", "auto"), ("dir", "q8_0"), ("dir", "q4_0")])
@pytest.mark.parametrize("dtype,form", DTYPE_FORMS)
def test_quantized_follows_the_exact_path(family, q8_gguf, source, quantization, dtype, form, monkeypatch, request):
    """Qwen3 (q/k head norms in the C++ step), Qwen3-MoE and Mixtral (the MoE MLP in it), Phi-3 (its fused
    matrices split by rows of blocks, partial rotary, LongRoPE, the window; prompts past 32), Mistral (its
    window of 10 on every layer, the GGUF's llama.attention.sliding_window) on the C++ step:
    a Q8_0 GGUF kept in its format, and the Hugging Face checkpoint quantized at load. With 8-bit
    weights: greedy-equal to the exact path until a near tie, teacher-forced perplexity within 1% of the
    exact path's and the same top-1 at 95% of positions (Qwen3: 0.36 with the q/k head norms left out)."""
    force_prompt_form(monkeypatch, form)
    exact_model, hf_dir = request.getfixturevalue(family).model, request.getfixturevalue(family + "_dir")
    path = q8_gguf(hf_dir) if source == "gguf" else hf_dir
    quant = load_model(str(path), dtype, quantization)
    assert isinstance(quant.model, QuantizedLlamaModel)
    moe_fields = ("qk_norm", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob")
    assert [getattr(quant.config, f) for f in moe_fields] == [getattr(exact_model.config, f) for f in moe_fields]
    assert [quant.config.is_moe_layer(i) for i in range(quant.config.num_layers)] == [
        exact_model.config.is_moe_layer(i) for i in range(quant.config.num_layers)]
    routers = {"F32"} if quant.config.num_experts else set()  # kept float32, as llama.cpp keeps them
    assert set(quant.model.weight_formats) == {"Q8_0" if quantization == "auto" else quantization.upper()} | routers
    ids = torch.randint(0, quant.config.vocab_size, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    want, got = prompt_logits(exact_model, ids), prompt_logits(quant.model, ids)
    top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    if quantization == "q4_0":  # 4-bit weights move a random model's top-1 often (0.36 without the head norms)
        assert top1 >= 0.5
        return
    assert abs(perplexity(got, ids) / perplexity(want, ids) - 1) < 0.01 and top1 >= 0.95
    prompts = [[1, 2, 3, 4, 5], list(range(40, 77)), list(range(200, 213))]
    assert_greedy_until_a_near_tie(exact_model, quant.model, prompts, 24)


@pytest.mark.parametrize("family", ["tiny_qwen3_moe", "tiny_mixtral"])
def test_batch1_decode_reads_only_the_routed_experts(family, q8_gguf, request):
    """A batch-1 decode step runs, in each MoE layer, exactly the experts transformers routes the row
    to (none in Qwen3-MoE's dense layer); with every other expert's bytes then overwritten (Q8_0 scales
    of NaN), the same step gives the same logits bit for bit: their bytes were never read."""
    from transformers import AutoModelForCausalLM

    hf_dir = request.getfixturevalue(family + "_dir")
    model = load_model(str(q8_gguf(hf_dir)), "float32").model
    config = model.config
    prompt = list(range(40, 60))
    n, block_size, blocks = len(prompt), 16, 4
    caches = model.allocate_kv_cache(blocks, block_size)

    def step(ids: list[int], start: int) -> torch.Tensor:
        positions = torch.arange(start, start + len(ids))
        meta = AttentionMetadata(
            positions=positions, slot_mapping=positions, block_tables=torch.arange(blocks, dtype=torch.int32)[None],
            query_start_loc=torch.tensor([0, len(ids)], dtype=torch.int32),
            seq_lens=torch.tensor([start + len(ids)], dtype=torch.int32), logits_indices=torch.tensor([len(ids) - 1]),
            prompt_lens=torch.tensor([n], dtype=torch.int32))
        return model.forward(torch.tensor(ids), meta, caches)

    token = int(step(prompt, 0).argmax())
    logits = step([token], n)
    ran = model.last_step_experts()
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    routed: dict[int, list[int]] = {}
    for i, layer in enumerate(hf.model.layers):
        if hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts"):  # routers return (logits, weights, ids)
            layer.mlp.gate.register_forward_hook(
                lambda _m, _args, out, i=i: routed.__setitem__(i, sorted(out[2][-1].tolist())))
    with torch.no_grad():
        hf(torch.tensor([prompt + [token]]))
    assert len(ran) == config.num_layers
    for layer, experts in enumerate(ran):
        if not config.is_moe_layer(layer):
            assert experts == [] and layer not in routed
            continue
        assert experts == routed[layer] and len(experts) == config.num_experts_per_tok < config.num_experts
        for expert in set(range(config.num_experts)) - set(experts):
            for projection in EXPERT_PROJECTIONS:
                model.matrices[expert_name(layer, expert, projection)].data.fill_(0xFF)
    again = step([token], n)
    assert torch.isfinite(logits).all() and torch.equal(again, logits)


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


@pytest.mark.parametrize("family", [None, "tiny_qwen3_moe", "tiny_mixtral", "tiny_phi3"])
@pytest.mark.parametrize("dtype,form", DTYPE_FORMS)
@pytest.mark.parametrize("activation_bits", [16, 8])
def test_prompt_and_generated_rows_keep_their_bits_in_mixed_steps(family, dtype, form, activation_bits, q8_gguf,
                                                                  monkeypatch, request):
    """In 8-token chunks, the short prompt decodes while the long one is still prefilling (in the bf16
    form, its rows take the bf16 path beside the other's int8 decode row): each sequence's tokens and
    log-probabilities are the same bits as when it runs alone. On the embedded SmolLM2 and on the MoE
    models' Q8_0 GGUFs (there the rows also share experts), with two activation planes and one."""
    force_prompt_form(monkeypatch, form)
    path = None if family is None else str(q8_gguf(request.getfixturevalue(family + "_dir")))
    model = load_model(path, dtype, activation_bits=activation_bits).model
    vocab = model.config.vocab_size
    short, long = [i % vocab for i in range(1000, 1005)], [i % vocab for i in range(2000, 2037)]
    together, together_lp = run_greedy(model, [short, long], 12, block_size=16, chunk=8)
    for i, prompt in enumerate((short, long)):
        alone, alone_lp = run_greedy(model, [prompt], 12, block_size=16, chunk=8)
        assert together[i] == alone[0] and together_lp[i] == alone_lp[0]


@pytest.mark.parametrize("activation_bits", [16, 8])
def test_seeded_request_is_batch_invariant_on_default_settings(activation_bits):
    """Default settings (dtype auto, the GGUF's own formats), and with one activation plane: a seeded
    request samples the same tokens alone and as one of 16 requests of different lengths."""
    llm = LLM(activation_bits=activation_bits, enablePrefixCache=False)
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


@pytest.mark.parametrize("isa", [i for i in _C.available_isas() if i != "scalar"])
def test_int8_prompt_instruction_is_the_prompt_tiles_product(isa):
    """One plane: a byte tile's vpdpbusd with VNNI, else vpmaddubsw; two planes: one int16 product per
    weight (vpdpwssd with VNNI, else vpmaddwd)."""
    pick = llama_quant.int8_prompt_instruction
    vnni = _C.cpu_features()[{"avx512": "avx512_vnni", "avx2": "avx_vnni"}[isa]]
    previous = _C.get_isa()
    try:
        _C.set_isa(isa)
        assert (pick(1), pick(2)) == (("vpdpbusd", "vpdpwssd") if vnni else ("vpmaddubsw", "vpmaddwd"))
        assert (pick(1, vnni=False), pick(2, vnni=False)) == ("vpmaddubsw", "vpmaddwd")
    finally:
        _C.set_isa(previous)
