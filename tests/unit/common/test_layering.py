"""The rooms import downward, read off the source with `ast` (every import counts: lazy ones
inside functions and those under TYPE_CHECKING too, since a tangle of types is still a
tangle):

- no import circles among the project's modules;
- `llmserve/`, the floor every service stands on, imports no service;
- `scheduler_service/engine/`, the synchronous engine, imports neither the fleet (its owner,
  which calls down into it) nor grpc nor asyncio.

Generated protobuf modules (`*_pb2*.py`) are left out, as ../shared/tools/import_cycles.py
leaves them out."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("llmserve", "gateway", "scheduler_service", "worker_service", "llmserve_kernels")
SERVICES = ("gateway", "scheduler_service", "worker_service")


@dataclass(frozen=True, slots=True)
class Import:
    target: str  # absolute dotted name: a module, or a name inside one
    line: int


def module_name(path: Path, root: Path) -> str:
    name = ".".join(path.relative_to(root).with_suffix("").parts)
    return name.removesuffix(".__init__")


def imports_of(source: str, module: str, is_package: bool) -> list[Import]:
    """Every import in `source` (the module `module`), anywhere in it, relative ones made
    absolute. `from a import b` gives `a.b` (b may be a module or a name in a)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [Import(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join([*package, *([base] if base else [])])
            found += [Import(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return found


def project_modules(root: Path) -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            if "_pb2" not in path.name:
                modules[module_name(path, root)] = path
    return modules


MODULES = project_modules(ROOT)
IMPORTS = {
    name: imports_of(path.read_text(encoding="utf-8"), name, path.name == "__init__.py")
    for name, path in MODULES.items()
}


def resolve(target: str, modules: Iterable[str]) -> str | None:
    """The project module `target` is, or lives in (the longest such name); None outside."""
    known = set(modules)
    while target and target not in known:
        target = target.rpartition(".")[0]
    return target or None


def import_graph(imports: dict[str, list[Import]]) -> dict[str, set[str]]:
    """Module -> the project modules it imports. A module importing its own package (or an
    enclosing one) is no edge: that `__init__` runs first anyway."""
    graph: dict[str, set[str]] = {name: set() for name in imports}
    for name, found in imports.items():
        for imp in found:
            target = resolve(imp.target, imports)
            if target and target != name and not name.startswith(target + "."):
                graph[name].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of two or more modules (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def describe(circle: list[str], graph: dict[str, set[str]]) -> str:
    edges = [f"    {a} -> {b}" for a in circle for b in sorted(graph[a] & set(circle))]
    return "\n".join([f"circle of {len(circle)}: {', '.join(circle)}", *edges])


def in_package(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


# -- the checker itself ------------------------------------------------------------------------


def test_lazy_relative_and_type_checking_imports_are_seen() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "import asyncio.events\n"
        "from . import sibling\n"
        "from ..up import thing\n"
        "if TYPE_CHECKING:\n"
        "    from gateway.server import GatewayConfig\n"
        "def f():\n"
        "    import worker_service.worker\n"
    )
    found = imports_of(source, "pkg.sub.mod", is_package=False)
    assert [(i.target, i.line) for i in found] == [
        ("typing.TYPE_CHECKING", 1),
        ("asyncio.events", 2),
        ("pkg.sub.sibling", 3),
        ("pkg.up.thing", 4),
        ("gateway.server.GatewayConfig", 6),
        ("worker_service.worker", 8),
    ]
    # In a package's __init__, `.` is the package itself.
    assert imports_of("from .a import b\n", "pkg.sub", is_package=True)[0].target == "pkg.sub.a.b"


def test_circles_are_found_with_their_edges() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]
    assert describe(["a", "b", "c"], graph).splitlines()[1:] == [
        "    a -> b",
        "    b -> c",
        "    c -> a",
    ]
    imports = {"p": [], "p.x": [Import("p.y.f", 1)], "p.y": [Import("p", 1), Import("p.x", 2)]}
    assert import_graph(imports) == {"p": set(), "p.x": {"p.y"}, "p.y": {"p.x"}}


def test_every_package_was_read() -> None:
    assert {name.split(".")[0] for name in MODULES} == set(PACKAGES)
    assert "scheduler_service.engine.scheduler" in MODULES and "llmserve.cli" in MODULES


# -- the rules ---------------------------------------------------------------------------------


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circles(package: str) -> None:
    """Per package, the circles that touch it (a circle across packages fails each)."""
    graph = import_graph(IMPORTS)
    found = [c for c in circles(graph) if any(in_package(m, package) for m in c)]
    assert not found, f"{len(found)} import circle(s):\n" + "\n".join(
        describe(c, graph) for c in found
    )


def offending(package: str, forbidden: Iterable[str]) -> list[str]:
    """`module:line -> target` for each import from `package` into a forbidden one."""
    forbidden = tuple(forbidden)
    return [
        f"{name}:{imp.line} -> {imp.target}"
        for name, found in IMPORTS.items()
        if in_package(name, package)
        for imp in found
        if any(in_package(imp.target, f) for f in forbidden)
    ]


def test_the_floor_imports_no_service() -> None:
    assert offending("llmserve", SERVICES) == []


def test_the_engine_imports_neither_the_fleet_nor_grpc_nor_asyncio() -> None:
    forbidden = ("scheduler_service.fleet", "grpc", "asyncio")
    assert offending("scheduler_service.engine", forbidden) == []
