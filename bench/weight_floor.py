"""The single-stream weight-read floor that bench/vs_llama_cpp.py sets TPOT against: the bytes
one decode step must read, over the read bandwidth measured on this machine, and the report's
lines comparing llmserve's single-stream TPOT with it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

# Issue #52's single-stream target: TPOT within this many times the floor.
TARGET_RATIO = 1.3


def weight_bytes(hf_model: Path, dtype: str, gguf: Path | None = None) -> int:
    """Bytes one decode step reads: each linear layer's weight (and bias) once, lm_head
    included even when it shares the embedding's tensor, plus one embedding row. For a GGUF
    file run on its blocks (`gguf`): its matrices' bytes (a tied head is the embedding's
    tensor)."""
    import torch

    if gguf is not None:
        from gguf import GGUFReader

        tensors = GGUFReader(gguf).tensors
        return sum(int(t.n_bytes) for t in tensors if len(t.shape) == 2)
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf_model)
    with torch.device("meta"):  # shapes only, nothing allocated
        model = AutoModelForCausalLM.from_config(config)
    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    tensors = {
        id(p): p.numel()
        for m in model.modules()
        if isinstance(m, torch.nn.Linear)
        for p in (m.weight, m.bias)
        if p is not None
    }
    return (sum(tensors.values()) + config.hidden_size) * itemsize


def memory_bandwidth(threads: int, runs: int = 5) -> dict[str, Any]:
    """Read bandwidth of a plain pass over memory: x.sum() over 1 GiB, best of `runs` (the
    floor's figure: a decode step reads its weights). A copy into a second 1 GiB tensor is
    measured too, for reference (read + write bytes over its time)."""
    import torch

    torch.set_num_threads(threads)
    x = torch.ones(1 << 28, dtype=torch.float32)  # 1 GiB, touched (no lazy zero pages)
    y = torch.zeros_like(x)
    nbytes = x.numel() * x.element_size()

    def best(step: Any) -> list[float]:
        step()
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        return times

    read_s, copy_s = best(x.sum), best(lambda: y.copy_(x))
    return {
        "method": f"torch x.sum() over a 1 GiB float32 tensor, {threads} threads, best of {runs}",
        "bytes": nbytes,
        "seconds": read_s,
        "gb_per_s": nbytes / min(read_s) / 1e9,
        "copy_seconds": copy_s,
        "copy_gb_per_s": 2 * nbytes / min(copy_s) / 1e9,
    }


def floor_lines(result: dict[str, Any]) -> list[str]:
    bw = result["bandwidth"]
    lines = []
    for dtype, floor in result["floor"].items():
        ours = result["runs"].get(f"1-{dtype}", {}).get("llmserve", {})
        tpot = ours.get("tpot_ms", {}).get("p50")
        versus = (
            f"llmserve's median single-stream TPOT {tpot:.1f} ms is {tpot / floor['ms']:.2f}x "
            f"the floor (target <= {TARGET_RATIO}x)"
            if tpot
            else "no llmserve single-stream run"
        )
        lines.append(
            f"- {dtype}: {floor['bytes'] / 1e6:.1f} MB of weights per decode step / "
            f"{bw['gb_per_s']:.1f} GB/s = {floor['ms']:.2f} ms per token; {versus}."
        )
    return lines
