"""`ms_coordinator.json`: MindIE MS's coordinator configuration, checked key by key.

Every key of MindIE's shipped file is known here with its type, range and default (mindie-api.md
section 7.1); an unknown key or a value out of range stops start-up with a message naming the key.
Ports are strings in MindIE's file ("1025"): a digit string or an integer is accepted. Keys that
have no effect here (thread counts, perf statistics, logging, etcd backup, the DIGS cost knobs) are
accepted so that a MindIE file loads unchanged, and listed by `CoordinatorConfig.ignored`.

One section is ours: `instances`, the static P/D list that stands in for MindIE's controller.
Each entry is `{"role": "prefill"|"decode", "ip", "port", "mgmt_port", "metrics_port"?,
"inter_comm_port"?, "mgmt_ip"?, "id"?}`: `port` is the business port (inference routes and, on a D,
`/dresult`), `mgmt_port` the management port (`/v1/role/*`, `/v1/status`, `/v1/config`),
`metrics_port` the Prometheus port (default `mgmt_port`), `inter_comm_port` the P<->D port put in
`d-target` (omitted: a bare IP, P uses its default), `mgmt_ip` defaults to `ip`, `id` to the entry's
index. `ip` and `mgmt_ip` are IP addresses or DNS names (a StatefulSet pod's stable name on
Kubernetes): the coordinator resolves a name to an IPv4 address itself and sends instances only
addresses (P accepts nothing else in `d-target`), see `instances.py`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from mindie.config_keys import ConfigError, Key, check_section


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


def _port(default: int) -> Key:
    return Key("port", str(default), 1024, 65535)


_SECTIONS: dict[str, dict[str, Key]] = {
    "http_config": {
        "allow_all_zero_ip_listening": Key("bool", False),
        "predict_ip": Key("ip", "127.0.0.1"), "predict_port": _port(1025),
        "manage_ip": Key("ip", "127.0.0.1"), "manage_port": _port(1026),
        "alarm_port": Key("port", "1027", 1024, 65535, honoured=False),  # alarms go to a controller we have none of
        "external_port": _port(1028), "status_port": _port(1029),
        "server_thread_num": Key("int", 10, 1, 10000, honoured=False),  # one event loop serves every listener
        "client_thread_num": Key("int", 10, 1, 10000, honoured=False),
        "http_timeout_seconds": Key("int", 600, 0, 3600),
        "keep_alive_seconds": Key("int", 180, 0, 3600),
        "server_name": Key("str", "MindIE-MS"),
        "user_agent": Key("str", "Coordinator/1.0"),
    },
    "request_limit": {
        "single_node_max_requests": Key("int", 1000, 1, 15000),  # the docs say 2000, the code accepts 15000
        "max_requests": Key("int", 10000, 1, 90000),
        "body_limit": Key("int", 1, 1, 20),
    },
    "metrics_config": {
        "enable": Key("bool", False, honoured=False),
        "trigger_size": Key("int", 100, 1, 10000, honoured=False),
    },
    "prometheus_metrics_config": {"reuse_time": Key("int", 3, 1, 100)},
    "exception_config": {
        "max_retry": Key("int", 5, 0, 10),
        "schedule_timeout": Key("int", 600, 0, 65535),
        "first_token_timeout": Key("int", 600, 0, 65535),
        "infer_timeout": Key("int", 600, 0, 65535),
        "tokenizer_timeout": Key("int", 300, 0, 3600),
    },
    "log_info": {
        "log_level": Key("str", "INFO", choices=("DEBUG", "INFO", "WARN", "WARNING", "ERROR", "CRITICAL")),
        "to_file": Key("bool", True, honoured=False), "to_stdout": Key("bool", True, honoured=False),
        "run_log_path": Key("str", "", honoured=False), "operation_log_path": Key("str", "", honoured=False),
        "max_log_str_size": Key("int", 4096, 1, 2**31 - 1, honoured=False),
        "max_log_file_size": Key("int", 20, 1, 2**31 - 1, honoured=False),
        "max_log_file_num": Key("int", 10, 1, 2**31 - 1, honoured=False),
    },
    "digs_scheduler_config": {
        "deploy_mode": Key("str", "pd_separate", choices=(
            "pd_separate", "pd_disaggregation", "pd_disaggregation_single_container", "single_node")),
        "scheduler_type": Key("str", "digs_scheduler", choices=("digs_scheduler", "default_scheduler")),
        "algorithm_type": Key("str", "load_balance", choices=("load_balance", "cache_affinity", "round_robin")),
        "cache_size": Key("numstr", "100", 1, 2**31 - 1, honoured=False),
        "slots_thresh": Key("numstr", "0.05", 0, 1, honoured=False),
        "block_thresh": Key("numstr", "0.05", 0, 1, honoured=False),
        "max_schedule_count": Key("numstr", "10000", 1, 90000, honoured=False),
        "reordering_type": Key("str", "1", choices=("1", "2", "3"), honoured=False),
        "max_res_num": Key("numstr", "5000", 1, 2**31 - 1, honoured=False),
        "res_limit_rate": Key("numstr", "1.1", 0, 2000, honoured=False),
        "select_type": Key("str", "2", choices=("1", "2"), honoured=False),
        "load_cost_values": Key("str", "1, 0", honoured=False),
        "load_cost_coefficient": Key("str", "0, 0.22, 1024, 24, 6, 0, 1, 0, 1", honoured=False),
    },
    "backup_config": {
        "database_server_dns": Key("str", "etcd.default.svc.cluster.local", honoured=False),
        "database_server_port": Key("port", "2379", 1, 65535, honoured=False),
        "function_enable": Key("bool", False, choices=(False,)),
    },
}
_TOP: dict[str, Key] = {"string_token_rate": Key("num", 4.02, 1, 100, honoured=False)}
_TLS_PARTS = ("controller_server", "request_server", "mindie_client", "mindie_mangment", "external", "status",
              "etcd_server", "alarm_client")
_TLS_ITEMS = ("ca_cert", "tls_cert", "tls_key", "tls_passwd", "tls_crl")
_INSTANCE_KEYS = {"role", "ip", "port", "mgmt_port", "metrics_port", "inter_comm_port", "mgmt_ip", "id"}


@dataclass(frozen=True)
class InstanceSpec:
    """One `instances` entry. As loaded, `ip` and `mgmt_ip` may be DNS names; the registry's copy
    (`Instance.spec`) carries the addresses they last resolved to."""

    id: int
    role: Role
    ip: str
    port: int
    mgmt_ip: str
    mgmt_port: int
    metrics_port: int
    inter_comm_port: int | None = None

    @property
    def d_target(self) -> str:
        """What P reads from the `d-target` header: `ip` or `ip;interCommPort`."""
        return self.ip if self.inter_comm_port is None else f"{self.ip};{self.inter_comm_port}"

    @property
    def name(self) -> str:
        return f"{self.role.value} {self.ip}:{self.port}"


@dataclass(frozen=True)
class CoordinatorConfig:
    predict_ip: str = "127.0.0.1"
    predict_port: int = 1025
    manage_ip: str = "127.0.0.1"
    manage_port: int = 1026
    external_port: int = 1028
    status_port: int = 1029
    allow_all_zero_ip_listening: bool = False
    http_timeout_s: float = 600
    keep_alive_s: float = 180
    server_name: str = "MindIE-MS"
    user_agent: str = "Coordinator/1.0"
    single_node_max_requests: int = 1000
    max_requests: int = 10000
    body_limit_bytes: int = 2**20
    metrics_reuse_s: float = 3
    max_retry: int = 5
    schedule_timeout_s: float = 600  # 0 turns a timeout off
    first_token_timeout_s: float = 600
    infer_timeout_s: float = 600
    tokenizer_timeout_s: float = 300
    algorithm: str = "load_balance"  # round_robin, load_balance or cache_affinity
    log_level: str = "INFO"
    instances: tuple[InstanceSpec, ...] = ()
    ignored: tuple[str, ...] = field(default=(), compare=False)

    @classmethod
    def from_file(cls, path: str) -> CoordinatorConfig:
        with open(path, encoding="utf-8") as f:
            try:
                raw = json.load(f)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path} is not valid JSON: {exc}") from None
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: Any) -> CoordinatorConfig:
        if not isinstance(raw, dict):
            raise ConfigError("ms_coordinator.json must hold a JSON object")
        unknown = sorted(set(raw) - set(_SECTIONS) - set(_TOP) - {"tls_config", "instances"})
        if unknown:
            raise ConfigError(f"unknown key {unknown[0]!r} in ms_coordinator.json (known: "
                              f"{', '.join(sorted([*_SECTIONS, *_TOP, 'tls_config', 'instances']))})")
        ignored: list[str] = []
        v: dict[str, dict[str, Any]] = {}
        for name, keys in _SECTIONS.items():
            v[name] = check_section(name, raw.get(name, {}), keys, ignored)
        check_section("", {k: raw[k] for k in _TOP if k in raw}, _TOP, ignored)  # checked; feeds no cost model here
        _check_tls(raw.get("tls_config", {}))
        http, limits, exc, digs = v["http_config"], v["request_limit"], v["exception_config"], v[
            "digs_scheduler_config"]
        for key in ("predict_ip", "manage_ip"):
            if http[key] in ("0.0.0.0", "::") and not http["allow_all_zero_ip_listening"]:
                raise ConfigError(f"http_config.{key} is {http[key]}: listening on every address needs "
                                  "http_config.allow_all_zero_ip_listening = true")
        if digs["deploy_mode"] == "single_node":
            raise ConfigError("digs_scheduler_config.deploy_mode 'single_node' (PD-mixed instances behind the "
                              "coordinator) is not supported; use 'pd_separate'")
        # MindIE documents cache_affinity for single_node only; here digs_scheduler routes P by it in PD
        algorithm = digs["algorithm_type"]
        if digs["scheduler_type"] == "default_scheduler":
            algorithm = "round_robin"  # as MindIE: default_scheduler with a PD deploy mode is round robin
        ports = {k: http[k] for k in ("predict_port", "manage_port", "external_port", "status_port")}
        listeners = {(http["predict_ip"], ports["predict_port"]): "predict_port"}
        for key in ("manage_port", "external_port", "status_port"):
            other = listeners.setdefault((http["manage_ip"], ports[key]), key)
            if other != key:
                raise ConfigError(f"http_config.{key} equals http_config.{other} ({ports[key]}) on the same address")
        return cls(
            predict_ip=http["predict_ip"], predict_port=ports["predict_port"], manage_ip=http["manage_ip"],
            manage_port=ports["manage_port"], external_port=ports["external_port"], status_port=ports["status_port"],
            allow_all_zero_ip_listening=http["allow_all_zero_ip_listening"],
            http_timeout_s=http["http_timeout_seconds"], keep_alive_s=http["keep_alive_seconds"],
            server_name=http["server_name"], user_agent=http["user_agent"],
            single_node_max_requests=limits["single_node_max_requests"], max_requests=limits["max_requests"],
            body_limit_bytes=limits["body_limit"] * 2**20,
            metrics_reuse_s=v["prometheus_metrics_config"]["reuse_time"],
            max_retry=exc["max_retry"], schedule_timeout_s=exc["schedule_timeout"],
            first_token_timeout_s=exc["first_token_timeout"], infer_timeout_s=exc["infer_timeout"],
            tokenizer_timeout_s=exc["tokenizer_timeout"], algorithm=algorithm,
            log_level=v["log_info"]["log_level"], instances=parse_instances(raw.get("instances", [])),
            ignored=tuple(ignored),
        )


def _check_tls(tls: Any) -> None:
    """TLS is not implemented in the coordinator yet: its keys load, but a part switched on is refused
    rather than silently served in plain text. MindIE's default is on, ours off."""
    if not isinstance(tls, dict):
        raise ConfigError(f"tls_config must be an object, got {tls!r}")
    for key, value in tls.items():
        part, _, what = key.rpartition("_tls_")
        if part not in _TLS_PARTS or what not in ("enable", "items"):
            raise ConfigError(f"unknown key tls_config.{key}")
        if what == "enable":
            if not isinstance(value, bool):
                raise ConfigError(f"tls_config.{key} must be true or false, got {value!r}")
            if value:
                raise ConfigError(f"tls_config.{key} is true, but this coordinator does not implement TLS yet: "
                                  "set it to false")
        elif not isinstance(value, dict) or set(value) - set(_TLS_ITEMS):
            raise ConfigError(f"tls_config.{key} must be an object with keys {', '.join(_TLS_ITEMS)}")


