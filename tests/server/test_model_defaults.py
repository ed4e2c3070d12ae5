"""What a server takes from its model when the config leaves it unset: the served name (GGUF
general.name, the file or directory name; --served-model-name overrides) and the context
(maxSeqLen = the model's context length, at most what the KV cache holds; maxInputTokenLen and
maxIterTimes follow), as every route reports them."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import gguf
import httpx
import pytest
from helpers.server import RunningServer, local_settings

from mindie.cli import _parser, settings_from_args
from mindie.config import EngineConfig
from mindie.config_keys import ConfigError
from mindie.model.loader import DEFAULT_MODEL_NAME, model_name

NAME = "tiny-ctx-4096"  # the directory's name: what the server answers to
CONTEXT = 4096
EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "config.json")


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    """The tiny model, in a directory of its own name, with a 4096-token context."""
    path = tmp_path_factory.mktemp("models") / NAME
    shutil.copytree(tiny_llama_dir, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": CONTEXT}))
    return path


def serve(model_dir: Path, engine: EngineConfig, **changes: object) -> RunningServer:
    """A server whose config sets no model name and, unless `engine` does, no token limit."""
    return RunningServer(replace(local_settings(str(model_dir), dtype="float32", **changes), engine=engine))


def kv_blocks(n: int) -> EngineConfig:
    return EngineConfig(block_size=16, num_kv_blocks=n)


def reported(server: RunningServer) -> dict[str, object]:
    """Every figure the routes report about the model's name and context."""
    card = httpx.get(server.url + "/v1/models").json()["data"][0]
    info = httpx.get(server.management_url + "/info").json()
    config = httpx.get(server.management_url + "/v1/config").json()
    tokenizer = httpx.get(server.url + "/tokenizer_info").json()
    tokenized = httpx.post(server.url + "/tokenize", json={"prompt": "hi"}).json()
    triton = httpx.get(f"{server.url}/v2/models/{card['id']}/config").json()
    return {"id": card["id"], "max_model_len": card["max_model_len"], "max_total_tokens": info["max_total_tokens"],
            "max_input_length": info["max_input_length"], "maxSeqLen": config["maxSeqLen"],
            "maxOutputLen": config["maxOutputLen"], "modelName": config["modelName"],
            "model_max_length": tokenizer["model_max_length"], "tokenize.max_model_len": tokenized["max_model_len"],
            "triton.max_seq_len": triton["max_seq_len"]}


def generate(server: RunningServer, prompt_tokens: int) -> httpx.Response:
    """A prompt of exactly `prompt_tokens` tokens (a byte each, after the BOS token)."""
    return httpx.post(server.url + "/generate", json={"prompt": "a" * (prompt_tokens - 1), "max_tokens": 2,
                                                      "temperature": 0}, timeout=60)


# --- the served name -------------------------------------------------------------------------


def write_gguf(path: Path, general_name: str | None) -> str:
    w = gguf.GGUFWriter(str(path), "llama")
    if general_name is not None:
        w.add_string("general.name", general_name)
    w.add_uint32("llama.context_length", CONTEXT)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_the_name_comes_from_the_model(tmp_path, model_dir):
    assert model_name(write_gguf(tmp_path / "qwen.Q4_0.gguf", "Qwen2.5 7B Instruct")) == "Qwen2.5-7B-Instruct"
    assert model_name(write_gguf(tmp_path / "other.Q4_K_M.gguf", None)) == "other.Q4_K_M"
    assert model_name(write_gguf(tmp_path / "_odd name.gguf", " ?? ")) == "odd-name"
    assert model_name(str(model_dir)) == model_name(f"{model_dir}/") == NAME
    assert model_name(None) == DEFAULT_MODEL_NAME == "SmolLM2-135M-Instruct"  # the embedded model, as ever


def test_served_under_the_derived_name_and_not_the_old_default(model_dir):
    server = serve(model_dir, kv_blocks(64))
    try:
        assert reported(server)["id"] == reported(server)["modelName"] == NAME
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert httpx.post(server.url + "/v1/chat/completions", json={**chat, "model": NAME}).status_code == 200
        assert httpx.get(f"{server.url}/v2/models/{NAME}/ready").status_code == 200
        old = DEFAULT_MODEL_NAME
        assert httpx.post(server.url + "/v1/chat/completions", json={**chat, "model": old}).status_code == 404
        assert httpx.get(f"{server.url}/v1/models/{old}").status_code == 404
        assert httpx.get(f"{server.url}/v2/models/{old}").status_code == 404
        assert httpx.post(f"{server.url}/v2/models/{old}/generate", json={"text_input": "hi"}).status_code == 404
    finally:
        server.close()


def test_served_model_name_overrides_the_config_and_the_model(model_dir, tmp_path):
    config = json.loads(Path(EXAMPLE).read_text())  # modelName SmolLM2-135M-Instruct
    (tmp_path / "config.json").write_text(json.dumps(config))
    for flag in ("--served-model-name", "--model-name"):
        args = _parser().parse_args(["serve", "--config", str(tmp_path / "config.json"), flag, "mine"])
        assert settings_from_args(args).model_name == "mine"
    assert settings_from_args(_parser().parse_args(["serve", "--config", EXAMPLE])).model_name == DEFAULT_MODEL_NAME
    assert settings_from_args(_parser().parse_args(["serve", str(model_dir)])).model_name is None  # the model's
    with pytest.raises(ConfigError, match="--served-model-name"):
        settings_from_args(_parser().parse_args(["serve", "--served-model-name", "bad name"]))
    server = serve(model_dir, kv_blocks(64), model_name="mine")
    try:
        assert reported(server)["id"] == "mine"
        assert httpx.get(f"{server.url}/v1/models/{NAME}").status_code == 404
    finally:
        server.close()


