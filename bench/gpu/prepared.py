"""There, on a freshly started GPU machine that reaches no package registry: the GPU checks
and figures in one command, inside one call's time.

Stages, in order, each a subprocess under a time cap and the whole under `--deadline-s`; a
stage that fails or runs out of time is recorded and the next one runs:
1. install: the carried wheels (bench/gpu/pack.py made them) into /tmp/site;
2. env: the GPU, its driver and the Python stack, for every figure's heading;
3. shapes: SmolLM2's and Gemma 3 270M's configurations filled with random bfloat16 weights
   (bench/gpu/model_shape.py: the real files are over what a call carries);
4. tests: `pytest -m gpu` over the files that hold gpu tests (`GPU_TESTS`), in
   `TEST_WORKERS` pytest-xdist workers;
5. serve: bench/serve_gpu.py on SmolLM2's shape at 1, 16, 64, 256 and 512 streams, where the
   steps went at each, and HF `generate` static batches on the same GPU;
6. serve-interval: the serving table at 64-512 streams with `--stream-interval 4` (the
   scheduler sends a request's tokens 4 at a time, so the gateway and the scheduler handle a
   quarter of the messages: bench/RESULTS.md, "Host time per output token");
7. graphs: bench/decode_graphs.py, eager against captured decode steps per batch size;
8. serve-gemma3: the same serving table on Gemma 3 270M's shape, llmserve only, when time is
   left.
Every output lands in one folder, bundled at the end into --out (the device tool's $OUT):
summary.md (each stage's status and time, the tables), prepared.log, gpu-run.tar.xz.

`--rehearse` runs the same stages here on the CPU, small: the install is only checked, the
tests are collected, not run, and the serving runs are short.

    python3 bench/gpu/prepared.py --carry .gpu                  # there, with OUT set
    .venv/bin/python bench/gpu/prepared.py --carry .gpu --rehearse --out /tmp/rehearsal
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SITE = Path("/tmp/site")  # where the carried wheels go there
# Every file holding gpu-marked tests, or under a folder that does (tests/unit/bench checks).
GPU_TESTS = (
    "tests/kernels",
    "tests/integration/test_gpu_families.py",
    "tests/integration/test_gpu_memory.py",
    "tests/integration/test_gpu_smollm2.py",
)
# pytest-xdist workers for the gpu tests where the image has it (it does: KINDS.md).
TEST_WORKERS = 4
# What the device tool waits for one command, less a stage's stop and the bundling.
DEADLINE_S = 560.0
# How long an interrupted stage has to stop its servers before it is killed.
STOP_GRACE_S = 20.0


@dataclass
class Stage:
    name: str
    command: list[str]
    cap_s: float  # at most this long
    min_s: float = 0.0  # skipped when less than this is left
    # Past its cap: how long it has to stop after SIGINT, then its descendants to exit.
    stop_grace_s: float = STOP_GRACE_S


@dataclass
class Outcome:
    name: str
    status: str  # ok, failed (rc N), timed out, skipped (why)
    seconds: float


def stages(work: Path, carry: Path, rehearse: bool) -> list[Stage]:
    py = sys.executable
    shapes = work / "shapes"
    smollm2, gemma3 = shapes / "smollm2", shapes / "gemma3-270m"
    if rehearse:
        wheels = sorted((carry / "wheels").glob("*.whl"))
        install = [py, "-c", _CHECK_WHEELS, str(carry / "manifest.json"), *map(str, wheels)]
    else:
        install = [py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                   "--no-cache-dir", "--upgrade", "--target", str(SITE),
                   *map(str, sorted((carry / "wheels").glob("*.whl")))]  # fmt: skip
    init = f"tar -C {work} -xJf {carry / 'shapes.tar.xz'}" + "".join(
        f" && {py} bench/gpu/model_shape.py init {d}" for d in (smollm2, gemma3)
    )
    tests = [py, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "-v", "-rfE",
             "--timeout", "300", f"--junitxml={work / 'gpu-tests.xml'}", *GPU_TESTS]  # fmt: skip
    if rehearse:
        tests.append("--collect-only")
    elif importlib.util.find_spec("xdist") is not None:
        # Most of the tests' time is Triton compiling each kernel variant on the host's CPU:
        # workers compile side by side on the one GPU.
        tests += ["-n", str(TEST_WORKERS)]
    small = ["--streams", "1", "2", "--hf-batches", "1", "--input-len", "16",
             "--output-len", "8", "--min-prompts", "2", "--max-duration", "60"]  # fmt: skip

    def serve(name: str, model: Path, label: str, *extra: str, streams: str = "") -> Stage:
        """bench/serve_gpu.py on `model`, into work/<name>; `streams` replaces its default
        stream counts (rehearsals run 1 and 2)."""
        command = [py, "bench/serve_gpu.py", "--dtype", "bfloat16", "--skip", "hf-cb",
                   "--max-duration", "30", "--model", str(model), "--model-label", label,
                   "--out-dir", str(work / name), *extra]  # fmt: skip
        if rehearse:
            command += small
        elif streams:
            command += ["--streams", *streams.split()]
        return Stage(name, command, cap_s=240, min_s=120)

    graphs = [py, "bench/decode_graphs.py", "--model", str(smollm2), "--out",
              str(work / "graphs.json")]  # fmt: skip
    return [
        Stage("install", install, cap_s=90),
        Stage("env", [py, "-c", _ENV], cap_s=30),
        Stage("shapes", ["bash", "-c", init], cap_s=150),
        Stage("tests", tests, cap_s=220),
        serve("serve", smollm2, "SmolLM2-135M shape (random weights)"),
        # The first H200 run found the services' host time, not the device, setting the pace
        # at 256 streams: the same table with a quarter of the messages per token.
        serve(
            "serve-interval",
            smollm2,
            "SmolLM2-135M shape (random weights), --stream-interval 4",
            "--skip",
            "hf",
            "--up-env",
            "LLMSERVE_STREAM_INTERVAL=4",
            streams="64 256 512",
        ),
        Stage("graphs", graphs, cap_s=75, min_s=45),
        serve(
            "serve-gemma3",
            gemma3,
            "Gemma 3 270M shape (random weights)",
            "--endpoint",
            "completions",
            "--max-model-len",
            "4096",
            "--skip",
            "hf",
            streams="1 64 256 512",
        ),
    ]


# Rehearsal's install check: every wheel the manifest lists is there, built for 3.12 or any.
_CHECK_WHEELS = """
import json, sys
from pathlib import Path
listed = set(json.loads(Path(sys.argv[1]).read_text())["wheels"])
present = {Path(w).name for w in sys.argv[2:]}
missing = listed - present
foreign = [w for w in present if "-cp" in w and not any(t in w for t in ("cp312", "abi3"))]
print(f"{len(present)} wheels; missing {sorted(missing)}; not for cp312 {foreign}")
sys.exit(1 if missing or foreign else 0)
"""

_ENV = """
import subprocess, sys
import torch, triton, transformers
try:
    print(subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,"
          "clocks.max.sm,clocks.max.mem", "--format=csv"], capture_output=True, text=True,
          check=True).stdout, end="")
