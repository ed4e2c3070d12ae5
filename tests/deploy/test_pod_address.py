"""An instance's own address in a pod: MindIE's MIES_CONTAINER_IP / MIES_CONTAINER_MANAGEMENT_IP
(the pod IP, from the downward API) override config.json, so one ConfigMap serves every replica;
a dmi instance cannot use an unspecified address, since P and D give each other that address."""

from __future__ import annotations

from pathlib import Path

import pytest

from mindie.cli import _parser, settings_from_args
from mindie.server.config import (
    CONTAINER_IP_ENV,
    CONTAINER_MANAGEMENT_IP_ENV,
    TOKEN_ENV,
    ConfigError,
    ServerSettings,
)

DMI = {"ServerConfig": {"inferMode": "dmi", "interCommToken": "t", "ipAddress": "127.0.0.1",
                        "managementIpAddress": "127.0.0.1"}}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (CONTAINER_IP_ENV, CONTAINER_MANAGEMENT_IP_ENV, TOKEN_ENV):
        monkeypatch.delenv(name, raising=False)


def test_the_container_address_overrides_the_file(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ServerSettings.from_dict(DMI).host == "127.0.0.1"
    monkeypatch.setenv(CONTAINER_IP_ENV, "10.244.1.7")
    monkeypatch.setenv(CONTAINER_MANAGEMENT_IP_ENV, "10.244.1.8")
    s = ServerSettings.from_dict(DMI)
    assert (s.host, s.management_host) == ("10.244.1.7", "10.244.1.8")


def test_a_flag_overrides_the_container_address(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "config.json"
    config.write_text('{"ServerConfig": {"inferMode": "dmi", "interCommToken": "t"}}')
    monkeypatch.setenv(CONTAINER_IP_ENV, "10.244.1.7")
    s = settings_from_args(_parser().parse_args(["serve", "--config", str(config), "--host", "10.0.0.9"]))
    assert s.host == "10.0.0.9"


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_dmi_needs_an_address_its_peers_can_reach(host: str, monkeypatch: pytest.MonkeyPatch) -> None:
    raw = {"ServerConfig": {**DMI["ServerConfig"], "ipAddress": host, "allowAllZeroIpListening": True}}
    with pytest.raises(ConfigError, match=f"ServerConfig.ipAddress is {host}.*{CONTAINER_IP_ENV}"):
        ServerSettings.from_dict(raw)
    monkeypatch.setenv(CONTAINER_IP_ENV, "10.244.1.7")
    assert ServerSettings.from_dict(raw).host == "10.244.1.7"
    standard = {"ServerConfig": {"ipAddress": host, "allowAllZeroIpListening": True}}
    monkeypatch.delenv(CONTAINER_IP_ENV)
    assert ServerSettings.from_dict(standard).host == host  # one instance may listen everywhere
