"""Static checks of the deploy files, fast and without podman: schemas, rendering, and every
container's configuration through the real CLI's --check-config."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.deploy.manifests import (
    ALL_OVERLAYS,
    OVERLAYS,
    ROOT,
    compose_spec_schema,
    interpolate,
    llmserve_containers,
    load_compose,
    render_overlay,
)

SERVICES = ("worker", "scheduler", "gateway")
K8S_VERSION = "1.30.0"


def image_env() -> dict[str, str]:
    """The LLMSERVE_* variables the Dockerfile's ENV sets in every container."""
    return dict(re.findall(r"(LLMSERVE_\w+)=(\S+)", (ROOT / "Dockerfile").read_text()))


def check_config(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("LLMSERVE_", "OTEL_"))}
    return subprocess.run(
        [sys.executable, "-m", "llmserve.cli", *args, "--check-config"],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


# -- compose ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "docker-compose.yml",
        "docker-compose.gpu.yml",
        "docker-compose.mtls.yml",
        "docker-compose.shards.yml",
        "docker-compose.disagg.yml",
    ],
)
def test_compose_file_validates_against_the_compose_spec(name: str):
    schema = json.loads(compose_spec_schema())
    # The spec declares draft-07 under an address jsonschema does not know by that name.
    jsonschema.Draft7Validator(schema).validate(yaml.safe_load((ROOT / name).read_text()))


def test_compose_variables_interpolate_like_compose():
    assert interpolate("${A:-x}/${B}", {"A": "a"}) == "a/"
    assert interpolate({"k": ["${A:-x}"]}, {}) == {"k": ["x"]}


