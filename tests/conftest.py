from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from helpers.tiny_audio import make_tiny_audio
from helpers.tiny_gguf import write_gguf
from helpers.tiny_idefics3 import TILE, make_tiny_idefics3
from helpers.tiny_models import make_tiny
from helpers.tiny_vl import make_tiny_vl

from mindie import _C
from mindie.model.gguf_header import read_header
from mindie.model.loader import LoadedModel, default_model_path, load_model
from mindie.tokenizer import Tokenizer

# Where the AVX-512 variant runs bf16 work on AMX tiles, it also runs once without them
# ("avx512-noamx"), so both of its forms are tested on such a CPU.
ISA_VARIANTS = _C.available_isas() + (
    ["avx512-noamx"] if "avx512" in _C.available_isas() and _C.cpu_features()["amx_bf16"] else [])


@pytest.fixture(params=ISA_VARIANTS)
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs a test once per kernel variant (and tile form) this build has and this CPU runs."""
    previous = _C.get_isa()
    _C.set_isa(request.param.removesuffix("-noamx"))
    _C.set_amx(not request.param.endswith("-noamx"))
    yield request.param
    _C.set_isa(previous)
    _C.set_amx(True)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny-llama"), "llama", 0)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", 1)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3", 2)


@pytest.fixture(scope="session")
def tiny_qwen3_gguf(tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3 as llama.cpp's converter writes it, matrices in F32 (its exact weights)."""
    return write_gguf(tiny_qwen3_dir, tmp_path_factory.mktemp("gguf") / "tiny-qwen3.gguf")


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny-qwen3-moe"), "qwen3_moe", 3)


@pytest.fixture(scope="session")
def tiny_mixtral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny-mixtral"), "mixtral", 4)


@pytest.fixture(scope="session")
def tiny_qwen3_moe_gguf(tiny_qwen3_moe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3-MoE as llama.cpp's converter writes it (3-D expert tensors), matrices in F32."""
    return write_gguf(tiny_qwen3_moe_dir, tmp_path_factory.mktemp("gguf") / "tiny-qwen3-moe.gguf")


@pytest.fixture(scope="session")
def tiny_mixtral_gguf(tiny_mixtral_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Mixtral as llama.cpp's converter writes it: architecture llama with experts."""
    return write_gguf(tiny_mixtral_dir, tmp_path_factory.mktemp("gguf") / "tiny-mixtral.gguf")


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny-gemma3"), "gemma3", 3)


@pytest.fixture(scope="session")
def tiny_gemma3_gguf(tiny_gemma3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Gemma 3 as llama.cpp's converter writes it (norms stored as 1 + w), matrices in F32."""
    return write_gguf(tiny_gemma3_dir, tmp_path_factory.mktemp("gguf") / "tiny-gemma3.gguf")


@pytest.fixture(scope="session")
def tiny_phi3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny-phi3"), "phi3", 5)


@pytest.fixture(scope="session")
def tiny_phi3_gguf(tiny_phi3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Phi-3 as llama.cpp's converter writes it (attn_qkv, a fused ffn_up, rope factor tensors)."""
    return write_gguf(tiny_phi3_dir, tmp_path_factory.mktemp("gguf") / "tiny-phi3.gguf")


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny-mistral"), "mistral", 6)


@pytest.fixture(scope="session")
def tiny_mistral_gguf(tiny_mistral_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Mistral as llama.cpp's converter writes it (architecture llama, q/k permuted), with
    `llama.attention.sliding_window`, which that converter leaves out."""
    return write_gguf(tiny_mistral_dir, tmp_path_factory.mktemp("gguf") / "tiny-mistral.gguf")


@pytest.fixture(scope="session")
def tiny_qwen2_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_vl(tmp_path_factory.mktemp("tiny-qwen2-vl"), qwen25=False)


@pytest.fixture(scope="session")
def tiny_qwen25_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_vl(tmp_path_factory.mktemp("tiny-qwen2.5-vl"), qwen25=True)


@pytest.fixture(scope="session")
def tiny_idefics3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Images up to 3 x 3 tiles plus the global image."""
    return make_tiny_idefics3(tmp_path_factory.mktemp("tiny-idefics3"), smolvlm=False)


@pytest.fixture(scope="session")
def tiny_smolvlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Images resized to one tile each."""
    return make_tiny_idefics3(tmp_path_factory.mktemp("tiny-smolvlm"), smolvlm=True, longest_edge=TILE)


@pytest.fixture(scope="session")
def tiny_qwen2_audio_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_audio(tmp_path_factory.mktemp("tiny-qwen2-audio"))


# The loaded models below are shared by every test that needs one, loaded once per session: a
# user allocates its own KV cache before it runs the model, so tests in turn never see each other's
# state (a GGUF model runs only with the cache allocated last, which is the running test's).


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_dir: Path) -> LoadedModel:
    """The tiny random Llama in float32: the engine tests' model."""
    return load_model(str(tiny_llama_dir), dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_qwen2_dir: Path) -> LoadedModel:
    return load_model(str(tiny_qwen2_dir), dtype=torch.float32)


def _family_models(family: str) -> tuple[Callable[..., LoadedModel], Callable[..., LoadedModel]]:
    """The fixtures tiny_<family> (its HF directory) and tiny_<family>_from_gguf (its F32 GGUF on
    the exact path, quantization none), float32, one load a session each."""

    @pytest.fixture(scope="session", name=f"tiny_{family}")
    def from_dir(request: pytest.FixtureRequest) -> LoadedModel:
        return load_model(str(request.getfixturevalue(f"tiny_{family}_dir")), dtype=torch.float32)

    @pytest.fixture(scope="session", name=f"tiny_{family}_from_gguf")
    def from_gguf(request: pytest.FixtureRequest) -> LoadedModel:
        path = request.getfixturevalue(f"tiny_{family}_gguf")
        return load_model(str(path), dtype=torch.float32, quantization="none")

    return from_dir, from_gguf


tiny_qwen3, tiny_qwen3_from_gguf = _family_models("qwen3")
tiny_qwen3_moe, tiny_qwen3_moe_from_gguf = _family_models("qwen3_moe")
tiny_mixtral, tiny_mixtral_from_gguf = _family_models("mixtral")
tiny_gemma3, tiny_gemma3_from_gguf = _family_models("gemma3")
tiny_phi3, tiny_phi3_from_gguf = _family_models("phi3")
tiny_mistral, tiny_mistral_from_gguf = _family_models("mistral")


@pytest.fixture(scope="session")
def smollm() -> LoadedModel:
    """The embedded SmolLM2 as served by default (its own weight formats, dtype auto); the test is
    skipped where the build carries no model."""
    try:
        return load_model(default_model_path())
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm_tokenizer() -> Tokenizer:
    """The embedded SmolLM2 tokenizer, from the GGUF header only (no weights are read)."""
    try:
        path = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    fields = read_header(path).fields
    return Tokenizer.from_gguf_metadata({k: v for k, v in fields.items() if k.startswith("tokenizer.")})
