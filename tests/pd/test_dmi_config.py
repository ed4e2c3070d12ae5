"""inferMode dmi in config.json: the PD keys reach the settings, a missing token or TLS between
P and D stops start-up with a message saying what to set."""

import pytest

from mindie.config_keys import ConfigError
from mindie.server.config import TOKEN_ENV, ServerSettings


def dmi(**server):
    return {"ServerConfig": {"inferMode": "dmi", **server}}


def test_dmi_keys_reach_the_settings(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    raw = dmi(interCommToken="s3cret", interCommPort=2121, interCommTLSEnabled=False)
    raw["BackendConfig"] = {"ModelDeployConfig": {"ModelConfig": [{"kv_trans_timeout": 3}]}}
    s = ServerSettings.from_dict(raw)
    assert (s.dmi, s.inter_comm_port, s.kv_transfer_port, s.kv_trans_timeout_s, s.inter_comm_token) == (
        True, 2121, 2122, 3, "s3cret")
    assert not any("interComm" in k or "kv_trans" in k for k in s.ignored)
    defaults = ServerSettings.from_dict(dmi(interCommToken="t"))
    assert (defaults.inter_comm_port, defaults.kv_trans_timeout_s, defaults.dresult_heartbeat_s) == (1121, 10, 5.0)
    assert not ServerSettings.from_dict({}).dmi


def test_media_hold_limits_reach_the_settings(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    s = ServerSettings.from_dict(dmi(interCommToken="t", pdMediaHoldMB=64, pdMediaHoldSeconds=120))
    assert (s.media_hold_bytes, s.media_hold_s) == (64 * 2**20, 120)
    defaults = ServerSettings.from_dict(dmi(interCommToken="t"))
    assert (defaults.media_hold_bytes, defaults.media_hold_s) == (256 * 2**20, 3600)
    assert "ServerConfig.pdMediaHoldMB" in ServerSettings.from_dict({"ServerConfig": {"pdMediaHoldMB": 8}}).ignored


def test_token_from_the_environment(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    assert ServerSettings.from_dict(dmi(interCommToken="from-file")).inter_comm_token == "from-env"


@pytest.mark.parametrize("raw, words", [
    (dmi(), ["inferMode is dmi", "interCommToken", TOKEN_ENV]),
    (dmi(interCommToken="t", interCommTLSEnabled=True), ["interCommTLSEnabled", "not implemented"]),
    (dmi(interCommToken="t", interCommPort=80), ["ServerConfig.interCommPort", "[1024, 65535]"]),
    ({"ServerConfig": {"inferMode": "pd"}}, ["ServerConfig.inferMode", "dmi"]),
    (dmi(interCommToken="t", pdMediaHoldMB=0), ["ServerConfig.pdMediaHoldMB", "[1, 65536]"]),
    (dmi(interCommToken="t", pdMediaHoldSeconds=86401), ["ServerConfig.pdMediaHoldSeconds", "[1, 86400]"]),
    ({"ServerConfig": {"inferMode": "dmi", "interCommToken": "t"}, "BackendConfig": {"ModelDeployConfig": {
        "ModelConfig": [{"kv_trans_timeout": 0}]}}}, ["kv_trans_timeout", "[1, 3600]"]),
])
def test_bad_dmi_config_says_what_to_set(raw, words, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(ConfigError) as err:
        ServerSettings.from_dict(raw)
    for w in words:
        assert w in str(err.value)
