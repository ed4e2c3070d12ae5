"""The server's configuration: MindIE's `config.json`, checked key by key.

Every key MindIE documents is known here with its type and range. A key that is not known, or a
value outside its range, stops start-up with a message naming the key and the range. Keys that
only make sense on an NPU cluster (TLS for inter-node links, multi-node ports, KMC key stores,
NPU scheduling heuristics) are accepted so that a MindIE config loads unchanged, and listed by
`ServerSettings.ignored` so start-up can say they have no effect here.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
from dataclasses import dataclass, field, replace
from typing import Any

from mindie.config import ENGINE_KEYS, EngineConfig
from mindie.config_keys import ConfigError, Key, check_section
from mindie.media import MediaPolicy
from mindie.pd.media import HOLD_MAX_BYTES, HOLD_TTL_S

_INT_MAX = 2**31 - 1


_PORT = Key("int", lo=1024, hi=65535)
_PATH = Key("str", honoured=False)
_PATHS = Key("list", honoured=False)
_BOOL = Key("bool")

_SERVER: dict[str, Key] = {
    "ipAddress": Key("str"),
    "managementIpAddress": Key("str"),
    "port": _PORT,
    "managementPort": _PORT,
    "metricsPort": _PORT,
    "allowAllZeroIpListening": _BOOL,
    "maxLinkNum": Key("int", lo=1, hi=4096),
    "httpsEnabled": _BOOL,
    "fullTextEnabled": _BOOL,
    "tlsCaPath": Key("str"),
    "tlsCaFile": Key("list"),
    "tlsCert": Key("str"),
    "tlsPk": Key("str"),
    "tlsPkPwd": Key("str"),
    "tlsCrlPath": Key("str"),
    "tlsCrlFiles": Key("list"),
    "managementTlsCaFile": _PATHS, "managementTlsCert": _PATH, "managementTlsPk": _PATH,
    "managementTlsPkPwd": _PATH, "managementTlsCrlPath": _PATH, "managementTlsCrlFiles": _PATHS,
    "metricsTlsCaFile": _PATHS, "metricsTlsCert": _PATH, "metricsTlsPk": _PATH,
    "metricsTlsPkPwd": _PATH, "metricsTlsCrlPath": _PATH, "metricsTlsCrlFiles": _PATHS,
    "kmcKsfMaster": _PATH, "kmcKsfStandby": _PATH,
    "inferMode": Key("str", choices=("standard", "dmi")),
    "interCommTLSEnabled": Key("bool"),
    "interCommPort": _PORT,
    # Ours, not MindIE's: the shared secret P and D present to each other (MindIE uses mutual TLS).
    "interCommToken": Key("str"),
    "interCommTlsCaPath": _PATH, "interCommTlsCaFiles": _PATHS, "interCommTlsCert": _PATH,
    "interCommPk": _PATH, "interCommPkPwd": _PATH, "interCommTlsCrlPath": _PATH, "interCommTlsCrlFiles": _PATHS,
    "openAiSupport": Key("str", honoured=False),  # one OpenAI handler: the vLLM-flavoured one
    "tokenTimeout": Key("int", lo=1, hi=3600),
    "e2eTimeout": Key("int", lo=1, hi=65535),
    "maxRequestLength": Key("int", lo=1, hi=100),
    # Ours, as vLLM's --allowed-local-media-path / a switch for URLs on loopback and link-local hosts
    "allowedLocalMediaPath": Key("str"),
    "allowPrivateMediaUrls": _BOOL,
    # Ours: how much of the media bodies it handed to D a prefill node holds for recomputes, and how long
    "pdMediaHoldMB": Key("int", lo=1, hi=65536),
    "pdMediaHoldSeconds": Key("int", lo=1, hi=86400),
    "maxJsonDepth": Key("int", lo=2, hi=200, honoured=False),  # the JSON parser refuses depth > 200 anyway
    "distDPServerEnabled": Key("bool", choices=(False,)),
    "HealthCheckConfig": Key("dict", honoured=False),
}

_BACKEND: dict[str, Key] = {
    "backendName": Key("str", choices=("mindieservice_llm_engine",)),
    "modelInstanceNumber": Key("int", lo=1, hi=1),
    "npuDeviceIds": Key("list", honoured=False),
    "tokenizerProcessNumber": Key("int", lo=1, hi=32, honoured=False),
    "multiNodesInferEnabled": Key("bool", choices=(False,)),
    "multiNodesInferPort": Key("int", lo=1024, hi=65535, honoured=False),
    "interNodeTLSEnabled": Key("bool", honoured=False),
    "interNodeTlsCaPath": _PATH, "interNodeTlsCaFiles": _PATHS, "interNodeTlsCert": _PATH, "interNodeTlsPk": _PATH,
    "interNodeTlsPkPwd": _PATH, "interNodeTlsCrlPath": _PATH, "interNodeTlsCrlFiles": _PATHS,
    "interNodeKmcKsfMaster": _PATH, "interNodeKmcKsfStandby": _PATH,
    "kvPoolConfig": Key("dict", honoured=False),
    "ModelDeployConfig": Key("dict"),
    "ScheduleConfig": Key("dict"),
}

_DEPLOY: dict[str, Key] = {
    "maxSeqLen": ENGINE_KEYS["maxSeqLen"][1],
    "maxInputTokenLen": ENGINE_KEYS["maxInputTokenLen"][1],
    "truncation": Key("int|bool", choices=(-1, 0, 1, True, False)),
    "ModelConfig": Key("list"),
    "LoraModules": Key("list", honoured=False),
    "maxLoras": Key("int", honoured=False),
    "maxLoraRank": Key("int", honoured=False),
}

_MODEL: dict[str, Key] = {
    "modelInstanceType": Key("str", choices=("Standard",)),
    "modelName": Key("str"),
    "modelWeightPath": Key("str"),
    "worldSize": Key("int", lo=1, hi=1),
    "cpuMemSize": Key("int", lo=0, hi=_INT_MAX, honoured=False),
    # On this backend the "device" is the CPU: npuMemSize is the KV-cache budget in GB.
    "npuMemSize": Key("num", lo=-1, hi=_INT_MAX),
    "backendType": Key("str", honoured=False),
    "trustRemoteCode": Key("bool", choices=(False,)),
    "kv_trans_timeout": Key("int", lo=1, hi=3600),
    "kv_link_timeout": Key("int", honoured=False),
    "async_scheduler_wait_time": Key("int", honoured=False),
    "plugin_params": Key("str"),
    "models": Key("dict", honoured=False),
    "dtype": Key("str", choices=("auto", "bfloat16", "float32")),
    "quantization": Key("str", choices=("auto", "none", "q8_0", "q4_0")),
    "activationBits": Key("int", choices=(16, 8)),
}

_SCHEDULE: dict[str, Key] = {
    "templateType": Key("str", choices=("Standard", "Mix"), honoured=False),
    "templateName": Key("str", honoured=False),
    "cacheBlockSize": ENGINE_KEYS["cacheBlockSize"][1],
    "maxPrefillBatchSize": ENGINE_KEYS["maxPrefillBatchSize"][1],
    "maxPrefillTokens": ENGINE_KEYS["maxPrefillTokens"][1],
    "prefillTimeMsPerReq": Key("int", lo=0, hi=1000, honoured=False),
    "prefillPolicyType": Key("int", lo=0, hi=3, honoured=False),
    "decodeTimeMsPerReq": Key("int", lo=0, hi=1000, honoured=False),
    "decodePolicyType": Key("int", lo=0, hi=3, honoured=False),
    "maxBatchSize": ENGINE_KEYS["maxBatchSize"][1],
    "maxIterTimes": ENGINE_KEYS["maxIterTimes"][1],
    "maxPreemptCount": ENGINE_KEYS["maxPreemptCount"][1],
    "supportSelectBatch": Key("bool", honoured=False),
    "maxQueueDelayMicroseconds": Key("int", lo=500, hi=1000000),
    "maxFirstTokenWaitTime": Key("int", lo=0, hi=3600000, honoured=False),
    "maxN": Key("int", lo=1, hi=128),
    "prefillChunkSize": ENGINE_KEYS["prefillChunkSize"][1],
    "maxNumPartialPrefills": Key("int", lo=1, hi=819200, honoured=False),
    "longPrefillTokenThreshold": Key("int", lo=1, hi=4194304, honoured=False),
    "maxLongPartialPrefills": Key("int", lo=1, hi=819200, honoured=False),
    "enablePrefixCache": ENGINE_KEYS["enablePrefixCache"][1],
    "enableSplit": Key("bool", honoured=False),
}

_TOP: dict[str, Key] = {
    "Version": Key("str", honoured=False),
    "ServerConfig": Key("dict"),
    "BackendConfig": Key("dict"),
    "LogConfig": Key("dict", honoured=False),
    "EnableDynamicAdjustTimeoutConfig": _BOOL,
}

TOKEN_ENV = "MINDIE_INTERCOMM_TOKEN"  # overrides ServerConfig.interCommToken
# MindIE's: a container's own address (a pod's, from the downward API) overrides ServerConfig.ipAddress
# and managementIpAddress, so that one config.json serves every replica.
CONTAINER_IP_ENV = "MIES_CONTAINER_IP"
CONTAINER_MANAGEMENT_IP_ENV = "MIES_CONTAINER_MANAGEMENT_IP"

_MODEL_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,254}[A-Za-z0-9])?")


@dataclass(frozen=True)
class TLSSettings:
    cert: str
    key: str
    key_password_file: str | None
    ca_files: tuple[str, ...]  # client certificates are verified against these when present
    crl_files: tuple[str, ...] = ()  # revoked client certificates are refused


@dataclass(frozen=True)
class ServerSettings:
    """What the HTTP layer needs, with MindIE's defaults (except httpsEnabled, see from_file)."""

    host: str = "127.0.0.1"
    port: int = 1025
    management_host: str = "127.0.0.2"
    management_port: int = 1026
    metrics_port: int = 1027
    allow_all_zero_ip: bool = False
    max_link_num: int = 1000
    tls: TLSSettings | None = None
    full_text: bool = False
    token_timeout_s: float = 600
    e2e_timeout_s: float = 600
    max_request_bytes: int = 40 * 2**20
    api_key: str | None = None
    model_name: str | None = None  # None: the model's own name (mindie.model.loader.model_name), set at load
    model_path: str | None = None  # None: the embedded default model
    dtype: str = "auto"
    quantization: str = "auto"
    activation_bits: int = 16  # the integer path's activations: 16 (two int8 planes) or 8 (one, as llama.cpp)
    # --reasoning-parser: auto (Qwen3 models whose tokenizer has <think> / </think>), none, or qwen3
    reasoning_parser: str = "auto"
    truncation: int = 0  # 0 reject, -1 keep the first tokens (cut the right), 1 keep the last
    max_n: int = 128  # maxN: the most samples (n, best_of) or beams a request may ask for
    queue_delay_s: float = 0.005  # maxQueueDelayMicroseconds: an idle engine waits this long for a batch
    engine: EngineConfig = field(default_factory=EngineConfig)
    media: MediaPolicy = field(default_factory=MediaPolicy)  # where images may come from, and limits
    ignored: tuple[str, ...] = ()  # accepted keys that have no effect here
    # Prefill/decode disaggregation (inferMode "dmi"): the P<->D control port (interCommPort) on
    # the business IP, the KV transfer listener (interCommPort + 1; 0 picks a free port), the
    # deadline of one KV pull (kv_trans_timeout; P's lease on unreleased blocks is twice it),
    # the inter-instance token, and the /dresult keep-alive interval.
    infer_mode: str = "standard"
    inter_comm_port: int = 1121
    kv_transfer_port: int = 1122
    kv_trans_timeout_s: float = 10
    inter_comm_token: str | None = None
    dresult_heartbeat_s: float = 5.0
    media_hold_bytes: int = HOLD_MAX_BYTES  # P: the media bodies it holds for recomputes, all requests together
    media_hold_s: float = HOLD_TTL_S  # P: a body D never reported finished is dropped after this long

    @property
    def dmi(self) -> bool:
        return self.infer_mode == "dmi"

    def __post_init__(self) -> None:
        for name, ip in (("ipAddress", self.host), ("managementIpAddress", self.management_host)):
            try:
                addr = ipaddress.ip_address(ip)
            except ValueError as exc:
                raise ConfigError(f"ServerConfig.{name} must be an IPv4 or IPv6 address, got {ip!r}") from exc
            if addr.is_unspecified and not self.allow_all_zero_ip:
                raise ConfigError(
                    f"ServerConfig.{name} is {ip}, which listens on every interface; set "
                    "ServerConfig.allowAllZeroIpListening to true to allow it"
                )
        if self.dmi and ipaddress.ip_address(self.host).is_unspecified:
            raise ConfigError(f"ServerConfig.ipAddress is {self.host}, but in dmi mode it is the address P and D give "
                              "each other (P's pNodeAddr and KV transfer address, the caller D checks): set it, or "
                              f"the environment variable {CONTAINER_IP_ENV}, to this instance's own address")
        if self.dmi and not self.inter_comm_token:
            raise ConfigError("ServerConfig.inferMode is dmi but no inter-instance token is set: set "
                              f"ServerConfig.interCommToken or the environment variable {TOKEN_ENV}")
        if self.model_name is not None and not _MODEL_NAME.fullmatch(self.model_name):
            raise ConfigError(
                "ModelConfig.modelName (--served-model-name) must be 1-256 characters of [A-Za-z0-9._-], not "
                f"starting or ending with '.', '-' or '_', got {self.model_name!r}"
            )

    def with_overrides(self, **changes: Any) -> ServerSettings:
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    @classmethod
    def from_dict(cls, raw: Any, base_dir: str = ".") -> ServerSettings:
        ignored: list[str] = []
        top = check_section("config", raw, _TOP, ignored)
        server = check_section("ServerConfig", top.get("ServerConfig", {}), _SERVER, ignored)
        backend = check_section("BackendConfig", top.get("BackendConfig", {}), _BACKEND, ignored)
        deploy = check_section("ModelDeployConfig", backend.get("ModelDeployConfig", {}), _DEPLOY, ignored)
        schedule = check_section("ScheduleConfig", backend.get("ScheduleConfig", {}), _SCHEDULE, ignored)
        models = deploy.get("ModelConfig", [{}]) or [{}]
        if len(models) != 1:
            raise ConfigError(f"ModelDeployConfig.ModelConfig must list exactly 1 model, got {len(models)}")
        model = check_section("ModelConfig[0]", models[0], _MODEL, ignored)

        def path(p: str) -> str:
            return p if os.path.isabs(p) else os.path.normpath(os.path.join(base_dir, p))

        tls = None
        # MindIE defaults httpsEnabled to true with certificates under security/; here TLS is on
        # only when it is asked for, so a fresh config serves plain HTTP on 127.0.0.1 at once.
        if server.get("httpsEnabled", False):
            missing = [k for k in ("tlsCert", "tlsPk") if not server.get(k)]
            if missing:
                raise ConfigError(f"ServerConfig.httpsEnabled is true but {missing} is not set")
            ca_dir = server.get("tlsCaPath", "")
            tls = TLSSettings(
                cert=path(server["tlsCert"]),
                key=path(server["tlsPk"]),
                key_password_file=path(server["tlsPkPwd"]) if server.get("tlsPkPwd") else None,
                ca_files=tuple(path(os.path.join(ca_dir, f)) for f in server.get("tlsCaFile", [])),
                crl_files=tuple(path(os.path.join(server.get("tlsCrlPath", ""), f))
                                for f in server.get("tlsCrlFiles", [])),
            )
            if tls.crl_files and not tls.ca_files:
                raise ConfigError("ServerConfig.tlsCrlFiles needs ServerConfig.tlsCaFile: revocation is checked only "
                                  "for client certificates")
            for p in (tls.cert, tls.key, *tls.ca_files, *tls.crl_files):
                if not os.path.isfile(p):
                    raise ConfigError(f"TLS file {p} does not exist")
        if "plugin_params" in model:
            try:
                plugin = json.loads(model["plugin_params"])
            except json.JSONDecodeError as exc:
                raise ConfigError(f"ModelConfig[0].plugin_params must be a JSON string: {exc}") from exc
            kind = plugin.get("plugin_type") if isinstance(plugin, dict) else None
            if kind not in ("prefix_cache", "splitfuse"):
                raise ConfigError(
                    "ModelConfig[0].plugin_params.plugin_type must be 'prefix_cache' or 'splitfuse' (both always on "
                    f"here), got {kind!r}"
                )
        engine_keys: dict[str, Any] = {k: schedule[k] for k in (
            "cacheBlockSize", "maxPrefillBatchSize", "maxPrefillTokens", "prefillChunkSize", "maxBatchSize",
            "maxIterTimes", "maxPreemptCount", "enablePrefixCache") if k in schedule}
        engine_keys.update({k: deploy[k] for k in ("maxSeqLen", "maxInputTokenLen") if k in deploy})
        if model.get("npuMemSize", -1) not in (-1, 0):
            engine_keys["kvCacheMemGB"] = model["npuMemSize"]
        try:
            engine = EngineConfig.from_mindie(engine_keys)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        truncation = deploy.get("truncation", 0)
        infer_mode = server.get("inferMode", "standard")
        if infer_mode == "dmi" and server.get("interCommTLSEnabled", False):
            raise ConfigError("ServerConfig.interCommTLSEnabled is true, but TLS between P and D is not implemented "
                              "here: set it to false (P and D authenticate with ServerConfig.interCommToken)")
        inter_comm_port = server.get("interCommPort", 1121)
        if infer_mode != "dmi":
            ignored += [f"ServerConfig.{k}" for k in ("interCommTLSEnabled", "interCommPort", "interCommToken",
                                                      "pdMediaHoldMB", "pdMediaHoldSeconds") if k in server]
            ignored += ["ModelConfig[0].kv_trans_timeout"] if "kv_trans_timeout" in model else []
        timeouts_max = top.get("EnableDynamicAdjustTimeoutConfig", False)
        return cls(
            host=os.environ.get(CONTAINER_IP_ENV) or server.get("ipAddress", "127.0.0.1"),
            port=server.get("port", 1025),
            management_host=os.environ.get(CONTAINER_MANAGEMENT_IP_ENV)
            or server.get("managementIpAddress", "127.0.0.2"),
            management_port=server.get("managementPort", 1026),
            metrics_port=server.get("metricsPort", 1027),
            allow_all_zero_ip=server.get("allowAllZeroIpListening", False),
            max_link_num=server.get("maxLinkNum", 1000),
            tls=tls,
            full_text=server.get("fullTextEnabled", False),
            token_timeout_s=3600 if timeouts_max else server.get("tokenTimeout", 600),
            e2e_timeout_s=65535 if timeouts_max else server.get("e2eTimeout", 600),
            max_request_bytes=server.get("maxRequestLength", 40) * 2**20,
            model_name=model.get("modelName"),
            model_path=path(model["modelWeightPath"]) if model.get("modelWeightPath") else None,
            dtype=model.get("dtype", "auto"),
            quantization=model.get("quantization", "auto"),
            activation_bits=model.get("activationBits", 16),
            max_n=schedule.get("maxN", 128),
            queue_delay_s=schedule.get("maxQueueDelayMicroseconds", 5000) / 1e6,
            truncation={True: -1, False: 0}.get(truncation, truncation) if isinstance(truncation, bool) else truncation,
            engine=engine,
            media=MediaPolicy(allowed_local_path=path(server["allowedLocalMediaPath"])
                              if server.get("allowedLocalMediaPath") else None,
                              allow_private_urls=server.get("allowPrivateMediaUrls", False)),
            ignored=tuple(ignored),
            infer_mode=infer_mode,
            inter_comm_port=inter_comm_port,
            kv_transfer_port=inter_comm_port + 1 if inter_comm_port < 65535 else 0,
            kv_trans_timeout_s=model.get("kv_trans_timeout", 10),
            inter_comm_token=os.environ.get(TOKEN_ENV) or server.get("interCommToken"),
            media_hold_bytes=server.get("pdMediaHoldMB", HOLD_MAX_BYTES // 2**20) * 2**20,
            media_hold_s=server.get("pdMediaHoldSeconds", HOLD_TTL_S),
        )

    @classmethod
    def from_file(cls, path: str) -> ServerSettings:
        size = os.path.getsize(path)
        if not 0 < size <= 10 * 2**20:
            raise ConfigError(f"{path} must be a non-empty file of at most 10 MB, got {size} bytes")
        with open(path, encoding="utf-8") as f:
            try:
                raw = json.load(f)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
        return cls.from_dict(raw, base_dir=os.path.dirname(os.path.abspath(path)))
