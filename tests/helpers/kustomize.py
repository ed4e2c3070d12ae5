"""Renders a kustomization offline, in Python: the part of kustomize that deploy/k8s uses and no more
(`resources`, `replicas`, and `patches` that merge maps into a resource named by kind and name).
Anything else in a kustomization.yaml is refused, so that a test never checks less than what
`kubectl apply -k` would apply."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

Resource = dict[str, Any]
KNOWN = {"apiVersion", "kind", "resources", "replicas", "patches"}
SCALABLE = {"Deployment", "StatefulSet", "ReplicaSet"}


def load_manifests(path: Path) -> list[Resource]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def render(directory: Path) -> list[Resource]:
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(spec) - KNOWN
    if unknown:
        raise ValueError(f"{directory}/kustomization.yaml: {sorted(unknown)} is not rendered here (known: "
                         f"{sorted(KNOWN)})")
    resources: list[Resource] = []
    for entry in spec.get("resources", []):
        path = directory / entry
        resources += render(path) if path.is_dir() else load_manifests(path)
    for entry in spec.get("replicas", []):
        [target] = [r for r in resources if r["kind"] in SCALABLE and r["metadata"]["name"] == entry["name"]]
        target["spec"]["replicas"] = entry["count"]
    for entry in spec.get("patches", []):
        if set(entry) != {"path"}:
            raise ValueError(f"{directory}: only patches given by path are rendered here, got {entry}")
        for patch in load_manifests(directory / entry["path"]):
            [target] = [r for r in resources
                        if (r["kind"], r["metadata"]["name"]) == (patch["kind"], patch["metadata"]["name"])]
            _merge(target, patch)
    return resources


def _merge(into: Resource, patch: Resource) -> None:
    """A strategic merge patch of maps and scalars; lists (merged by key in kustomize) and deletions
    are refused."""
    for key, value in patch.items():
        if isinstance(value, list) or value is None:
            raise ValueError(f"a patch with a list or a deletion ({key}) is not rendered here")
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)
