"""ms_coordinator.json: MindIE's keys and defaults, our static instance list, and errors that name
the key."""

from __future__ import annotations

import json

import pytest

from mindie.config_keys import ConfigError
from mindie.coordinator.config import CoordinatorConfig, Role

# MindIE's shipped ms_coordinator.json (MOTOR:mindie_motor/src/config/ms_coordinator.json), with TLS
# switched off (not implemented here) and two of its tls_items kept to show they load.
SHIPPED = {
    "http_config": {"allow_all_zero_ip_listening": False, "predict_ip": "127.0.0.1", "predict_port": "1025",
                    "manage_ip": "127.0.0.1", "manage_port": "1026", "alarm_port": "1027", "external_port": "1028",
                    "status_port": "1029", "server_thread_num": 10, "client_thread_num": 10,
                    "http_timeout_seconds": 600, "keep_alive_seconds": 180, "server_name": "MindIE-MS",
                    "user_agent": "Coordinator/1.0"},
    "request_limit": {"single_node_max_requests": 1000, "max_requests": 10000, "body_limit": 1},
    "metrics_config": {"enable": False, "trigger_size": 100},
    "prometheus_metrics_config": {"reuse_time": 3},
    "exception_config": {"max_retry": 5, "schedule_timeout": 600, "first_token_timeout": 600, "infer_timeout": 600,
                         "tokenizer_timeout": 300},
    "log_info": {"log_level": "INFO", "to_file": True, "to_stdout": True,
                 "run_log_path": "./logs/ms_coordinator_run_log.txt",
                 "operation_log_path": "./logs/ms_coordinator_operation_log.txt", "max_log_str_size": 4096,
                 "max_log_file_size": 20, "max_log_file_num": 10},
    "digs_scheduler_config": {"deploy_mode": "pd_separate", "scheduler_type": "digs_scheduler",
                              "algorithm_type": "load_balance", "cache_size": "100", "slots_thresh": "0.05",
                              "block_thresh": "0.05", "max_schedule_count": "10000", "reordering_type": "1",
                              "max_res_num": "5000", "res_limit_rate": "1.1", "select_type": "2",
                              "load_cost_values": "1, 0", "load_cost_coefficient": "0, 0.22, 1024, 24, 6, 0, 1, 0, 1"},
    "string_token_rate": 4.02,
    "tls_config": {"controller_server_tls_enable": False, "request_server_tls_enable": False,
                   "request_server_tls_items": {"ca_cert": "./ca.pem", "tls_cert": "./cert.pem", "tls_key": "./k.pem",
                                                "tls_passwd": "./p.txt", "tls_crl": ""},
                   "mindie_client_tls_enable": False, "mindie_mangment_tls_enable": False,
                   "external_tls_enable": False, "status_tls_enable": False, "etcd_server_tls_enable": False,
                   "alarm_client_tls_enable": False},
    "backup_config": {"database_server_dns": "etcd.default.svc.cluster.local", "database_server_port": 2379,
                      "function_enable": False},
}
INSTANCES = [{"role": "prefill", "ip": "127.0.0.2", "port": 1025, "mgmt_port": 1026, "inter_comm_port": 1121},
             {"role": "decode", "ip": "127.0.0.3", "port": "1025", "mgmt_port": 1026, "metrics_port": 1027}]


def test_the_shipped_file_gives_the_defaults() -> None:
    cfg = CoordinatorConfig.from_dict(SHIPPED)
    assert cfg == CoordinatorConfig()  # every default is MindIE's
    assert CoordinatorConfig.from_dict({}) == cfg
    assert (cfg.predict_port, cfg.manage_port, cfg.external_port, cfg.status_port) == (1025, 1026, 1028, 1029)
    assert (cfg.max_requests, cfg.single_node_max_requests, cfg.body_limit_bytes) == (10000, 1000, 2**20)
    assert (cfg.schedule_timeout_s, cfg.first_token_timeout_s, cfg.infer_timeout_s, cfg.max_retry) == (
        600, 600, 600, 5)
    assert cfg.algorithm == "load_balance"
    assert "digs_scheduler_config.load_cost_coefficient" in cfg.ignored
    assert "http_config.predict_port" not in cfg.ignored


def test_instances() -> None:
    cfg = CoordinatorConfig.from_dict({"instances": INSTANCES})
    p, d = cfg.instances
    assert (p.id, p.role, p.d_target, p.metrics_port, p.mgmt_ip) == (0, Role.PREFILL, "127.0.0.2;1121", 1026,
                                                                     "127.0.0.2")
    assert (d.id, d.role, d.port, d.d_target, d.metrics_port) == (1, Role.DECODE, 1025, "127.0.0.3", 1027)


