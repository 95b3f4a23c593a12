"""The house's layers (issue 13 item 6): the planner is the ground floor, the `recycle` dispatcher
(recycle_cli/) the roof. Read with ast, so imports inside functions (the lazy ones) count too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DISPATCHER = "recycle_cli"
ABOVE_THE_PLANNER = ("api", "runtime_adapter", "whatif", "bench", DISPATCHER)
PACKAGES = ("planner", "api", "runtime_adapter", "whatif", "bench")  # none may import the dispatcher


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `path`; relative imports resolved."""
    return imports_in(path.read_text(), path.relative_to(ROOT).with_suffix("").parts[:-1], str(path))


def imports_in(source: str, package: tuple[str, ...], filename: str = "<probe>") -> list[tuple[int, str]]:
    """Every import statement (also inside functions), `from .x import y` resolved against `package`,
    and importlib.import_module / __import__ calls with a literal name."""
    tree = ast.parse(source, filename=filename)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            if not node.module:  # `from . import x`: x may be a module
                found.extend((node.lineno, f"{module}.{alias.name}") for alias in node.names)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.lineno, node.args[0].value))
    return found


def offending(paths: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{line}: imports {module}"
        for path in paths
        for line, module in imported_modules(path)
        if module.split(".")[0] in forbidden
    ]


def python_files(package: str) -> list[Path]:
    return sorted(p for p in (ROOT / package).rglob("*.py") if "__pycache__" not in p.parts)


def test_the_planner_imports_nothing_above_it() -> None:
    files = python_files("planner")
    assert len(files) > 10, files  # the walk found the planner
    assert offending(files, ABOVE_THE_PLANNER) == []


@pytest.mark.parametrize("package", PACKAGES)
def test_no_package_imports_the_dispatcher(package: str) -> None:
    files = python_files(package)
    assert files, package
    assert offending(files, (DISPATCHER,)) == []


def test_the_dispatcher_registers_every_layer_above_the_planner() -> None:
    """The other direction holds: recycle_cli imports the subcommand parsers of each package."""
    modules = {m for p in python_files(DISPATCHER) for _, m in imported_modules(p)}
    for package in ("planner", "api", "runtime_adapter", "whatif", "bench"):
        assert any(m.split(".")[0] == package for m in modules), package


def test_the_checker_sees_lazy_relative_and_dynamic_imports() -> None:
    source = (
        "def f():\n    from bench.planner import run_bench\n"
        "import importlib\nimportlib.import_module('whatif.cli')\n"
        "from .cli import run\nfrom . import figures\nimport recycle_cli.__main__\n"
    )
    modules = {m for _, m in imports_in(source, ("planner", "simulator"))}
    assert {"bench.planner", "whatif.cli", "planner.simulator.cli", "planner.simulator.figures"} <= modules
    assert "recycle_cli.__main__" in modules