@pytest.mark.services
@pytest.mark.parametrize(
    "files",
    [("docker-compose.yml",), ("docker-compose.yml", "docker-compose.gpu.yml")],
    ids=["compose", "compose-with-cuda-override"],
)
@pytest.mark.parametrize("service", SERVICES)
def test_compose_service_configuration_passes_check_config(files: tuple[str, ...], service: str):
    spec = load_compose(*files)["services"][service]
    env = {**image_env(), **{k: str(v) for k, v in spec["environment"].items()}}
    result = check_config(spec["command"], env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"llmserve {service}: configuration ok"


@pytest.mark.services
@pytest.mark.parametrize("service", [*SERVICES, "scheduler-b"])
def test_shards_override_configurations_pass_check_config(service: str):
    spec = load_compose("docker-compose.yml", "docker-compose.shards.yml")["services"][service]
    env = {**image_env(), **{k: str(v) for k, v in spec["environment"].items()}}
    result = check_config(spec["command"], env)
    assert result.returncode == 0, result.stderr


def test_shards_override_points_workers_and_the_gateway_at_both_shards():
    services = load_compose("docker-compose.yml", "docker-compose.shards.yml")["services"]
    shards = ("scheduler", "scheduler-b")
    port = {s: services[s]["environment"]["LLMSERVE_PORT"] for s in shards}
    every_shard = ",".join(f"{s}:{port[s]}" for s in shards)
    assert services["worker"]["environment"]["LLMSERVE_SCHEDULER"] == every_shard
    assert services["gateway"]["environment"]["LLMSERVE_SCHEDULER"] == every_shard
    # Workers join by lease only, and the shards have names of their own.
    assert [services[s]["environment"].get("LLMSERVE_WORKER_DNS", "") for s in shards] == ["", ""]
    assert len({services[s]["environment"]["LLMSERVE_SHARD_NAME"] for s in shards}) == 2
    for s in shards:
        assert services[s]["healthcheck"]["test"][-1] == f"127.0.0.1:{port[s]}"


@pytest.mark.services
@pytest.mark.parametrize("service", [*SERVICES, "worker-prefill"])
def test_disagg_override_configurations_pass_check_config(service: str):
    spec = load_compose("docker-compose.yml", "docker-compose.disagg.yml")["services"][service]
    env = {**image_env(), **{k: str(v) for k, v in spec["environment"].items()}}
    result = check_config(spec["command"], env)
    assert result.returncode == 0, result.stderr


def test_disagg_override_gives_each_pool_its_role_and_the_scheduler_both():
    services = load_compose("docker-compose.yml", "docker-compose.disagg.yml")["services"]
    pools = {"worker": "decode", "worker-prefill": "prefill"}
    assert {name: services[name]["environment"]["LLMSERVE_ROLE"] for name in pools} == pools
    port = {name: services[name]["environment"]["LLMSERVE_PORT"] for name in pools}
    dns = services["scheduler"]["environment"]["LLMSERVE_WORKER_DNS"].split(",")
    assert sorted(dns) == sorted(f"{name}:{port[name]}" for name in pools)
    # The prefill pool is a worker like the base one but for its role.
    base, prefill = services["worker"], services["worker-prefill"]
    same = {k: v for k, v in base["environment"].items() if k != "LLMSERVE_ROLE"}
    assert {k: v for k, v in prefill["environment"].items() if k != "LLMSERVE_ROLE"} == same
    assert prefill["healthcheck"] == base["healthcheck"]
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    [workers] = [job for job in config["scrape_configs"] if job["job_name"] == "llmserve-worker"]
    assert set(workers["dns_sd_configs"][0]["names"]) == set(pools)


def test_compose_addresses_agree_with_the_ports_services_listen_on():
    services = load_compose("docker-compose.yml")["services"]
    port = {name: services[name]["environment"]["LLMSERVE_PORT"] for name in SERVICES}
    assert services["scheduler"]["environment"]["LLMSERVE_WORKER_DNS"] == f"worker:{port['worker']}"
    assert (
        services["gateway"]["environment"]["LLMSERVE_SCHEDULER"] == f"scheduler:{port['scheduler']}"
    )
    for name in SERVICES:
        assert services[name]["healthcheck"]["test"] == [
            "CMD",
            "llmserve",
            "health",
            f"127.0.0.1:{port[name]}",
        ]
    assert services["gateway"]["ports"] == ["0.0.0.0:8000:8000", "0.0.0.0:50051:50051"]
    # Published worker ports would collide as soon as there are two replicas.
    assert "ports" not in services["worker"]
    otlp = {services[name]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] for name in SERVICES}
    assert otlp == {"http://jaeger:4317"}


def test_prometheus_scrapes_every_service_on_its_metrics_port():
    services = load_compose("docker-compose.yml")["services"]
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    targets = {
        (sd["names"][0], sd["port"])
        for job in config["scrape_configs"]
        for sd in job["dns_sd_configs"]
    }
    expected = {
        ("worker", int(services["worker"]["environment"]["LLMSERVE_METRICS_PORT"])),
        ("scheduler", int(services["scheduler"]["environment"]["LLMSERVE_METRICS_PORT"])),
        ("gateway", int(services["gateway"]["environment"]["LLMSERVE_HTTP_PORT"])),
    }
    assert targets == expected


# -- the mTLS variant: docker-compose.mtls.yml, deploy/k8s/components/mtls --------------------

