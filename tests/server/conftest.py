from dataclasses import replace

import pytest
from helpers.server import RunningServer, local_settings

from mindie.config import EngineConfig


@pytest.fixture(scope="package")
def tiny_server(tiny_llama_dir):
    """A real server on the tiny random Llama (float32, fast to load) for protocol tests."""
    server = RunningServer(local_settings(str(tiny_llama_dir), dtype="float32", model_name="tiny"))
    yield server
    server.close()


@pytest.fixture(scope="package")
def smol_server():
    """A real server on the embedded SmolLM2 (bf16), for tests that need a model that can talk."""
    settings = local_settings(None)
    server = RunningServer(replace(settings, engine=EngineConfig(num_kv_blocks=96, max_seq_len=1024,
                                                                 max_iter_times=512)))
    yield server
    server.close()
