"""The generated stubs in llmserve/v1 match a fresh protoc run over protos/."""

from __future__ import annotations

import subprocess
import sys

import pytest

from llmserve import protogen


def test_stubs_match_fresh_generation() -> None:
    assert protogen.stale_files() == []


@pytest.mark.services
def test_check_cli_passes() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "llmserve.protogen", "--check"],
        cwd=protogen.REPO_ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr


def test_check_reports_stale_and_extra_files(tmp_path) -> None:
    repo = tmp_path
    (repo / "protos").symlink_to(protogen.PROTO_ROOT)
    protogen.regenerate(repo)
    assert protogen.stale_files(repo) == []
    stub = repo / "llmserve" / "v1" / "worker_pb2.py"
    stub.write_text(stub.read_text() + "# edited\n")
    (repo / "llmserve" / "v1" / "gone_pb2.py").write_text("")
    (repo / "llmserve" / "v1" / "common_pb2.pyi").unlink()
    assert protogen.stale_files(repo) == [
        "llmserve/v1/common_pb2.pyi (missing)",
        "llmserve/v1/gone_pb2.py (no .proto generates it)",
        "llmserve/v1/worker_pb2.py (out of date)",
    ]


def test_generated_modules_import_each_other() -> None:
    from llmserve.v1 import (
        common_pb2,
        generation_pb2_grpc,
        scheduler_pb2_grpc,
        worker_pb2,
        worker_pb2_grpc,
    )

    assert (
        worker_pb2.NewSequence().sampling_params.DESCRIPTOR is common_pb2.SamplingParams.DESCRIPTOR
    )
    assert hasattr(worker_pb2_grpc, "WorkerStub")
    assert hasattr(scheduler_pb2_grpc, "add_SchedulerServicer_to_server")
    assert hasattr(generation_pb2_grpc, "GenerationServicer")