TLS_DIR = "/etc/llmserve/tls"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Stands in for the mounted certificates: llmserve.devcerts' files, under both the names
    compose mounts (NAME.pem) and those of a Kubernetes TLS Secret (tls.crt, ca.crt)."""
    from llmserve.devcerts import make_dev_pki

    out = tmp_path_factory.mktemp("certs")
    make_dev_pki(out)
    (out / "api-keys").write_text("a-key\n")
    for src, dst in (("gateway.pem", "tls.crt"), ("gateway.key", "tls.key"), ("ca.pem", "ca.crt")):
        (out / dst).write_bytes((out / src).read_bytes())
    return out


def _mounted(env: dict[str, str], certs: Path) -> dict[str, str]:
    return {k: v.replace(TLS_DIR, str(certs)) for k, v in env.items()}


@pytest.mark.parametrize("service", SERVICES)
def test_mtls_override_gives_every_service_its_certificate_and_passes_check_config(
    service: str, certs: Path
):
    spec = load_compose("docker-compose.yml", "docker-compose.mtls.yml")["services"][service]
    env = {k: str(v) for k, v in spec["environment"].items()}
    assert env["LLMSERVE_TLS_CERT"] == f"{TLS_DIR}/{service}.pem"
    assert env["LLMSERVE_TLS_KEY"] == f"{TLS_DIR}/{service}.key"
    assert env["LLMSERVE_TLS_CA"] == f"{TLS_DIR}/ca.pem"
    assert f"./certs:{TLS_DIR}:ro" in spec["volumes"]
    result = check_config(spec["command"], {**image_env(), **_mounted(env, certs)})
    assert result.returncode == 0, result.stderr
    # The same configuration without its certificate files is refused, naming the flag.
    missing = check_config(spec["command"], {**image_env(), **env})
    assert missing.returncode == 2 and "--tls-" in missing.stderr, missing.stderr


def test_mtls_override_keeps_the_base_volumes_and_scrapes_the_gateway_with_a_certificate():
    base = load_compose("docker-compose.yml")["services"]
    mtls = load_compose("docker-compose.yml", "docker-compose.mtls.yml")["services"]
    # Compose merges volumes by target; the merged lists must still hold the base's mounts.
    assert set(base["worker"]["volumes"]) <= set(mtls["worker"]["volumes"])
    config = "/etc/prometheus/prometheus.yml:ro"
    kept = {v for v in base["prometheus"]["volumes"] if not v.endswith(config)}
    assert kept <= set(mtls["prometheus"]["volumes"])
    assert f"./deploy/prometheus/prometheus-mtls.yml:{config}" in mtls["prometheus"]["volumes"]
    assert mtls["scheduler"]["environment"]["LLMSERVE_TLS_SERVER_NAME"] == "worker"
    plain = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    secured = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus-mtls.yml").read_text())
    jobs = {job["job_name"]: job for job in secured["scrape_configs"]}
    gateway = jobs["llmserve-gateway"]
    assert gateway["scheme"] == "https"
    assert gateway["tls_config"]["cert_file"] == f"{TLS_DIR}/client.pem"
    # Apart from the gateway's TLS, the same targets as the plain configuration.
    stripped = [
        {k: v for k, v in job.items() if k not in ("scheme", "tls_config")}
        for job in secured["scrape_configs"]
    ]
    assert stripped == plain["scrape_configs"]


def test_mtls_component_renders_validates_and_passes_check_config(certs: Path):
    objects = render_overlay("cpu-mtls")
    for obj in objects:
        if not obj["apiVersion"].startswith("keda.sh/"):
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    deployments = {obj["metadata"]["name"]: obj for obj in objects if obj["kind"] == "Deployment"}
    containers = list(llmserve_containers(objects))
    assert sorted(c.workload for c in containers) == ["gateway", "scheduler", "worker"]
    for container in containers:
        pod = deployments[container.workload]["spec"]["template"]["spec"]
        secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
        assert secrets == {"tls": f"llmserve-tls-{container.workload}"}
        assert {"name": "tls", "mountPath": TLS_DIR, "readOnly": True} in container.spec[
            "volumeMounts"
        ]
        assert container.env["LLMSERVE_TLS_CERT"] == f"{TLS_DIR}/tls.crt"
        # The kubelet cannot present a client certificate: no gRPC or HTTP probe is left, and
        # readiness asks `llmserve health` on the container's own port.
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            spec = container.spec.get(probe, {})
            assert "grpc" not in spec and "httpGet" not in spec, (container.workload, probe)
        assert container.spec["readinessProbe"]["exec"]["command"] == [
            "llmserve",
            "health",
            f"127.0.0.1:{container.env['LLMSERVE_PORT']}",
        ]
        result = check_config(container.args, _mounted(container.env, certs))
        assert result.returncode == 0, (container.workload, result.stderr)
    gateway = next(c for c in containers if c.workload == "gateway")
    annotations = deployments["gateway"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == gateway.env["LLMSERVE_METRICS_PORT"]
    scheduler = next(c for c in containers if c.workload == "scheduler")
    assert scheduler.env["LLMSERVE_TLS_SERVER_NAME"] == "worker"


def test_gpu_override_reserves_nvidia_devices_and_builds_the_cuda_image():
    worker = load_compose("docker-compose.yml", "docker-compose.gpu.yml")["services"]["worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert worker["build"]["target"] == "cuda"
    assert worker["environment"]["LLMSERVE_DEVICE"] == "cuda"


def _metric_names() -> set[str]:
    """Every sample name the services export, as Prometheus sees it."""
    from prometheus_client import REGISTRY

    import gateway.metrics  # noqa: F401
    import scheduler_service.engine.metrics  # noqa: F401
    import worker_service.metrics  # noqa: F401

    names = set()
    for family in REGISTRY.collect():
        names.add(family.name)
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
        names.update(family.name + s for s in suffixes.get(family.type, []))
    return names


def test_grafana_dashboard_queries_only_metrics_that_exist():
    dashboard = json.loads(
        (ROOT / "deploy" / "grafana" / "dashboards" / "llmserve.json").read_text()
    )
    titles = {panel["title"] for panel in dashboard["panels"]}
    for topic in (
        "Throughput",
        "Time to first token",
        "Time per output token",
        "Queue",
        "KV cache usage",
        "Prefix cache hit rate",
        "Preemptions",
    ):
        assert any(title.startswith(topic) for title in titles), topic
    known = _metric_names()
    used = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"\bllmserve_\w+", target["expr"])
    }
    assert used, "no llmserve metric queried"
    assert used <= known, used - known


# -- Dockerfile and the one install list ------------------------------------------------------


def test_image_installs_through_the_same_script_as_make_setup():
    dockerfile = (ROOT / "Dockerfile").read_text()
    makefile = (ROOT / "Makefile").read_text()
    assert "scripts/install.sh $(BIN)/python dev --editable" in makefile
    assert "pip install" not in makefile
    assert "scripts/install.sh /opt/llmserve/bin/python" in dockerfile
    assert "pip install" not in dockerfile
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", dockerfile, re.M)
    assert re.search(r"^USER 10001:10001$", dockerfile, re.M)
    assert 'CMD llmserve health "127.0.0.1:${LLMSERVE_PORT:-50051}"' in dockerfile
    assert re.search(r"^FROM runtime AS cuda$", dockerfile, re.M)


def dockerfile_stages() -> dict[str, list[str]]:
    """Each named stage's instructions, continuation lines joined."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    stages: dict[str, list[str]] = {}
    current: list[str] = []
    for line in text.splitlines():
        if match := re.match(r"FROM \S+ AS (\S+)$", line):
            current = stages.setdefault(match[1], [])
        elif line.strip() and not line.startswith("#"):
            current.append(line)
    return stages


