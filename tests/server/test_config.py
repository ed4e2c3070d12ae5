"""MindIE config.json: known keys with ranges, start-up refused with a message naming the key."""

import json
from pathlib import Path

import pytest

from mindie.cli import _parser, settings_from_args
from mindie.config import EngineConfig
from mindie.config_keys import ConfigError
from mindie.server.config import ServerSettings

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "config.json")


def test_example_config_loads_with_mindie_defaults():
    s = ServerSettings.from_file(EXAMPLE)
    assert (s.host, s.port, s.management_host, s.management_port, s.metrics_port) == (
        "127.0.0.1", 1025, "127.0.0.2", 1026, 1027)
    assert s.tls is None and s.model_path is None and s.model_name == "SmolLM2-135M-Instruct"
    assert s.engine.block_size == 128 and s.engine.max_seq_len == 2560 and s.engine.kv_cache_mem_gb == 2
    assert "BackendConfig.npuDeviceIds" in s.ignored


def _with(**server):
    raw = json.load(open(EXAMPLE))
    raw["ServerConfig"].update(server)
    return raw


@pytest.mark.parametrize("raw, words", [
    (_with(port=80), ["ServerConfig.port", "[1024, 65535]"]),
    (_with(maxLinkNum=0), ["ServerConfig.maxLinkNum", "[1, 4096]"]),
    (_with(tokenTimeout="600"), ["ServerConfig.tokenTimeout", "int"]),
    (_with(colour="blue"), ["unknown config key ServerConfig.colour"]),
    (_with(ipAddress="0.0.0.0"), ["allowAllZeroIpListening"]),
    (_with(ipAddress="localhost"), ["ServerConfig.ipAddress", "IPv4"]),
    (_with(httpsEnabled=True, tlsCert="missing.pem", tlsPk="missing.key"), ["does not exist"]),
    (_with(httpsEnabled=True, tlsCert="a.pem", tlsPk="a.key", tlsCaFile=[], tlsCrlFiles=["crl.pem"]),
     ["tlsCrlFiles", "tlsCaFile"]),
    ({"BackendConfig": {"ScheduleConfig": {"cacheBlockSize": 256}}}, ["ScheduleConfig.cacheBlockSize", "[1, 128]"]),
    ({"BackendConfig": {"ScheduleConfig": {"maxIterTimes": 5000}, "ModelDeployConfig": {"maxSeqLen": 2560}}},
     ["maxIterTimes", "maxSeqLen=2560"]),
    ({"BackendConfig": {"ModelDeployConfig": {"ModelConfig": [{"modelName": "-bad"}]}}}, ["modelName"]),
    ({"BackendConfig": {"ModelDeployConfig": {"ModelConfig": [{}, {}]}}}, ["exactly 1 model"]),
    ({"BackendConfig": {"ModelDeployConfig": {"ModelConfig": [{"activationBits": 4}]}}},
     ["ModelConfig[0].activationBits must be one of [16, 8], got 4"]),
])
def test_bad_config_names_the_key_and_range(raw, words):
    with pytest.raises(ConfigError) as err:
        ServerSettings.from_dict(raw)
    for w in words:
        assert w in str(err.value)


def test_zero_address_allowed_when_configured():
    s = ServerSettings.from_dict(_with(ipAddress="0.0.0.0", allowAllZeroIpListening=True))
    assert s.host == "0.0.0.0"


def test_cli_flags_override_the_config(tmp_path):
    args = _parser().parse_args(["serve", "model.gguf", "--config", EXAMPLE, "--port", "2025", "--api-key", "k"])
    s = settings_from_args(args)
    assert (s.port, s.api_key, s.model_path, s.management_port) == (2025, "k", "model.gguf", 1026)
    assert s.activation_bits == 16


def test_activation_bits_come_from_the_config_or_the_flag(tmp_path):
    raw = json.load(open(EXAMPLE))
    raw["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["activationBits"] = 8
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    assert settings_from_args(_parser().parse_args(["serve", "--config", str(path)])).activation_bits == 8
    flag = _parser().parse_args(["serve", "--config", str(path), "--activation-bits", "16"])
    assert settings_from_args(flag).activation_bits == 16
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--activation-bits", "12"])


def test_prefill_chunk_size_is_the_step_budget_within_max_prefill_tokens():
    schedule = {"maxPrefillTokens": 4096, "prefillChunkSize": 1024}
    settings = ServerSettings.from_dict({"BackendConfig": {"ScheduleConfig": schedule}})
    assert not any("prefillChunkSize" in key for key in settings.ignored)
    engine = settings.engine
    assert engine.step_tokens == 1024 and engine.scheduler_config().step_tokens == 1024
    assert EngineConfig().step_tokens == 512 and EngineConfig(max_prefill_tokens=64).step_tokens == 64
    with pytest.raises(ConfigError, match=r"prefillChunkSize must be in \[1, maxPrefillTokens=4096\], got 4097"):
        ServerSettings.from_dict({"BackendConfig": {"ScheduleConfig": {**schedule, "prefillChunkSize": 4097}}})


def test_schedule_keys_reach_the_server():
    s = ServerSettings.from_dict({"BackendConfig": {"ScheduleConfig": {"maxN": 4, "maxQueueDelayMicroseconds": 1000}}})
    assert s.max_n == 4 and s.queue_delay_s == 0.001
    assert "ServerConfig.openAiSupport" in ServerSettings.from_dict(_with(openAiSupport="vllm")).ignored


@pytest.mark.parametrize("key, field, value, words", [
    ("maxSeqLen", "max_seq_len", 1, "maxSeqLen must be in [2, 2147483647], got 1"),
    ("maxPrefillTokens", "max_prefill_tokens", 0, "maxPrefillTokens must be in [1, 4194304], got 0"),
    ("maxSeqLen", "max_seq_len", 1.5, "maxSeqLen must be an integer in [2, 2147483647], got 1.5"),
    ("prefillChunkSize", "prefill_chunk_size", 0, "prefillChunkSize must be in [1, 4194304], got 0"),
])
def test_an_engine_key_is_refused_alike_by_config_json_and_the_engine(key, field, value, words):
    """One checker: config.json's ModelDeployConfig/ScheduleConfig and EngineConfig share each key's Key."""
    section = "ModelDeployConfig" if key == "maxSeqLen" else "ScheduleConfig"
    raw = {"BackendConfig": {section: {key: value}}}
    with pytest.raises(ConfigError) as from_file:
        ServerSettings.from_dict(raw)
    with pytest.raises(ConfigError) as from_engine:
        EngineConfig(**{field: value})
    assert str(from_file.value) == f"{section}.{words}"
    assert str(from_engine.value) == words
