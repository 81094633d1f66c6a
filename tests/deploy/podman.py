"""podman and podman-compose for the deploy test: images, the stack's project, its cleanup."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.deploy.manifests import ROOT

CONTAINERS_CONF = ROOT / "deploy" / "podman" / "containers.conf"
BASE_IMAGE = "localhost/llmserve-base:bookworm"
WHEELHOUSE = ROOT / "deploy" / "wheelhouse"
COMPOSE_FILES = ("docker-compose.yml", "tests/deploy/compose.test.yml")


def engine_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF), **extra}


def run(
    command: list[str], env: dict[str, str] | None = None, timeout: float = 900, check: bool = True
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        command, env=env or engine_env(), capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(command)} exited {result.returncode}:\n{result.stdout[-3000:]}\n"
            f"{result.stderr[-5000:]}"
        )
    return result


def podman(
    *args: str, timeout: float = 900, check: bool = True
) -> subprocess.CompletedProcess[str]:
    return run(["podman", *args], timeout=timeout, check=check)


def image_exists(name: str) -> bool:
    return podman("image", "exists", name, check=False).returncode == 0


def image_id(name: str) -> str | None:
    result = podman("image", "inspect", "--format", "{{.Id}}", name, check=False)
    return result.stdout.strip() if result.returncode == 0 else None


def remove_replaced_image(name: str, previous_id: str | None) -> None:
    """After a rebuild moved `name` to a new image, remove the one it was on, with the layers
    that only it used. Every source change gives a new image: kept, they fill the disk of a
    machine that runs this test once per commit."""
    if previous_id is not None and image_id(name) != previous_id:
        # A container left by an interrupted run may still hold it: then it stays.
        podman("rmi", previous_id, check=False)


def ensure_base_image() -> None:
    """A Python 3.11 base from Debian's packages (no image registry is reachable here);
    built once per machine, then reused like any pulled base."""
    if image_exists(BASE_IMAGE):
        return
    with tempfile.TemporaryDirectory() as scratch:
        tar = Path(scratch) / "base.tar"
        run(
            [
                "mmdebstrap",
                "--variant=apt",
                "--include=python3,python3-venv,ca-certificates",
                "bookworm",
                str(tar),
            ],
            timeout=900,
        )
        podman("import", str(tar), BASE_IMAGE)


def ensure_wheelhouse() -> None:
    """The image installs from local wheels: pip inside a build reaches no index here."""
    if not list(WHEELHOUSE.glob("torch-*.whl")):
        run(["scripts/wheelhouse.sh"], env={**os.environ, "PYTHON": sys.executable}, timeout=1200)


def build_stand_ins(jaeger_image: str, prometheus_image: str) -> None:
    """Local images under the public Jaeger and Prometheus names, so the compose file runs
    as users run it."""
    with tempfile.TemporaryDirectory() as context:
        import rotel

        shutil.copy(Path(rotel.__file__).parent / "rotel-agent", Path(context) / "rotel-agent")
        podman(
            "build",
            "-t",
            jaeger_image,
            "--build-arg",
            f"BASE_IMAGE={BASE_IMAGE}",
            "-f",
            str(ROOT / "tests/deploy/images/otlp-collector.Dockerfile"),
            context,
        )
    podman(
        "build",
        "-t",
        prometheus_image,
        "--build-arg",
        f"BASE_IMAGE={BASE_IMAGE}",
        "-f",
        str(ROOT / "tests/deploy/images/prometheus.Dockerfile"),
        str(ROOT / "tests/deploy/images"),
    )


def podman_volumes() -> list[str]:
    return podman("volume", "ls", "--format", "{{.Name}}").stdout.split()


class ComposeProject:
    """One podman-compose project of docker-compose.yml, with the test's variables."""

    def __init__(self, name: str, variables: dict[str, str]) -> None:
        self.name = name
        self.env = engine_env(**variables)
        self.volumes_before: set[str] = set()
        # Override files added by a test (docker-compose.shards.yml), after COMPOSE_FILES.
        self.extra_files: list[str] = []

    def compose(self, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
        names = [*COMPOSE_FILES, *self.extra_files]
        files = [arg for name in names for arg in ("-f", str(ROOT / name))]
        return run(
            [sys.executable, "-m", "podman_compose", "-p", self.name, *files, *args],
            env=self.env,
            timeout=timeout,
        )

    def containers(self, *filters: str) -> list[dict[str, Any]]:
        result = podman(
            "ps",
            "-a",
            "--format",
            "json",
            "--filter",
            f"label=io.podman.compose.project={self.name}",
            *filters,
        )
        return json.loads(result.stdout or "[]")

    def container_of(self, service: str) -> list[str]:
        return sorted(
            c["Names"][0]
            for c in self.containers()
            if c.get("Labels", {}).get("com.docker.compose.service") == service
        )

    def logs(self, service: str) -> str:
        results = [podman("logs", name, check=False) for name in self.container_of(service)]
        return "\n".join(r.stdout + r.stderr for r in results)

    def environment(self, container: str) -> list[str]:
        """The container's environment, as NAME=value strings."""
        result = podman("inspect", "--format", "{{json .Config.Env}}", container)
        return json.loads(result.stdout)

    def describe(self, *services: str, tail: int = 3000) -> str:
        """Every container of the project with its state, then the last `tail` characters
        of each of `services`' logs: what a failed wait reports."""
        lines = [
            f"{c['Names'][0]}: {c.get('State')} ({c.get('Status')})" for c in self.containers()
        ]
        for service in services:
            lines.append(f"--- {service} ---\n{self.logs(service)[-tail:]}")
        return "\n".join(lines)

    def volumes(self) -> list[str]:
        result = podman(
            "volume",
            "ls",
            "--format",
            "{{.Name}}",
            "--filter",
            f"label=io.podman.compose.project={self.name}",
        )
        return result.stdout.split()

    def networks(self) -> list[str]:
        names = podman("network", "ls", "--format", "{{.Name}}").stdout.split()
        return [name for name in names if name.startswith(self.name)]


def get_json(url: str, timeout: float = 10) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return json.loads(reply.read())


def post_json(url: str, body: dict[str, Any], timeout: float = 120) -> Any:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return json.loads(reply.read())


def wait_until(
    predicate: Any,
    timeout_s: float,
    what: str,
    interval_s: float = 2.0,
    explain: Callable[[], str] | None = None,
) -> Any:
    """Poll `predicate` until it returns something truthy; errors count as not yet. On a
    timeout the error carries `explain()` (the stack's state), if given."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # the service may not answer yet
            last_error = exc
        time.sleep(interval_s)
    message = f"{what} not within {timeout_s:.0f} s (last error: {last_error})"
    if explain is not None:
        try:
            message += "\n" + explain()
        except Exception as exc:  # the explanation must not hide the timeout
            message += f"\n(no explanation: {exc!r})"
    raise AssertionError(message)
