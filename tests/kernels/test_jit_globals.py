"""Compiled Triton kernels read only constexpr globals; the interpreter (how the kernels run
in CI) reads any. A jit function that uses a plain module-level number runs on CPU and fails
to compile on a GPU, as `_soft_cap`'s LOG2E once did. This scans every jit function's body for
global names that are neither constexpr, nor modules, nor callables."""

from __future__ import annotations

import ast
import importlib
import inspect
import types

import pytest
import triton.language as tl

KERNEL_MODULES = [
    "llmserve_kernels.cache_ops",
    "llmserve_kernels.paged_decode_kernels",
    "llmserve_kernels.prefill_attention",
    "llmserve_kernels.quant_matmul",
]


def is_jit(node: ast.FunctionDef) -> bool:
    return any("jit" in ast.unparse(d) for d in node.decorator_list)


def bad_globals(source: str, namespace: dict[str, object]) -> list[str]:
    """`function: name = value` for each global that a jit function of a module (its `source`
    and its `namespace`) reads and compiled Triton would refuse."""
    found = []
    tree = ast.parse(source)
    for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef) and is_jit(n)):
        local = {a.arg for a in fn.args.args} | {
            t.id for n in ast.walk(fn) if isinstance(n, ast.Assign) for t in n.targets
            if isinstance(t, ast.Name)
        }  # fmt: skip
        for node in ast.walk(fn):
            if not (isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)):
                continue
            if node.id in local or node.id not in namespace:
                continue
            value = namespace[node.id]
            if isinstance(value, (types.ModuleType, tl.constexpr)) or callable(value):
                continue
            found.append(f"{fn.name}: {node.id} = {value!r}")
    return found


@pytest.mark.parametrize("name", KERNEL_MODULES)
def test_jit_functions_read_only_constexpr_globals(name: str) -> None:
    module = importlib.import_module(name)
    assert bad_globals(inspect.getsource(module), vars(module)) == []


def test_the_scan_finds_a_plain_float_global() -> None:
    source = (
        "import triton\nSCALE = 2.0\nHALF = tl.constexpr(0.5)\n\n"
        "@triton.jit\ndef f(x):\n    y = x * SCALE * HALF\n    return y\n"
    )
    namespace: dict[str, object] = {"SCALE": 2.0, "HALF": tl.constexpr(0.5)}
    assert bad_globals(source, namespace) == ["f: SCALE = 2.0"]
