"""Per-layer forward time of a hybrid's two layer kinds on the `cpu` backend: a Gated DeltaNet
layer against a gated full-attention layer of a tiny random Qwen3.5 (tests/support/models.py
`qwen3_5`, float32, 8 layers: 6 Gated DeltaNet, 2 attention), over a prefill of N tokens and
decode steps at N tokens of context (N = 1k and 8k by default); then the gated delta rule
alone, the torch reference (`llmserve_kernels.gated_delta_rule.gated_delta_rule_chunked`) against
the C++ kernel (`llmserve_kernels.cpu.gated_delta_rule_prefill`), at the tiny model's heads and at
Qwen3-Next's (16 key heads, 32 value heads, 128 x 128).

The layers run in the real worker, timed by wrapping the model's methods: a linear-attention
layer's `_linear_attention` (projections, conv, delta rule, gated norm, output projection);
an attention layer's span from `_qkv` to `_attention_output` (projections, rotary, attention,
gate, output projection). The norms and the MLP, the same for both kinds, are left out. A
time is per layer: the sum over that kind's layers divided by their number; a decode time is
the median over `--decode-steps` steps. Each round runs every context (a fresh engine, no
prefix cache) and both delta rule implementations, in alternating order. Prints the median and
the spread (min-max) over the rounds, and the machine.

    .venv/bin/python bench/delta_rule_layers.py --rounds 3
    .venv/bin/python bench/delta_rule_layers.py --contexts 256 --delta-heads tiny  # a quick run
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import describe  # noqa: E402
from llmserve.sampling_params import SamplingParams  # noqa: E402
from llmserve_kernels import cpu as cpu_kernels  # noqa: E402
from llmserve_kernels.cpu.pool import set_num_threads  # noqa: E402
from llmserve_kernels.gated_delta_rule import gated_delta_rule_chunked  # noqa: E402
from scheduler_service.engine.offline import generate  # noqa: E402
from tests.support.engines import engine_on_worker  # noqa: E402
from tests.support.models import save_tiny_model  # noqa: E402
from worker_service.config import WorkerConfig  # noqa: E402
from worker_service.models.decoder import DecoderModel  # noqa: E402
from worker_service.worker import Worker  # noqa: E402

BLOCK = 16
QWEN3_NEXT_HEADS = (16, 32, 128, 128)  # key heads, value heads, k_dim, v_dim


class LayerTimer:
    """Wraps a model's mixer methods and records each call's tokens and seconds, per kind."""

    def __init__(self, model: DecoderModel) -> None:
        self.calls: dict[str, list[tuple[int, float]]] = {"delta": [], "attention": []}
        self._attention_start = 0.0
        linear, qkv, output = model._linear_attention, model._qkv, model._attention_output

        def timed_linear(h: torch.Tensor, *args: Any) -> torch.Tensor:
            start = time.perf_counter()
            out = linear(h, *args)
            self.calls["delta"].append((h.shape[0], time.perf_counter() - start))
            return out

        def timed_qkv(h: torch.Tensor, *args: Any) -> Any:
            self._attention_start = time.perf_counter()
            return qkv(h, *args)

        def timed_output(attn: torch.Tensor, *args: Any) -> torch.Tensor:
            out = output(attn, *args)
            seconds = time.perf_counter() - self._attention_start
            self.calls["attention"].append((attn.shape[0], seconds))
            return out

        model._linear_attention = timed_linear  # type: ignore[method-assign, assignment]
        model._qkv = timed_qkv  # type: ignore[method-assign, assignment]
        model._attention_output = timed_output  # type: ignore[method-assign, assignment]

    def reset(self) -> None:
        for calls in self.calls.values():
            calls.clear()

    def per_layer(self, kind: str, layers: int, decode: bool) -> float:
        """Seconds per layer of `kind`: the prefill's, or the median decode step's."""
        if not decode:
            return sum(s for n, s in self.calls[kind] if n > 1) / layers
        steps = [s for n, s in self.calls[kind] if n == 1]
        # Calls come layer by layer, step by step: `layers` calls make a step.
        per_step = [sum(steps[i : i + layers]) for i in range(0, len(steps), layers)]
        return statistics.median(per_step) / layers


def time_layers(
    args: argparse.Namespace, contexts: list[int]
) -> tuple[dict[tuple[int, str], list[float]], tuple[int, int, int, int]]:
    """Per (context, kind and phase): the per-layer seconds of each round; and the model's
    linear-attention heads (key heads, value heads, k_dim, v_dim)."""
    times: dict[tuple[int, str], list[float]] = {}
    longest = max(contexts) + args.decode_steps + BLOCK
    rng = random.Random(0)
    prompts = {n: [rng.randrange(2, 128) for _ in range(n)] for n in contexts}
    params = SamplingParams(temperature=0.0, max_tokens=1 + args.decode_steps, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny_model(
            "qwen3_5", Path(tmp) / "qwen3_5", max_position_embeddings=longest, sharpen=True
        )
        worker = Worker(
            WorkerConfig(
                model=str(path), block_size=BLOCK, num_threads=args.threads, attention_backend="cpu"
            )
        )
        worker.load_model()
        model = worker.model
        spec = model.arch.linear_attention
        assert spec is not None
        heads = (spec.num_k_heads, spec.num_v_heads, spec.k_dim, spec.v_dim)
        layers = {
            "delta": sum(kind.linear for kind in model.arch.layers),
            "attention": sum(not kind.linear for kind in model.arch.layers),
        }
        timer = LayerTimer(model)
        for r in range(args.rounds):
            for n in contexts if r % 2 == 0 else contexts[::-1]:
                engine = engine_on_worker(
                    worker,
                    gpu_blocks=longest // BLOCK + 8,
                    cpu_blocks=4,
                    batched_tokens=n,
                    max_model_len=longest,
                    prefix=False,
                )
                timer.reset()
                generate(engine, [prompts[n]], params)
                for kind, count in layers.items():
                    for phase in ("prefill", "decode"):
                        seconds = timer.per_layer(kind, count, decode=phase == "decode")
                        times.setdefault((n, f"{kind} {phase}"), []).append(seconds)
    return times, heads


def time_delta_rule(
    args: argparse.Namespace, contexts: list[int], heads: list[tuple[int, int, int, int]]
) -> dict[tuple[tuple[int, ...], int, str], list[float]]:
    """Per (heads, tokens, implementation): the seconds of one call in each round."""
    times: dict[tuple[tuple[int, ...], int, str], list[float]] = {}
    forms: dict[str, Callable[..., torch.Tensor]] = {
        "torch reference": gated_delta_rule_chunked,
        "C++": cpu_kernels.gated_delta_rule_prefill,
    }
    gen = torch.Generator().manual_seed(0)
    for shape in heads:
        num_k_heads, num_v_heads, k_dim, v_dim = shape
        for n in contexts:
            q = torch.randn(n, num_k_heads, k_dim, generator=gen)
            k = torch.randn(n, num_k_heads, k_dim, generator=gen)
            v = torch.randn(n, num_v_heads, v_dim, generator=gen)
            g = -1.5 * torch.rand(n, num_v_heads, generator=gen)
            beta = torch.rand(n, num_v_heads, generator=gen)
            where = (torch.tensor([0, n], dtype=torch.int32), torch.tensor([0], dtype=torch.int32))
            for r in range(args.rounds):
                for name in forms if r % 2 == 0 else list(forms)[::-1]:
                    state = torch.zeros(1, num_v_heads, k_dim, v_dim)
                    start = time.perf_counter()
                    forms[name](q, k, v, g, beta, state, *where)
                    times.setdefault((shape, n, name), []).append(time.perf_counter() - start)
    return times


def parse_heads(text: str) -> tuple[int, int, int, int]:
    """K,V,DK,DV: key heads, value heads, k_dim, v_dim."""
    num_k_heads, num_v_heads, k_dim, v_dim = (int(x) for x in text.split(","))
    return num_k_heads, num_v_heads, k_dim, v_dim


def spread(values: list[float]) -> str:
    """Median and min-max, in milliseconds."""
    ms = [1e3 * v for v in values]
    return f"{statistics.median(ms):.3f} | {min(ms):.3f}-{max(ms):.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--contexts", default="1024,8192", help="tokens, comma-separated")
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--delta-heads",
        default="tiny;qwen3-next",
        help="the delta rule's shapes, separated by ';': tiny (the model's), qwen3-next, or "
        "K,V,DK,DV (key heads, value heads, k_dim, v_dim)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    set_num_threads(args.threads)
    contexts = [int(n) for n in args.contexts.split(",")]

    layer_times, tiny = time_layers(args, contexts)
    named = {"tiny": tiny, "qwen3-next": QWEN3_NEXT_HEADS}
    heads = [named.get(name) or parse_heads(name) for name in args.delta_heads.split(";")]
    delta_times = time_delta_rule(args, contexts, heads)

    print(f"machine: {describe()}")
    print(f"{args.rounds} rounds; decode: median of {args.decode_steps} steps")
    print("| context | layer, phase | per layer median (ms) | min-max (ms) |")
    print("|---|---|---|---|")
    for (n, what), values in sorted(layer_times.items()):
        print(f"| {n} | {what} | {spread(values)} |")
    print()
    print("| heads (K, V, dk, dv) | tokens | delta rule | median (ms) | min-max (ms) |")
    print("|---|---|---|---|---|")
    for (shape, n, name), values in delta_times.items():
        print(f"| {shape} | {n} | {name} | {spread(values)} |")


if __name__ == "__main__":
    main()