def parse_instances(raw: Any) -> tuple[InstanceSpec, ...]:
    if not isinstance(raw, list):
        raise ConfigError(f"instances must be a list of instance objects, got {raw!r}")
    specs: list[InstanceSpec] = []
    for i, entry in enumerate(raw):
        path = f"instances[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{path} must be an object, got {entry!r}")
        unknown = sorted(set(entry) - _INSTANCE_KEYS)
        if unknown:
            raise ConfigError(f"unknown key {path}.{unknown[0]} (known: {', '.join(sorted(_INSTANCE_KEYS))})")
        for key in ("role", "ip", "port", "mgmt_port"):
            if key not in entry:
                raise ConfigError(f"{path}.{key} is required")
        if entry["role"] not in ("prefill", "decode"):
            raise ConfigError(f"{path}.role must be 'prefill' or 'decode', got {entry['role']!r}")
        ip = Key("host", "").parse(f"{path}.ip", entry["ip"])
        port = _port(0).parse(f"{path}.port", entry["port"])
        mgmt_port = _port(0).parse(f"{path}.mgmt_port", entry["mgmt_port"])
        specs.append(InstanceSpec(
            id=Key("int", 0, 0, 2**63 - 1).parse(f"{path}.id", entry.get("id", i)),
            role=Role(entry["role"]), ip=ip, port=port,
            mgmt_ip=Key("host", "").parse(f"{path}.mgmt_ip", entry.get("mgmt_ip", ip)),
            mgmt_port=mgmt_port,
            metrics_port=_port(0).parse(f"{path}.metrics_port", entry.get("metrics_port", mgmt_port)),
            inter_comm_port=(_port(0).parse(f"{path}.inter_comm_port", entry["inter_comm_port"])
                             if "inter_comm_port" in entry else None),
        ))
    ids = [s.id for s in specs]
    duplicate = next((i for i in ids if ids.count(i) > 1), None)
    if duplicate is not None:
        raise ConfigError(f"instances: id {duplicate} is used twice")
    addresses = [(s.ip, s.port) for s in specs]
    twice = next((a for a in addresses if addresses.count(a) > 1), None)
    if twice is not None:
        raise ConfigError(f"instances: {twice[0]}:{twice[1]} is listed twice")
    return tuple(specs)