def test_a_source_change_leaves_the_dependency_layer_of_the_image_as_it_was():
    # The runtime image takes its multi-gigabyte environment from the `deps` stage, which
    # reads only the install list: a rebuild after a source change reuses that layer instead
    # of storing another copy of torch (repeated builds once filled a CI machine's disk).
    stages = dockerfile_stages()
    copied = [line.split()[1:-1] for line in stages["deps"] if line.startswith("COPY")]
    assert sorted(source for sources in copied for source in sources) == [
        "README.md",
        "deploy/wheelhouse/",
        "pyproject.toml",
        "scripts/",
    ]
    runtime_copies = [line for line in stages["runtime"] if line.startswith("COPY --from=")]
    assert runtime_copies[0] == "COPY --from=deps /opt/llmserve /opt/llmserve"
    assert not any("--from=build /opt/llmserve" in line for line in runtime_copies)


# -- Kubernetes -------------------------------------------------------------------------------


# ids: a test whose keywords include "gpu" is skipped without CUDA (tests/conftest.py).
@pytest.fixture(scope="module", params=OVERLAYS, ids=[f"{o}-overlay" for o in OVERLAYS])
def overlay(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render_overlay(request.param)


# The API groups a conformant cluster serves without custom resource definitions.
BUILT_IN_API_VERSIONS = {"v1", "apps/v1", "autoscaling/v2", "policy/v1", "networking.k8s.io/v1"}


def test_overlay_objects_validate_against_kubernetes_1_30(overlay):
    name, objects = overlay
    kinds = [obj["kind"] for obj in objects]
    for kind in (
        "Namespace",
        "ConfigMap",
        "Secret",
        "Deployment",
        "Service",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "NetworkPolicy",
    ):
        assert kind in kinds, (name, kind)
    for obj in objects:
        # Built-in kinds only: `kubectl apply -k` of a default overlay works on a cluster
        # without KEDA or any other CRD (a custom kind there fails with "no matches for kind").
        assert obj["apiVersion"] in BUILT_IN_API_VERSIONS, (name, obj["kind"], obj["apiVersion"])
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


# ids: "gpu" alone would mark the test gpu-only (tests/conftest.py).
@pytest.mark.parametrize("name", ALL_OVERLAYS, ids=[f"{o}-overlay" for o in ALL_OVERLAYS])
def test_every_overlay_renders_and_its_built_in_objects_validate(name: str):
    objects = render_overlay(name)
    workloads = sorted(
        obj["metadata"]["name"] for obj in objects if obj["kind"] in ("Deployment", "StatefulSet")
    )
    pools = ["worker-prefill"] if name == "cpu-disagg" else []
    assert workloads == ["gateway", "scheduler", "worker", *pools], name
    for obj in objects:
        if obj["apiVersion"] in BUILT_IN_API_VERSIONS:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        else:  # only the KEDA overlays bring a custom kind
            assert obj["kind"] == "ScaledObject", (name, obj["kind"])
            assert name in ("gpu-keda", "cpu-disagg"), name


@pytest.mark.services
def test_shards_overlay_lists_every_shard_where_workers_and_gateways_look():
    objects = render_overlay("cpu-shards")
    [shards] = [obj for obj in objects if obj["kind"] == "StatefulSet"]
    assert not [
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "scheduler"
    ]
    headless = next(o for o in objects if o["metadata"]["name"] == shards["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    # A shard is not ready until a worker registers, which needs the shard's address.
    assert headless["spec"]["publishNotReadyAddresses"] is True
    containers = {c.workload: c for c in llmserve_containers(objects)}
    port = containers["scheduler"].env["LLMSERVE_PORT"]
    every_shard = ",".join(
        f"scheduler-{i}.{headless['metadata']['name']}:{port}"
        for i in range(shards["spec"]["replicas"])
    )
    assert shards["spec"]["replicas"] == 2
    assert containers["worker"].env["LLMSERVE_SCHEDULER"] == every_shard
    assert containers["gateway"].env["LLMSERVE_SCHEDULER"] == every_shard
    assert "LLMSERVE_WORKER_DNS" not in containers["scheduler"].env
    for container in containers.values():
        result = check_config(container.args, container.env)
        assert result.returncode == 0, (container.workload, result.stderr)
    # Workers may reach the shards' gRPC port (leases).
    allowed = [
        rule
        for obj in objects
        if obj["kind"] == "NetworkPolicy"
        and obj["spec"]["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "scheduler"}}
        for rule in obj["spec"].get("ingress", [])
    ]
    assert any(
        {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "worker"}}} in rule["from"]
        and {"port": int(port), "protocol": "TCP"} in rule["ports"]
        for rule in allowed
    )


@pytest.mark.services
def test_disagg_overlay_runs_two_pools_each_scaled_on_its_own_metric():
    objects = render_overlay("cpu-disagg")
    deployments = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Deployment"}
    pools = {"worker": "decode", "worker-prefill": "prefill"}
    containers = {c.workload: c for c in llmserve_containers(objects)}
    for name, pool_role in pools.items():
        selector = deployments[name]["spec"]["selector"]["matchLabels"]
        assert selector == {"app.kubernetes.io/name": "worker", "llmserve.io/role": pool_role}
        labels = deployments[name]["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items()
        assert containers[name].env["LLMSERVE_ROLE"] == pool_role
        result = check_config(containers[name].args, containers[name].env)
        assert result.returncode == 0, (name, result.stderr)
    # Both pools behind the scheduler's DNS name, with the same settings but their role.
    service = next(
        o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == "worker"
    )
    assert service["spec"]["selector"] == {"app.kubernetes.io/name": "worker"}
    decode_env, prefill_env = (dict(containers[n].env) for n in pools)
    del decode_env["LLMSERVE_ROLE"], prefill_env["LLMSERVE_ROLE"]
    assert decode_env == prefill_env
    # One ScaledObject per pool on its own metric; no CPU autoscaler left on the workers.
    scaled = {
        o["spec"]["scaleTargetRef"]["name"]: o["spec"]["triggers"]
        for o in objects
        if o["kind"] == "ScaledObject"
    }
    assert set(scaled) == set(pools)
    queries = {name: " ".join(t["metadata"]["query"] for t in scaled[name]) for name in pools}
    assert "llmserve_waiting_prefill_tokens" in queries["worker-prefill"]
    assert 'role="prefill"' in queries["worker-prefill"]
    assert "llmserve_kv_cache_usage_ratio" in queries["worker"]
    assert 'role="decode"' in queries["worker"]
    for metric in ("llmserve_waiting_prefill_tokens", "llmserve_replica_role"):
        assert metric in _metric_names()
    assert not [o for o in objects if o["kind"] == "HorizontalPodAutoscaler"
                and o["spec"]["scaleTargetRef"]["name"] in pools]  # fmt: skip


def test_workers_accept_kv_blocks_from_other_workers():
    objects = render_overlay("cpu")
    [policy] = [o for o in objects if o["kind"] == "NetworkPolicy"
                and o["metadata"]["name"] == "worker-ingress"]  # fmt: skip
    worker = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "worker"}}}
    assert any(
        worker in rule["from"] and {"port": 50061, "protocol": "TCP"} in rule["ports"]
        for rule in policy["spec"]["ingress"]
    )


