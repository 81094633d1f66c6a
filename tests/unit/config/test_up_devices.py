"""`llmserve up --workers N` on CUDA: one device per worker, or a refusal; and the plan of
`--schedulers N` shards."""

from __future__ import annotations

import pytest

import llmserve.supervisor
from llmserve import cli
from llmserve.supervisor import (
    DeviceAssignmentError,
    StackConfig,
    assign_cuda_devices,
    plan_stack,
)


def test_each_worker_gets_a_device_of_its_own() -> None:
    assert assign_cuda_devices(2, ["3", "5", "6"]) == ["3", "5"]
    assert assign_cuda_devices(3, ["3", "5", "6"]) == ["3", "5", "6"]


def test_without_cuda_workers_are_left_alone() -> None:
    assert assign_cuda_devices(3, []) == [None, None, None]


def test_more_workers_than_devices_is_refused() -> None:
    with pytest.raises(DeviceAssignmentError, match="--workers 3 needs 3 CUDA devices"):
        assign_cuda_devices(3, ["0", "1"])


def test_the_plan_sets_each_workers_visible_device() -> None:
    specs = plan_stack(StackConfig(num_workers=2, worker_devices=["1", "0"]))
    workers = [s for s in specs if s.name.startswith("worker-")]
    assert [w.env for w in workers] == [
        {"CUDA_VISIBLE_DEVICES": "1"},
        {"CUDA_VISIBLE_DEVICES": "0"},
    ]
    others = [s for s in specs if not s.name.startswith("worker-")]
    assert all(s.env == {} for s in others)


def test_shards_split_the_workers_and_the_gateway_knows_them_all() -> None:
    specs = plan_stack(StackConfig(num_workers=5, num_schedulers=2))
    workers = [s.grpc_address for s in specs if s.name.startswith("worker-")]
    shards = [s for s in specs if s.name.startswith("scheduler")]
    assert [s.name for s in shards] == ["scheduler-0", "scheduler-1"]

    def flag(spec, name):  # type: ignore[no-untyped-def]
        return spec.args[spec.args.index(name) + 1]

    assert [flag(s, "--workers").split(",") for s in shards] == [workers[0::2], workers[1::2]]
    assert [flag(s, "--shard-name") for s in shards] == ["scheduler-0", "scheduler-1"]
    gateway = next(s for s in specs if s.name == "gateway")
    assert flag(gateway, "--scheduler").split(",") == [s.grpc_address for s in shards]
    # Unsharded, the one scheduler keeps its name and every worker.
    single = [s for s in plan_stack(StackConfig(num_workers=2)) if s.name.startswith("sched")]
    assert [s.name for s in single] == ["scheduler"] and "--shard-name" not in single[0].args


def test_prefill_and_decode_workers_get_their_roles(captured: list[StackConfig]) -> None:
    assert cli.main(["up", "--prefill-workers", "1", "--decode-workers", "2"]) == 0
    [config] = captured
    assert config.num_workers == 3 and config.worker_roles == ["prefill", "decode", "decode"]
    workers = [s for s in plan_stack(config) if s.name.startswith("worker-")]
    roles = [s.args[s.args.index("--role") + 1] for s in workers]
    assert roles == ["prefill", "decode", "decode"]
    # Plain `up` passes no role (the worker's default, mixed).
    assert all("--role" not in s.args for s in plan_stack(StackConfig(num_workers=2)))


def test_prefill_workers_alone_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["up", "--prefill-workers", "2"])
    assert "--prefill-workers needs a worker to hand requests to" in capsys.readouterr().err


def test_more_shards_than_workers_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["up", "--workers", "1", "--schedulers", "2"])
    assert "--schedulers must be between 1 and --workers" in capsys.readouterr().err


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[StackConfig]:
    seen: list[StackConfig] = []

    async def fake_run_stack(config: StackConfig) -> int:
        seen.append(config)
        return 0

    monkeypatch.setattr(llmserve.supervisor, "run_stack", fake_run_stack)
    monkeypatch.setattr(cli, "configure_logging", lambda *args: None)
    return seen


def test_up_refuses_to_share_a_gpu(
    monkeypatch: pytest.MonkeyPatch, captured: list[StackConfig], capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(SystemExit) as exited:
        cli.main(["up", "--workers", "2"])
    assert exited.value.code == 2
    assert "--workers 2 needs 2 CUDA devices, this machine shows 1" in capsys.readouterr().err
    assert captured == []


def test_up_pins_workers_and_passes_gpu_flags(
    monkeypatch: pytest.MonkeyPatch, captured: list[StackConfig]
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    argv = ["up", "--workers", "2", "--gpu-memory-utilization", "0.5", "--enforce-eager"]
    assert cli.main(argv) == 0
    (config,) = captured
    assert config.worker_devices == ["2", "3"]
    assert config.worker_args[:3] == ["--gpu-memory-utilization", "0.5", "--log-level"]
    assert "--enforce-eager" in config.worker_args


def test_up_on_cpu_ignores_gpus(
    monkeypatch: pytest.MonkeyPatch, captured: list[StackConfig]
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert cli.main(["up", "--workers", "2", "--device", "cpu"]) == 0
    assert captured[0].worker_devices == [None, None]
