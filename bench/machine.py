"""The machine a benchmark ran on, named for its results: the CPU's model, the instruction
sets llmserve's CPU kernels were built for, the threads torch uses (and the GPU, when there
is one)."""

from __future__ import annotations

import platform
from pathlib import Path

import torch

from llmserve_kernels.cpu.build import NativeKernelUnavailable, isa


def describe() -> str:
    cpu = platform.processor() or platform.machine()
    info = Path("/proc/cpuinfo")
    if info.exists():
        fields: dict[str, list[str]] = {}
        for line in info.read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), []).append(value.strip())
        names = fields.get("model name", [])
        if names:
            family, model = fields.get("cpu family", ["?"])[0], fields.get("model", ["?"])[0]
            cpu = f"{names[0]} (family {family} model {model}) x {len(names)}"
    try:
        kernels = f", kernels {'+'.join(isa()) or 'scalar'}"
    except NativeKernelUnavailable:
        kernels = ", no native kernels"
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return f"{cpu}{kernels}, {torch.get_num_threads()} torch threads{gpu}"
