"""The package layout is the architecture: imports only run downwards.

``pagedserve/`` is the base both services import; the services never import each other;
inside the scheduler, service -> ``api/`` -> ``engine/`` -> ``state/`` -> ``core/``, and the
core (the paper's block manager and scheduler) imports no torch and does no I/O. Imports
inside functions (the CLI's lazy ones) do not count: they run only when called.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pagedserve", "scheduler_svc", "executor_svc", "pagedserve_kernels")
# The scheduler's floors, lowest first.
FLOORS = ["scheduler_svc.core", "scheduler_svc.state", "scheduler_svc.engine", "scheduler_svc.api"]
ENTRY_POINTS = {"pagedserve.cli", "pagedserve.offline"}  # wire the services, lazily


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, module_level: bool = True) -> set[str]:
    """Modules ``path`` imports; ``module_level``: only those imported when it is imported
    (not in function bodies nor ``TYPE_CHECKING`` blocks). ``from package import module``
    names the module."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if module_level and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            return
        if module_level and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


SOURCES = {
    module_name(path): path
    for package in PACKAGES
    for path in sorted((ROOT / package).rglob("*.py"))
    if "rpc/v1" not in path.as_posix()
}
GRAPH = {module: imports(path) for module, path in SOURCES.items()}


def imports_of(prefix: str) -> dict[str, set[str]]:
    return {m: i for m, i in GRAPH.items() if m == prefix or m.startswith(prefix + ".")}


def under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_the_base_imports_no_service() -> None:
    for module, imported in imports_of("pagedserve").items():
        if module in ENTRY_POINTS:
            continue
        bad = {i for i in imported if under(i, "scheduler_svc") or under(i, "executor_svc")}
        assert not bad, f"{module} imports {sorted(bad)}"


def test_the_entry_points_import_the_services_only_when_called() -> None:
    for module in ENTRY_POINTS:
        bad = {i for i in GRAPH[module] if i.split(".")[0] in ("scheduler_svc", "executor_svc")}
        assert not bad, f"{module} imports {sorted(bad)} at module level"


def test_the_services_do_not_import_each_other() -> None:
    for service, other in (("scheduler_svc", "executor_svc"), ("executor_svc", "scheduler_svc")):
        for module, imported in imports_of(service).items():
            assert not {i for i in imported if under(i, other)}, f"{module} imports {other}"


@pytest.mark.parametrize("floor", FLOORS)
def test_each_scheduler_floor_imports_only_the_floors_below(floor: str) -> None:
    above = [*FLOORS[FLOORS.index(floor) + 1 :], "scheduler_svc.service", "scheduler_svc.metrics"]
    for module, imported in imports_of(floor).items():
        bad = {i for i in imported for a in above if under(i, a)}
        assert not bad, f"{module} imports {sorted(bad)} from above its floor"


def test_the_scheduler_imports_no_torch() -> None:
    for module, imported in imports_of("scheduler_svc").items():
        assert not {i for i in imported if under(i, "torch")}, module


def test_no_module_imports_itself_back() -> None:
    """No circle among the project's modules, counting lazy and type-only imports too."""
    every = {module: imports(path, module_level=False) for module, path in SOURCES.items()}
    internal = {m: {i for i in every[m] if i in every and i != m} for m in every}
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for nxt in sorted(internal[module]):
            if state.get(nxt) == 1:
                cycle = [*path[path.index(nxt) :], nxt]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[module] = 2

    for module in sorted(internal):
        if module not in state:
            visit(module, [module])