def test_instances_may_be_dns_names() -> None:
    names = ["mindie-decode-0.mindie-decode.mindie.svc.cluster.local", "localhost", "P0", "node-7.", "a" * 63]
    cfg = CoordinatorConfig.from_dict({"instances": [{**INSTANCES[1], "ip": name, "id": i}
                                                     for i, name in enumerate(names)]})
    assert [(d.ip, d.mgmt_ip, d.d_target) for d in cfg.instances] == [(n, n, n) for n in names]


def test_default_scheduler_is_round_robin() -> None:
    cfg = CoordinatorConfig.from_dict({"digs_scheduler_config": {"scheduler_type": "default_scheduler"}})
    assert cfg.algorithm == "round_robin"


def test_cache_affinity_is_taken() -> None:
    cfg = CoordinatorConfig.from_dict({"digs_scheduler_config": {"algorithm_type": "cache_affinity"}})
    assert cfg.algorithm == "cache_affinity"


@pytest.mark.parametrize("raw,names", [
    ({"http_confg": {}}, "http_confg"),
    ({"http_config": {"predict_prot": "1"}}, "http_config.predict_prot"),
    ({"http_config": {"predict_port": "80"}}, "http_config.predict_port"),
    ({"http_config": {"predict_port": "port"}}, "http_config.predict_port"),
    ({"http_config": {"predict_ip": "localhost"}}, "http_config.predict_ip"),
    ({"http_config": {"predict_ip": "0.0.0.0"}}, "allow_all_zero_ip_listening"),
    ({"http_config": {"status_port": "1026"}}, "http_config.status_port"),
    ({"request_limit": {"max_requests": 0}}, "request_limit.max_requests"),
    ({"request_limit": {"max_requests": True}}, "request_limit.max_requests"),
    ({"request_limit": {"body_limit": 21}}, "request_limit.body_limit"),
    ({"exception_config": {"max_retry": 11}}, "exception_config.max_retry"),
    ({"exception_config": {"infer_timeout": 1.5}}, "exception_config.infer_timeout"),
    ({"digs_scheduler_config": {"algorithm_type": "random"}}, "digs_scheduler_config.algorithm_type"),
    ({"digs_scheduler_config": {"deploy_mode": "single_node"}}, "single_node"),
    ({"digs_scheduler_config": {"slots_thresh": "lots"}}, "digs_scheduler_config.slots_thresh"),
    ({"tls_config": {"request_server_tls_enable": True}}, "tls_config.request_server_tls_enable"),
    ({"tls_config": {"nobody_tls_enable": False}}, "tls_config.nobody_tls_enable"),
    ({"backup_config": {"function_enable": True}}, "backup_config.function_enable"),
    ({"instances": {}}, "instances"),
    ({"instances": [{"role": "prefill", "ip": "127.0.0.2", "port": 1025}]}, "instances[0].mgmt_port"),
    ({"instances": [{**INSTANCES[0], "role": "flex"}]}, "instances[0].role"),
    ({"instances": [{**INSTANCES[0], "grpc_port": 1}]}, "instances[0].grpc_port"),
    ({"instances": [{**INSTANCES[0], "ip": "p 0"}]}, "instances[0].ip"),
    ({"instances": [{**INSTANCES[0], "ip": "-p0.pods"}]}, "instances[0].ip"),
    ({"instances": [{**INSTANCES[0], "ip": "p0..pods"}]}, "instances[0].ip"),
    ({"instances": [{**INSTANCES[0], "ip": "p_0.pods"}]}, "instances[0].ip"),
    ({"instances": [{**INSTANCES[0], "ip": "10.0.0.300"}]}, "instances[0].ip"),
    ({"instances": [{**INSTANCES[0], "ip": "http://p0"}]}, "instances[0].ip"),
    ({"instances": [{**INSTANCES[0], "ip": "a" * 64}]}, "instances[0].ip"),
    ({"instances": [{**INSTANCES[0], "ip": ".".join(["a" * 63] * 4)}]}, "instances[0].ip"),
    ({"instances": [{**INSTANCES[0], "ip": ""}]}, "instances[0].ip"),
    ({"instances": [{**INSTANCES[0], "ip": 10}]}, "instances[0].ip"),
    ({"instances": [{**INSTANCES[0], "mgmt_ip": "p0/"}]}, "instances[0].mgmt_ip"),
    ({"instances": [{**INSTANCES[0], "id": 3}, {**INSTANCES[1], "id": 3}]}, "id 3"),
    ({"instances": [INSTANCES[0], {**INSTANCES[0], "id": 5}]}, "127.0.0.2:1025"),
])
def test_errors_name_the_key(raw: dict, names: str) -> None:
    with pytest.raises(ConfigError, match=names.replace("[", r"\[").replace("]", r"\]")):
        CoordinatorConfig.from_dict(raw)


def test_from_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "ms_coordinator.json"
    path.write_text(json.dumps({**SHIPPED, "instances": INSTANCES}))
    assert len(CoordinatorConfig.from_file(str(path)).instances) == 2
    path.write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        CoordinatorConfig.from_file(str(path))