except (FileNotFoundError, subprocess.CalledProcessError) as exc:
    print("nvidia-smi:", exc)
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "triton", triton.__version__, "transformers", transformers.__version__,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device")
"""


def run_stage(stage: Stage, left_s: float, log: Path, env: dict[str, str]) -> Outcome:
    """Run `stage` with at most min(its cap, `left_s`), its output to `log`."""
    if left_s < max(stage.min_s, 1.0):
        return Outcome(stage.name, f"skipped ({left_s:.0f} s left, needs {stage.min_s:.0f})", 0)
    limit = min(stage.cap_s, left_s)
    start = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            stage.command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
            env=env, start_new_session=True,
        )  # fmt: skip
        try:
            rc = proc.wait(timeout=limit)
            status = "ok" if rc == 0 else f"failed (rc {rc})"
        except subprocess.TimeoutExpired:
            stop_tree(proc, stage.stop_grace_s)
            status = f"timed out ({limit:.0f} s)"
    return Outcome(stage.name, status, time.monotonic() - start)


def stop_tree(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """Interrupt a stage (its Python code stops the servers it started), then kill whatever
    of it is left: its process group and every descendant, also those in sessions of their
    own (`llmserve up` starts each service in one), which would otherwise keep the GPU."""
    import psutil  # in the image and in our venv; only needed here

    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    for p in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    psutil.wait_procs(family, timeout=grace_s)


def summary(outcomes: list[Outcome], work: Path) -> str:
    lines = ["| stage | status | seconds |", "|---|---|---|"]
    lines += [f"| {o.name} | {o.status} | {o.seconds:.0f} |" for o in outcomes]
    for title, path in (
        ("Environment", work / "env.log"),
        ("Serving, SmolLM2 shape", work / "serve" / "serve-gpu.md"),
        ("Serving, SmolLM2 shape, --stream-interval 4", work / "serve-interval" / "serve-gpu.md"),
        ("Serving, Gemma 3 270M shape", work / "serve-gemma3" / "serve-gpu.md"),
        ("Decode steps, eager and graphs", work / "graphs.log"),
    ):
        if path.is_file():
            lines += ["", f"## {title}", "", path.read_text().strip()]
    tests = work / "tests.log"
    if tests.is_file():
        tail = [
            line
            for line in tests.read_text().splitlines()
            if line.startswith(("FAILED", "ERROR", "="))
        ]
        lines += ["", "## pytest -m gpu", "", *tail[-40:]]
    return "\n".join(lines) + "\n"


def bundle(work: Path, out: Path) -> None:
    """The work folder, less the model weights and tokenizers, as one archive."""

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        parts = Path(info.name).parts
        return None if "shapes" in parts or "tokenizer" in parts else info

    with tarfile.open(out / "gpu-run.tar.xz", "w:xz") as tar:
        tar.add(work, arcname="gpu-run", filter=keep)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--carry", type=Path, required=True, help="the folder pack.py wrote")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/gpu-out")))
    p.add_argument("--work", type=Path, default=Path("/tmp/gpu-run"))
    p.add_argument("--deadline-s", type=float, default=DEADLINE_S)
    p.add_argument("--rehearse", action="store_true", help="here, on the CPU, small")
    p.add_argument("--only", nargs="*", default=None, help="these stages (and shapes) alone")
    args = p.parse_args()
    started = time.monotonic()
    carry = args.carry if args.carry.is_absolute() else ROOT / args.carry
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    site = [] if args.rehearse else [str(SITE)]
    env["PYTHONPATH"] = os.pathsep.join([*site, str(ROOT), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    outcomes: list[Outcome] = []
    for stage in stages(args.work, carry, args.rehearse):
        if args.only is not None and stage.name not in {"shapes", *args.only}:
            continue
        left = args.deadline_s - (time.monotonic() - started)
        outcome = run_stage(stage, left, args.work / f"{stage.name}.log", env)
        outcomes.append(outcome)
        print(f"{outcome.name}: {outcome.status}, {outcome.seconds:.0f} s", flush=True)
        (args.work / "stages.json").write_text(json.dumps([o.__dict__ for o in outcomes]))
    text = summary(outcomes, args.work)
    (args.out / "summary.md").write_text(text)
    with (args.out / "prepared.log").open("w") as log:
        for o in outcomes:
            path = args.work / f"{o.name}.log"
            log.write(f"==== {o.name}: {o.status}\n")
            log.write(path.read_text(errors="replace")[-200_000:] if path.is_file() else "")
    bundle(args.work, args.out)
    print(text)


if __name__ == "__main__":
    main()
