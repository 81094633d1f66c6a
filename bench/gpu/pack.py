"""Here, before a GPU call: everything bench/gpu/prepared.py needs on the lent GPU machine
that its image lacks, in one folder the call carries by name (`.gpu/`, which .gitignore
ignores).

- `wheels/`: for the machine's Python (3.12, manylinux x86_64), every distribution llmserve's
  runtime requirements (pyproject.toml) reach that the image does not hold
  (bench/gpu/image_packages.txt), at the version this venv runs; the ML stack (`FROM_IMAGE`)
  always comes from the image, and `PINNED` always travels (the image's may be older).
- `shapes.tar.xz`: the configuration and tokenizer of each model in `SHAPES`
  (bench/gpu/model_shape.py), which prepared.py fills with random weights there.
- `manifest.json`: what was packed, from which commit.

It checks that the call's whole load (the working tree that travels, plus `.gpu/`) fits the
device tool's 64 MiB, and prints the call to make.

    .venv/bin/python bench/gpu/pack.py
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import shutil
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

from model_shape import export  # bench/gpu/model_shape.py, beside this file
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
RESULTS = "bench/results"  # raw benchmark outputs, the bulk of the tracked tree

# The device tool's limit on what one call carries: the working tree and the carried folder.
CARRY_LIMIT_BYTES = 64 * 2**20
# The machine's interpreter, and the wheel tags pip may pick for it (pip matches each exactly).
TARGET_PYTHON = "3.12"
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)] + [
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]
# The environment markers of that machine, for requirements such as `x; python_version < '3.13'`.
TARGET_MARKERS = {
    "python_version": TARGET_PYTHON,
    "python_full_version": TARGET_PYTHON + ".3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "extra": "",
}
# Taken from the image whatever version this venv has: the ML stack built for its CUDA, and HF
# (the gpu tests compare against the image's transformers on the same GPU).
FROM_IMAGE = frozenset(
    canonicalize_name(n)
    for n in (
        "torch", "triton", "numpy", "transformers", "tokenizers", "accelerate", "sentencepiece",
        "safetensors", "huggingface-hub", "tqdm",
    )
)  # fmt: skip
# Carried even though the image has them: the generated stubs and grpc's health and
# reflection services need protobuf and grpcio at least as new as ours, pydantic a recent
# typing-extensions.
PINNED = frozenset(canonicalize_name(n) for n in ("grpcio", "protobuf", "typing-extensions"))
SHAPES = ("smollm2", "gemma3-270m")


def image_packages(path: Path = ROOT / "bench" / "gpu" / "image_packages.txt") -> set[str]:
    lines = (line.strip() for line in path.read_text().splitlines())
    return {canonicalize_name(line) for line in lines if line and not line.startswith("#")}


def runtime_requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[Requirement]:
    return [Requirement(r) for r in tomllib.loads(pyproject.read_text())["project"]["dependencies"]]


def to_carry(
    roots: list[Requirement],
    image: set[str],
    requires: dict[str, list[str]] | None = None,
) -> list[str]:
    """Canonical names of the distributions to carry: those reachable from `roots` (markers
    read for the target machine) that the image lacks, or that are `PINNED`; the
    requirements of a distribution the image provides are the image's. `requires` maps a
    name to its requirement strings (default: this venv's metadata)."""

    def requirements_of(name: str) -> list[str]:
        if requires is not None:
            return requires.get(name, [])
        return importlib.metadata.requires(name) or []

    carry: list[str] = []
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen or (req.marker is not None and not req.marker.evaluate(TARGET_MARKERS)):
            continue
        seen.add(name)
        if name in FROM_IMAGE or (name in image and name not in PINNED):
            continue
        carry.append(name)
        todo += [Requirement(r) for r in requirements_of(name)]
    return sorted(carry)


def download(names: list[str], dest: Path) -> None:
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in names]
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
         "--python-version", TARGET_PYTHON, "--implementation", "cp", *platforms,
         "-d", str(dest), *pins],
        check=True,
    )  # fmt: skip


def pack_shapes(dest: Path) -> None:
    staging = dest / "shapes"
    for spec in SHAPES:
        export(spec, staging / spec)
    with tarfile.open(dest / "shapes.tar.xz", "w:xz", preset=9) as tar:
        tar.add(staging, arcname="shapes")
    shutil.rmtree(staging)


def travelling_bytes(carry: Path) -> int:
    """What a call carrying `carry` sends: tracked and untracked-not-ignored files, and it."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.split(b"\0")  # fmt: skip
    tree = sum(
        (ROOT / f.decode()).stat().st_size for f in listed if f and (ROOT / f.decode()).is_file()
    )
    return tree + sum(f.stat().st_size for f in carry.rglob("*") if f.is_file())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dest", type=Path, default=ROOT / ".gpu")
    args = p.parse_args()
    shutil.rmtree(args.dest, ignore_errors=True)
    args.dest.mkdir(parents=True)
    names = to_carry(runtime_requirements(), image_packages())
    download(names, args.dest / "wheels")
    pack_shapes(args.dest)
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    manifest = {
        "commit": commit,
        "wheels": sorted(w.name for w in (args.dest / "wheels").iterdir()),
        "shapes": list(SHAPES),
    }
    (args.dest / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    size = travelling_bytes(args.dest)
    print(f"{args.dest}: {len(manifest['wheels'])} wheels, shapes of {', '.join(SHAPES)}")
    print(f"a call carrying it sends {size / 2**20:.1f} MiB of {CARRY_LIMIT_BYTES / 2**20:.0f}")
    if size > CARRY_LIMIT_BYTES:
        sys.exit(
            "over the device tool's limit: carry less. The benchmarks' raw results need not"
            " travel; for the call, leave them out of git's index and exclude them:\n"
            f"  git rm -r -q --cached {RESULTS} && echo /{RESULTS}/ >> .git/info/exclude\n"
            "and after it, restore both:\n"
            f"  git reset -q -- {RESULTS} && sed -i '\\#^/{RESULTS}/$#d' .git/info/exclude"
        )
    rel = args.dest.relative_to(ROOT)
    print(f'device run: carry ["{rel}"], timeout_s 600, command: python3 bench/gpu/prepared.py '
          f"--carry {rel}")  # fmt: skip


if __name__ == "__main__":
    main()