def _worker_autoscalers(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        obj
        for obj in objects
        if obj["kind"] in ("HorizontalPodAutoscaler", "ScaledObject")
        and obj["spec"]["scaleTargetRef"]["name"] == "worker"
    ]


def test_cpu_workers_scale_on_cpu_and_gpu_workers_only_with_keda():
    [cpu_hpa] = _worker_autoscalers(render_overlay("cpu"))
    assert cpu_hpa["kind"] == "HorizontalPodAutoscaler"
    assert cpu_hpa["spec"]["scaleTargetRef"]["kind"] == "Deployment"
    assert [m["resource"]["name"] for m in cpu_hpa["spec"]["metrics"]] == ["cpu"]
    # GPU load is not a resource metric: no autoscaler unless KEDA is there to read the
    # scheduler's serving metrics.
    assert _worker_autoscalers(render_overlay("gpu")) == []
    [scaled] = _worker_autoscalers(render_overlay("gpu-keda"))  # KEDA makes its own HPA
    assert scaled["kind"] == "ScaledObject"
    queries = " ".join(t["metadata"]["query"] for t in scaled["spec"]["triggers"])
    assert "llmserve_requests_waiting" in queries
    assert "llmserve_kv_cache_usage_ratio" in queries
    assert "llmserve_requests_waiting" in _metric_names()
    assert "llmserve_kv_cache_usage_ratio" in _metric_names()


