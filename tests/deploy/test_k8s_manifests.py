"""deploy/k8s: every manifest, and the base and every overlay as kustomize renders them, is valid
Kubernetes (`kubernetes-validate --strict`, whose schemas ship with it: no network); and the files
agree: the ConfigMaps' configs load with our own loaders, the coordinator lists exactly the
StatefulSets' pods by their headless Services' DNS names, probes and Services use the configured
ports and routes the processes serve, the token comes from a Secret, and an instance started as its
pod starts it binds and advertises the pod IP."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import pytest
import yaml
from helpers.kustomize import Resource, load_manifests, render

from mindie.cli import _parser, settings_from_args
from mindie.coordinator.app import build_apps
from mindie.coordinator.config import CoordinatorConfig, Role
from mindie.coordinator.service import Coordinator
from mindie.server.app import MANAGEMENT, ROUTES
from mindie.server.config import CONTAINER_IP_ENV, CONTAINER_MANAGEMENT_IP_ENV, TOKEN_ENV

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
FILES = sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")
BUILDS = {"base": K8S / "base", **{f"overlays/{p.parent.name}": p.parent
                                   for p in sorted((K8S / "overlays").glob("*/kustomization.yaml"))}}
VERSIONS = ("1.25.0", "1.37.0")  # the oldest and the newest Kubernetes that kubernetes-validate carries
POD_IP = "10.244.1.7"
SECRET = "token-from-the-secret"


def one(resources: list[Resource], kind: str, name: str) -> Resource:
    [found] = [r for r in resources if r["kind"] == kind and r["metadata"]["name"] == name]
    return found


def component(resources: list[Resource], kind: str, name: str) -> list[Resource]:
    return [r for r in resources if r["kind"] == kind
            and r["metadata"].get("labels", {}).get("app.kubernetes.io/component") == name]


def config_of(resources: list[Resource], pod: dict[str, Any], mount: str) -> tuple[str, str]:
    """(file name, text) of the ConfigMap file a container reads at `mount`/<file>."""
    [container] = pod["containers"]
    [volume_mount] = [m for m in container["volumeMounts"] if m["mountPath"] == mount]
    [volume] = [v for v in pod["volumes"] if v["name"] == volume_mount["name"]]
    [(name, text)] = one(resources, "ConfigMap", volume["configMap"]["name"])["data"].items()
    return name, text


def port_number(container: dict[str, Any], port: int | str) -> int:
    return port if isinstance(port, int) else next(p["containerPort"] for p in container["ports"] if p["name"] == port)


@pytest.fixture(scope="module", params=list(BUILDS), ids=list(BUILDS))
def build(request: pytest.FixtureRequest) -> list[Resource]:
    return render(BUILDS[request.param])


@pytest.fixture(scope="module")
def coordinator_config(build: list[Resource]) -> CoordinatorConfig:
    pod = one(build, "Deployment", "mindie-coordinator")["spec"]["template"]["spec"]
    name, text = config_of(build, pod, "/etc/mindie")
    assert pod["containers"][0]["args"] == ["coordinator", "--config", f"/etc/mindie/{name}"]
    return CoordinatorConfig.from_dict(json.loads(text))


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(K8S)) for p in FILES])
def test_every_manifest_is_valid(path: Path, version: str) -> None:
    for resource in load_manifests(path):
        kubernetes_validate.validate(resource, version, strict=True)  # a missing schema raises too


@pytest.mark.parametrize("version", VERSIONS)
def test_every_build_is_valid(build: list[Resource], version: str) -> None:
    assert build
    for resource in build:
        kubernetes_validate.validate(resource, version, strict=True)


def test_strict_validation_refuses_an_unknown_field() -> None:
    [_, statefulset] = load_manifests(K8S / "base" / "decode.yaml")
    statefulset["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError, match="imagePullPolicyy"):
        kubernetes_validate.validate(statefulset, VERSIONS[-1], strict=True)


def test_the_command_line_validates_every_file() -> None:
    """As CI runs it; --no-warn is not given, so a resource with no schema would be reported."""
    done = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet", *map(str, FILES)],
                          capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (its kustomize) is not installed")
@pytest.mark.parametrize("name", list(BUILDS))
def test_the_python_rendering_is_kustomize_s(name: str) -> None:
    done = subprocess.run(["kubectl", "kustomize", str(BUILDS[name])], capture_output=True, text=True, timeout=60,
                          check=True)

    def key(r: Resource) -> tuple[str, str]:
        return r["kind"], r["metadata"]["name"]

    assert sorted(yaml.safe_load_all(done.stdout), key=key) == sorted(render(BUILDS[name]), key=key)


@pytest.mark.parametrize("name", [name for name in BUILDS if name != "base"])
def test_an_overlay_changes_only_the_coordinator_s_instance_list(name: str) -> None:
    def without_instances(resources: list[Resource]) -> list[Resource]:
        for r in resources:
            if r["kind"] == "ConfigMap" and "ms_coordinator.json" in r["data"]:
                config = json.loads(r["data"]["ms_coordinator.json"])
                assert config.pop("instances")
                r["data"]["ms_coordinator.json"] = config
            if r["kind"] == "StatefulSet":
                r["spec"].pop("replicas")
        return resources

    assert without_instances(render(BUILDS[name])) == without_instances(render(BUILDS["base"]))


def test_the_coordinator_lists_every_pod_by_its_dns_name(build: list[Resource],
                                                         coordinator_config: CoordinatorConfig) -> None:
    for role in Role:
        [statefulset] = component(build, "StatefulSet", role.value)
        spec = statefulset["spec"]
        service = one(build, "Service", spec["serviceName"])
        # headless, and its names published before the pods are ready: the coordinator needs the
        # name of a pod that is still loading its model to give it its role
        assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
        labels = spec["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items()
        assert spec["selector"]["matchLabels"].items() <= labels.items()
        pods = [f"{statefulset['metadata']['name']}-{i}.{service['metadata']['name']}" for i in range(spec["replicas"])]
        assert [i.ip for i in coordinator_config.instances if i.role is role] == pods


def test_instances_are_started_as_the_coordinator_expects(build: list[Resource], coordinator_config: CoordinatorConfig,
                                                          tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each StatefulSet's pod, started as the manifest starts it (its env, args and ConfigMap): the
    settings bind and advertise the pod IP, hold the Secret's token, listen on the ports the
    coordinator lists and the probes and Service use."""
    management_routes = {r.path for r in ROUTES if r.plane == MANAGEMENT and r.method == "GET"}
    for role in Role:
        [statefulset] = component(build, "StatefulSet", role.value)
        pod = statefulset["spec"]["template"]["spec"]
        [container] = pod["containers"]
        name, text = config_of(build, pod, "/etc/mindie")
        assert "interCommToken" not in json.loads(text)["ServerConfig"]  # the secret stays out of ConfigMaps
        (tmp_path / name).write_text(text)
        env = {}
        for var in container["env"]:
            source = var["valueFrom"]
            if "fieldRef" in source:
                assert source["fieldRef"]["fieldPath"] == "status.podIP"
                env[var["name"]] = POD_IP
            elif "secretKeyRef" in source:
                assert var["name"] == TOKEN_ENV
                env[var["name"]] = SECRET
            else:
                env[var["name"]] = "2"  # resourceFieldRef: the CPU limit
        assert {CONTAINER_IP_ENV, CONTAINER_MANAGEMENT_IP_ENV, TOKEN_ENV} <= env.keys()
        for var_name, value in env.items():
            monkeypatch.setenv(var_name, value)
        args = container["args"]
        assert args == ["serve", "--config", f"/etc/mindie/{name}"]
        s = settings_from_args(_parser().parse_args([*args[:-1], str(tmp_path / name)]))
        assert (s.dmi, s.host, s.management_host, s.inter_comm_token) == (True, POD_IP, POD_IP, SECRET)
        assert s.model_path is None  # the embedded model, in the image: nothing to download

        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports == {"business": s.port, "management": s.management_port, "metrics": s.metrics_port,
                         "intercomm": s.inter_comm_port, "kv-transfer": s.kv_transfer_port}
        service = one(build, "Service", statefulset["spec"]["serviceName"])
        assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == ports
        for spec in (i for i in coordinator_config.instances if i.role is role):
            assert (spec.port, spec.mgmt_port, spec.metrics_port, spec.inter_comm_port) == (
                s.port, s.management_port, s.metrics_port, s.inter_comm_port)
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            get = container[probe]["httpGet"]
            assert port_number(container, get["port"]) == s.management_port
            assert get["path"] in management_routes
        assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"


def test_coordinator_ports_and_probes(build: list[Resource], coordinator_config: CoordinatorConfig) -> None:
    """The Service and probes use the configured ports, and the probes' routes answer there: live at
    once, ready only when a P and a D are in service."""
    cfg = coordinator_config
    deployment = one(build, "Deployment", "mindie-coordinator")
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"predict": cfg.predict_port, "manage": cfg.manage_port, "external": cfg.external_port,
                     "status": cfg.status_port}
    service = one(build, "Service", "mindie-coordinator")
    assert {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]} == {
        name: (port, name) for name, port in ports.items()}
    probes = {probe: container[probe]["httpGet"] for probe in ("livenessProbe", "readinessProbe")}
    assert {port_number(container, get["port"]) for get in probes.values()} == {cfg.status_port}

    async def answers() -> dict[str, int]:
        coord = Coordinator(cfg)
        app = build_apps(coord)[(cfg.manage_ip, cfg.status_port)]
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://coordinator") as client:
            codes = {probe: (await client.get(get["path"])).status_code for probe, get in probes.items()}
        await coord.client.aclose()
        return codes

    assert asyncio.run(answers()) == {"livenessProbe": 200, "readinessProbe": 503}
