from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.tiny_models import make_tiny

from mindie import _C


@pytest.fixture(params=_C.available_isas())
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs a test once per kernel variant this build has and this CPU runs."""
    previous = _C.get_isa()
    _C.set_isa(request.param)
    yield request.param
    _C.set_isa(previous)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny-llama"), "llama", 0)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", 1)