@pytest.mark.services
def test_every_container_passes_check_config(overlay):
    _, objects = overlay
    containers = list(llmserve_containers(objects))
    assert sorted(c.workload for c in containers) == ["gateway", "scheduler", "worker"]
    for container in containers:
        result = check_config(container.args, container.env)
        assert result.returncode == 0, (container.workload, result.stderr)


def test_containers_are_locked_down_and_probed_on_their_ports(overlay):
    name, objects = overlay
    deployments = {obj["metadata"]["name"]: obj for obj in objects if obj["kind"] == "Deployment"}
    assert deployments["scheduler"]["spec"]["replicas"] == 1
    assert deployments["scheduler"]["spec"]["strategy"] == {"type": "Recreate"}
    for container in llmserve_containers(objects):
        pod = deployments[container.workload]["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert container.spec["securityContext"]["readOnlyRootFilesystem"] is True
        assert container.spec["resources"]["requests"] and container.spec["resources"]["limits"]
        assert container.spec["readinessProbe"]["grpc"]["port"] == int(
            container.env["LLMSERVE_PORT"]
        )
        assert "preStop" in container.spec["lifecycle"]
        assert pod["terminationGracePeriodSeconds"] > 0
    worker = next(c for c in llmserve_containers(objects) if c.workload == "worker")
    assert worker.spec["startupProbe"]["grpc"]["port"] == int(worker.env["LLMSERVE_PORT"])
    drain_s = float(worker.env["LLMSERVE_DRAIN_TIMEOUT_S"])
    assert (
        deployments["worker"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > drain_s
    )
    services = {obj["metadata"]["name"]: obj for obj in objects if obj["kind"] == "Service"}
    assert services["worker"]["spec"]["clusterIP"] == "None"
    scheduler = next(c for c in llmserve_containers(objects) if c.workload == "scheduler")
    assert scheduler.env["LLMSERVE_WORKER_DNS"] == f"worker:{worker.env['LLMSERVE_PORT']}"
    gpus = worker.spec["resources"]["limits"].get("nvidia.com/gpu")
    assert gpus == ("1" if name == "gpu" else None)


def test_installed_package_ships_every_cpu_kernel_source():
    # An editable install reads the sources from the checkout; the image's regular install
    # has only package-data, and without vec.h every worker fell back to the torch backend.
    import tomllib
    from fnmatch import fnmatch

    from llmserve_kernels.cpu.build import HEADERS, SOURCES

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["llmserve_kernels"]
    for name in (*SOURCES, *HEADERS):
        assert any(fnmatch(f"cpu/{name}", glob) for glob in globs), name


def test_every_cpu_kernel_file_is_in_the_build_and_its_cache_key():
    # A header left out of HEADERS would not rebuild the cached library when it changes.
    from llmserve_kernels.cpu.build import HEADERS, SOURCES

    on_disk = {
        p.name for p in (ROOT / "llmserve_kernels" / "cpu").iterdir() if p.suffix in (".h", ".cpp")
    }
    assert on_disk == {*SOURCES, *HEADERS}


def test_no_other_installed_distribution_has_a_top_level_name_of_ours():
    # transformers 5.25 requires Hugging Face's `kernels`: while our kernels package had that
    # name, one shadowed the other, and the image's workers died importing transformers.
    import tomllib
    from importlib.metadata import packages_distributions

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    ours = [pattern.removesuffix("*") for pattern in include]
    owners = packages_distributions()
    others = {name: set(owners.get(name, [])) - {"llmserve"} for name in ours}
    assert {name: dists for name, dists in others.items() if dists} == {}
