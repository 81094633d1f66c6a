"""bench/gpu/: what pack.py carries (the requirement walk, on made-up metadata and on this
repository's own), and how prepared.py runs its stages under their caps (real
subprocesses) and names every gpu-test file."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench" / "gpu"))
from pack import (  # noqa: E402
    FROM_IMAGE,
    PINNED,
    image_packages,
    runtime_requirements,
    to_carry,
)
from prepared import GPU_TESTS, Stage, run_stage  # noqa: E402


def test_the_walk_carries_what_the_image_lacks_and_what_it_needs() -> None:
    requires = {
        "web": ["anyio>=4", "models>=2", "old; python_version < '3.10'"],
        "models": ["typing-extensions>=4.16", "tiny"],
        "tiny": [],
        "grpcio": ["typing-extensions"],
        # Behind the image's own distribution: its needs are the image's.
        "anyio": ["never-walked"],
        "torch": ["never-walked"],
    }
    roots = [
        Requirement(r) for r in ("web", "grpcio", "anyio", "torch", "win; sys_platform == 'win32'")
    ]
    carried = to_carry(roots, image={"anyio", "grpcio", "typing-extensions"}, requires=requires)
    # grpcio and typing-extensions are in the image but pinned; anyio is the image's, and so is
    # its requirement; torch always comes from the image; markers are read for Linux, 3.12.
    assert carried == ["grpcio", "models", "tiny", "typing-extensions", "web"]


def test_this_repository_s_runtime_is_covered_by_the_image_or_the_carry() -> None:
    image = image_packages()
    carried = set(to_carry(runtime_requirements(), image))
    for req in runtime_requirements():
        name = req.name.lower()
        assert name in carried or name in image or name in FROM_IMAGE, name
    assert carried >= PINNED
    assert not carried & FROM_IMAGE


def test_every_file_with_gpu_tests_is_in_the_list_prepared_runs() -> None:
    marked = {
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "tests").rglob("*.py")
        if re.search(r"mark\.gpu\b", path.read_text())
    }
    assert marked, "no gpu-marked test found: the pattern is stale"
    for name in marked:
        assert any(name == t or name.startswith(t + "/") for t in GPU_TESTS), name
    for listed in GPU_TESTS:
        assert (ROOT / listed).exists(), listed


def test_a_stage_past_its_cap_is_killed_with_its_children(tmp_path: Path) -> None:
    # The stage starts two children that outlive it unless each is killed: one in its process
    # group, one in a session of its own (as `llmserve up` starts its services).
    command = [
        "bash",
        "-c",
        f"sleep 600 & echo $! > {tmp_path}/a; setsid sleep 600 & echo $! > {tmp_path}/b; wait",
    ]
    # bash's background children ignore the SIGINT: only the kill that follows ends them.
    stage = Stage("slow", command, cap_s=1.0, stop_grace_s=1.0)
    outcome = run_stage(stage, 100.0, tmp_path / "slow.log", {})
    assert outcome.status == "timed out (1 s)"
    for name in ("a", "b"):
        stat = Path(f"/proc/{int((tmp_path / name).read_text())}/stat")
        assert not stat.exists() or stat.read_text().split()[2] == "Z", name


def test_stages_report_failure_and_are_skipped_when_time_is_short(tmp_path: Path) -> None:
    ok = run_stage(Stage("ok", ["bash", "-c", "echo hi"], cap_s=60), 100.0, tmp_path / "a.log", {})
    failed = run_stage(
        Stage("bad", ["bash", "-c", "exit 3"], cap_s=60), 100.0, tmp_path / "b.log", {}
    )
    skipped = run_stage(Stage("big", ["true"], cap_s=60, min_s=50), 40.0, tmp_path / "c.log", {})
    assert (ok.status, failed.status) == ("ok", "failed (rc 3)")
    assert (tmp_path / "a.log").read_text() == "hi\n"
    assert skipped.status == "skipped (40 s left, needs 50)" and not (tmp_path / "c.log").exists()
