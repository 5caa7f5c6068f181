"""The architecture's boundaries, read from the import statements of every module.

- Everything lives under the one import name ``vramtune``; below it, the contract
  (vramtune.service.wire) imports only pydantic and the standard library; common/ imports only
  the contract; the worker takes only the contract and common/ from the service side, and
  the service never imports the worker.
- Inside each package, rooms (sub-packages, or top-level modules) sit in tiers: a room imports
  only rooms of lower tiers (or itself). A new room must be given its tier here.
- No module imports, directly or through others, a module that imports it back. Every import
  counts: late imports inside functions and `TYPE_CHECKING` imports included, because a circle
  broken by a late import is still a circle in the design.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Lowest tier first. The worker: the card, what a trial is, predicting it, running it, choosing
# its plan, the tasks and integrations that plug in, the predictor on its own (fit/: "will it
# fit?", over all of those), the agent loop, and what starts it (the
# command line; engines/, which starts `vramtune worker` processes on Ray and others).
WORKER_TIERS: list[set[str]] = [
    {"device"},
    {"trial"},
    {"predictor"},
    {"run"},
    {"plan"},
    {"integrations"},
    {"tasks"},
    {"fit"},
    {"loop"},
    {"cli", "engines"},
]
# The service: the contract, leaf modules, storage, the server's state, Optuna's glue and the
# metrics, the fleet's use cases, auth, studies, the HTTP edge, the dashboard, the app, the CLI.
SERVICE_TIERS: list[set[str]] = [
    {"wire"},
    {"settings", "errors", "calibration", "step_time", "client", "limits", "principal"},
    {"db"},
    {"state"},
    {"metrics", "optuna"},
    {"fleet"},
    {"auth"},
    {"studies"},
    {"api"},
    {"dashboard"},
    {"app", "testing"},
    {"cli"},
]
COMMON_TIERS: list[set[str]] = [
    {"logs", "durations", "plans", "memory", "step_time", "task_rules", "stopping", "units"},
]
TIERS = {"worker": WORKER_TIERS, "service": SERVICE_TIERS, "common": COMMON_TIERS}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path, packages: Sequence[str]) -> dict[str, set[str]]:
    """Module -> every module of `packages` it imports (a `from p import m` of a submodule is an
    import of p.m); third-party and standard-library imports are left out."""
    files = {module_name(p, root): p for pkg in packages for p in (root / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        found: set[str] = set()
        for name in imported_names(path):
            while name and name not in files:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
        graph[module] = found
    return graph


def imported_names(path: Path) -> set[str]:
    """Every dotted name a file imports (absolute imports: the codebase uses no relative ones)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            # p.m when m is a module of p; p itself otherwise (import_graph strips to a module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def room(module: str) -> tuple[str, str]:
    """(package, room): `vramtune.worker.loop.agent` is in worker's `loop`; `worker` itself in
    ''. The checks' own test trees use the packages without the `vramtune.` prefix."""
    package, _, rest = module.removeprefix("vramtune.").partition(".")
    return package, rest.partition(".")[0]


def upward_imports(graph: Mapping[str, set[str]], tiers: Mapping[str, list[set[str]]]) -> list[str]:
    """Each import of a room from a room of the same package in the same or a higher tier, and
    each room that has no tier."""
    problems: list[str] = []
    for module, imports in sorted(graph.items()):
        package, here = room(module)
        rank = _rank(tiers[package], here) if package in tiers else None
        if here and rank is None:
            problems.append(f"{module}: room {package}.{here} has no tier in test_boundary.py")
            continue
        for target in sorted(imports):
            there_package, there = room(target)
            if there_package != package or there == here or not here:
                continue
            there_rank = _rank(tiers[package], there)
            if there_rank is None or rank is None or there_rank >= rank:
                problems.append(f"{module} imports {target}: {there} is not below {here}")
    return problems


def _rank(tiers: list[set[str]], name: str) -> int | None:
    return next((i for i, tier in enumerate(tiers) if name in tier), None)


def project_graph() -> dict[str, set[str]]:
    return import_graph(ROOT, ["vramtune/common", "vramtune/service", "vramtune/worker"])


# ------------------------------------------------------------------ the project's boundaries


def test_no_module_imports_itself_through_others() -> None:
    assert cycles(project_graph()) == []


def test_every_room_imports_only_rooms_below_it() -> None:
    assert upward_imports(project_graph(), TIERS) == []


def test_the_contract_imports_only_pydantic_and_the_standard_library() -> None:
    wire = ROOT / "vramtune" / "service" / "wire.py"
    tops = {name.split(".")[0] for name in imported_names(wire)}
    allowed = set(sys.stdlib_module_names) | {"pydantic", "__future__"}
    assert tops - allowed == set()


def test_the_worker_takes_only_the_contract_from_the_service() -> None:
    leaks = {
        module: sorted(
            n for n in imports if room(n)[0] == "service" and n != "vramtune.service.wire"
        )
        for module, imports in project_graph().items()
        if room(module)[0] == "worker"
    }
    assert {module: names for module, names in leaks.items() if names} == {}


@pytest.mark.parametrize("package", ["service", "common"])
def test_the_service_and_common_never_import_the_worker(package: str) -> None:
    leaks = {
        module: sorted(n for n in imports if room(n)[0] == "worker")
        for module, imports in project_graph().items()
        if room(module)[0] == package
    }
    assert {module: names for module, names in leaks.items() if names} == {}


def test_common_takes_only_the_contract_from_either_side() -> None:
    leaks = {
        module: sorted(
            n for n in imports if room(n)[0] != "common" and n != "vramtune.service.wire"
        )
        for module, imports in project_graph().items()
        if room(module)[0] == "common"
    }
    assert {module: names for module, names in leaks.items() if names} == {}


# ------------------------------------------------------- the checks catch what they look for


def _tree(root: Path, files: Mapping[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_circle_through_a_late_import_is_found(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "worker/__init__.py": "",
            "worker/loop/__init__.py": "",
            "worker/loop/agent.py": "from worker.loop.packing import Packer\n",
            "worker/loop/packing.py": "def f():\n    from worker.loop.agent import Agent\n",
            "worker/run/__init__.py": "",
            "worker/trial/runner.py": "import json\n",
        },
    )
    assert cycles(import_graph(root, ["worker"])) == [["worker.loop.agent", "worker.loop.packing"]]


def test_a_circle_through_type_checking_is_found(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "service/__init__.py": "",
            "service/state.py": "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from service.fleet import heartbeats\n",
            "service/fleet/__init__.py": "",
            "service/fleet/heartbeats.py": "from service.state import AppState\n",
        },
    )
    assert cycles(import_graph(root, ["service"])) == [
        ["service.fleet.heartbeats", "service.state"]
    ]


def test_an_upward_import_and_a_room_without_a_tier_are_found(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "worker/__init__.py": "",
            "worker/run/__init__.py": "",
            "worker/run/training.py": "from worker.loop import agent\n",
            "worker/loop/__init__.py": "",
            "worker/loop/agent.py": "from worker.run import training\n",
            "worker/attic/__init__.py": "",
            "worker/attic/old.py": "",
        },
    )
    problems = upward_imports(import_graph(root, ["worker"]), {"worker": WORKER_TIERS})
    assert problems == [
        "worker.attic: room worker.attic has no tier in test_boundary.py",
        "worker.attic.old: room worker.attic has no tier in test_boundary.py",
        "worker.run.training imports worker.loop.agent: loop is not below run",
    ]
