"""The worker/server boundary: the contract (service.wire) and common/ are all both sides share."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(package: str) -> dict[str, set[str]]:
    """Every module a package's files import, by file (relative imports are not used here)."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
        found[str(path.relative_to(ROOT))] = names
    return found


def test_the_worker_takes_only_the_contract_from_the_service() -> None:
    leaks = {
        path: sorted(n for n in names if n.startswith("service") and n != "service.wire")
        for path, names in imported_modules("worker").items()
    }
    assert {path: names for path, names in leaks.items() if names} == {}


@pytest.mark.parametrize("package", ["service", "common"])
def test_the_service_and_common_never_import_the_worker(package: str) -> None:
    leaks = {
        path: sorted(n for n in names if n == "worker" or n.startswith("worker."))
        for path, names in imported_modules(package).items()
    }
    assert {path: names for path, names in leaks.items() if names} == {}


def test_common_imports_neither_side() -> None:
    sides = ("service", "worker")
    leaks = {
        path: sorted(n for n in names if n.split(".")[0] in sides)
        for path, names in imported_modules("common").items()
    }
    assert {path: names for path, names in leaks.items() if names} == {}
