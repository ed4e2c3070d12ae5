"""A prefill and a decode server on the tiny random Llama, each on its own free ports of
127.0.0.1, sharing a token, plus a single mixed instance to compare with."""

from __future__ import annotations

import pytest
from helpers.pd import dmi_settings, pd_pair_of
from helpers.server import RunningServer, local_settings


@pytest.fixture(scope="package")
def single(tiny_llama_dir):
    server = RunningServer(local_settings(str(tiny_llama_dir), dtype="float32", model_name="tiny"))
    yield server
    server.close()


@pytest.fixture(scope="package")
def pd_pair(tiny_llama_dir):
    yield from pd_pair_of(dmi_settings(tiny_llama_dir), dmi_settings(tiny_llama_dir))
