from __future__ import annotations

import pytest

from mindie.model.gguf_header import read_header
from mindie.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def smollm_tokenizer() -> Tokenizer:
    """The embedded SmolLM2 tokenizer, from the GGUF header only (no weights are read)."""
    from mindie.model.loader import default_model_path

    try:
        path = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    fields = read_header(path).fields
    return Tokenizer.from_gguf_metadata({k: v for k, v in fields.items() if k.startswith("tokenizer.")})