# --- the context -----------------------------------------------------------------------------


def test_context_is_the_models_when_the_kv_cache_holds_it(model_dir, capfd):
    server = serve(model_dir, kv_blocks(512))  # 8192 tokens of KV cache
    try:
        assert (f"context: maxSeqLen {CONTEXT} (the model's context length; the KV cache holds 8192 tokens), "
                f"maxInputTokenLen {CONTEXT - 1}, maxIterTimes 512") in capfd.readouterr().err
        figures = reported(server)
        assert figures == {**figures, "max_model_len": CONTEXT, "max_total_tokens": CONTEXT, "maxSeqLen": CONTEXT,
                           "model_max_length": CONTEXT, "tokenize.max_model_len": CONTEXT,
                           "triton.max_seq_len": CONTEXT, "max_input_length": CONTEXT - 1, "maxOutputLen": 512}
        assert generate(server, 2338).status_code == 200  # smolagents' system prompt; 2560/2048 refused it
        assert generate(server, CONTEXT - 1).status_code == 200
        refused = generate(server, CONTEXT)
        assert refused.status_code == 422 and f"maxSeqLen-1={CONTEXT - 1}" in refused.text
    finally:
        server.close()


def test_context_is_what_the_kv_cache_holds_when_that_is_less(model_dir, capfd):
    server = serve(model_dir, kv_blocks(64))  # 1024 tokens of KV cache
    try:
        assert ("context: maxSeqLen 1024 (what the KV cache holds; the model's context length is 4096; the KV cache "
                "holds 1024 tokens), maxInputTokenLen 1023, maxIterTimes 512") in capfd.readouterr().err
        figures = reported(server)
        assert figures == {**figures, "max_model_len": 1024, "maxSeqLen": 1024, "model_max_length": 1024,
                           "max_input_length": 1023}
        assert generate(server, 1023).status_code == 200
        refused = generate(server, 2338)
        assert refused.status_code == 422 and "maxSeqLen-1=1023" in refused.text
    finally:
        server.close()


def test_a_configured_max_seq_len_wins(model_dir, capfd):
    server = serve(model_dir, EngineConfig(block_size=16, num_kv_blocks=512, max_seq_len=2048, max_iter_times=1024))
    try:
        assert ("context: maxSeqLen 2048 (configured; the model's context length is 4096; the KV cache holds 8192 "
                "tokens), maxInputTokenLen 2047, maxIterTimes 1024") in capfd.readouterr().err
        figures = reported(server)
        assert figures == {**figures, "max_model_len": 2048, "max_input_length": 2047, "maxOutputLen": 1024}
        assert generate(server, 2338).status_code == 422
    finally:
        server.close()


def test_limits_fit_the_model_and_the_kv_cache():
    fitted = EngineConfig().limits(model_context=CONTEXT, kv_tokens=100_000)
    assert (fitted.max_seq_len, fitted.max_input_len, fitted.max_iter_times, fitted.configured) == (
        CONTEXT, CONTEXT - 1, 512, False)
    small = EngineConfig().limits(model_context=CONTEXT, kv_tokens=300)
    assert (small.max_seq_len, small.max_input_token_len, small.max_iter_times) == (300, 299, 300)
    set_ = EngineConfig(max_seq_len=8192, max_input_token_len=100).limits(model_context=CONTEXT, kv_tokens=1000)
    assert (set_.max_seq_len, set_.max_input_len, set_.configured) == (8192, 100, True)
    with pytest.raises(ValueError, match=r"maxIterTimes must be in \[1, maxSeqLen=4096\].*got 5000"):
        EngineConfig(max_iter_times=5000).limits(model_context=CONTEXT, kv_tokens=100_000)
    full = EngineConfig(block_size=16).with_limits(fitted)
    assert (full.max_seq_len, full.max_input_token_len, full.max_iter_times) == (CONTEXT, CONTEXT - 1, 512)


def test_a_max_iter_times_past_the_fitted_context_stops_start_up(model_dir, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"BackendConfig": {"ScheduleConfig": {"maxIterTimes": 5000}}}))
    proc = subprocess.run([sys.executable, "-P", "-m", "mindie", "serve", str(model_dir), "--config", str(config),
                           "--dtype", "float32"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert f"configuration error: maxIterTimes must be in [1, maxSeqLen={CONTEXT}]" in proc.stderr, proc.stderr


# --- memory ------------------------------------------------------------------------------------


def test_start_up_says_the_resident_memory_and_what_it_is_made_of(model_dir, capfd):
    import re

    from mindie.engine.engine import kv_bytes_per_block
    from mindie.server.launcher import memory_line

    server = serve(model_dir, kv_blocks(64))
    try:
        line = next(x for x in capfd.readouterr().err.splitlines() if x.startswith("memory: "))
        pattern = r"memory: resident (\d+) MiB = model file (\d+) MiB \+ KV cache (\d+) MiB \+ (-?\d+) MiB other"
        resident, model, kv, other = map(int, re.fullmatch(pattern, line).groups())
        assert abs(resident - (model + kv + other)) <= 1  # each figure rounded on its own
        engine = server.ctx.engine.engine
        assert kv == round(64 * kv_bytes_per_block(engine.loaded, engine.config.block_size) / 2**20)
        assert engine.kv_cache_bytes == 64 * kv_bytes_per_block(engine.loaded, engine.config.block_size)
    finally:
        server.close()
    assert memory_line(str(model_dir), 0).startswith("resident ")
