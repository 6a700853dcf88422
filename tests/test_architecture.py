"""The package's layout holds: layers that import one way, no cycles, no private names across subpackages.

Every import counts here, at module level, inside functions and under ``TYPE_CHECKING`` alike (Python runs
the first two, and a type checker the third). The layers themselves are import-linter's contracts in
``pyproject.toml``; this file runs them too.
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[1] / "src" / "relprop"
#: the longest module allowed: one idea per module, readable in one sitting
MODULE_LINES = 500


def _module_name(path: Path) -> str:
    parts = path.relative_to(SOURCE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(SOURCE.rglob("*.py"))}


def _imports(name: str) -> list[tuple[str, str | None]]:
    """``(module imported, name taken from it or None)`` for every import statement of module ``name``."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names if alias.name.startswith("relprop")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the module's package
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            if not base.startswith("relprop"):
                continue
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.append((submodule, None) if submodule in MODULES else (base, alias.name))
    return found


def _graph() -> dict[str, set[str]]:
    return {name: {target for target, _ in _imports(name) if target in MODULES and target != name}
            for name in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def _subpackage(module: str) -> str:
    """``relprop.engine`` for ``relprop.engine.calls``; a top-level module is a subpackage of its own."""
    return ".".join(module.split(".")[:2])


def test_the_checks_see_the_package():
    assert {"relprop._core.registry", "relprop.engine.session", "relprop.ops.linear", "relprop.cli"} <= set(MODULES)
    # a function-level import is seen: the CLI imports its pictures lazily
    assert any(target.startswith("relprop.viz") for target, _ in _imports("relprop.cli.explain"))


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_a_cycle_is_found():
    """The cycle check itself, on a graph with one cycle of three modules and a module outside it."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_private_name_is_imported_across_subpackages():
    crossing = [f"{name} imports {imported} from {target}" for name in MODULES
                for target, imported in _imports(name)
                if imported is not None and imported.startswith("_") and not imported.startswith("__")
                and _subpackage(target) != _subpackage(name)]
    assert crossing == []


def test_the_core_imports_no_other_relprop_module():
    outside = [f"{name} imports {target}" for name in MODULES if name.startswith("relprop._core")
               for target, _ in _imports(name) if not target.startswith("relprop._core")]
    assert outside == []


def test_rules_and_engine_do_not_import_each_other():
    crossing = [f"{name} imports {target}" for name in MODULES for target, _ in _imports(name)
                if {_subpackage(name), _subpackage(target)} == {"relprop.rules", "relprop.engine"}]
    assert crossing == []


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_is_long(name):
    lines = MODULES[name].read_text(encoding="utf-8").count("\n")
    assert lines <= MODULE_LINES, f"{name} has {lines} lines: split it by idea"


def test_type_ignores_are_few():
    """The op calls' lifecycle is typed; a ``type: ignore`` marks a place where the type checker cannot follow."""
    count = sum(len(re.findall(r"type: ignore", path.read_text(encoding="utf-8"))) for path in MODULES.values())
    assert count <= 15


def test_import_linter_contracts_hold():
    """The layers of ``pyproject.toml`` ([tool.importlinter]), checked by import-linter itself."""
    pytest.importorskip("importlinter.cli")
    root = Path(__file__).resolve().parents[1]
    # in a process of its own: import-linter configures logging with ``dictConfig``, which disables every logger
    # that exists (relprop's own among them) for the rest of the process
    run = subprocess.run([sys.executable, "-c", "import sys, importlinter.cli as c; sys.exit(c.lint_imports("
                          "config_filename='pyproject.toml'))"], cwd=root, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
