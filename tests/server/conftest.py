import pytest
from helpers.server import RunningServer, local_settings


@pytest.fixture(scope="package")
def tiny_server(tiny_llama_dir):
    """A real server on the tiny random Llama (float32, fast to load) for protocol tests."""
    server = RunningServer(local_settings(str(tiny_llama_dir), dtype="float32", model_name="tiny"))
    yield server
    server.close()
