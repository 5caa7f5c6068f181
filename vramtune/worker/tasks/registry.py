"""Task discovery: the ``vramtune.tasks`` entry points plus the modules named by ``--tasks``.

Each entry point, or each task found in a ``--tasks`` module (a dotted module name or a path to a
``.py`` file), becomes a `TrialRunner`: an object that already is one is used as is (the synthetic
quadratic task), a `worker.trial.task.Task` is wrapped in `worker.run.training.TorchTaskRunner`, and
a class is instantiated first. A task that fails to import or build is reported by name with its
error in `Discovery.errors`; the others still load. torch is imported only when a torch task is
found, so a torch-less worker can still run runner-only tasks.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from pydantic import TypeAdapter, ValidationError

from vramtune.service.wire import Name
from vramtune.worker.tasks.extras import MissingExtra
from vramtune.worker.tasks.members import (
    NEAR_MISS_METHODS,
    TASK_MEMBERS,
    TASK_METHODS,
    describe_missing,
    missing_members,
)
from vramtune.worker.trial.runner import TrialRunner

ENTRY_POINT_GROUP = "vramtune.tasks"
_NAME = TypeAdapter(Name)


@dataclass
class Discovery:
    """What a worker can advertise: runners by task name, and what failed, by name."""

    runners: dict[str, TrialRunner] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)
    """Built-in tasks left out because their optional dependency is missing, and which extra."""
    sources: dict[str, str] = field(default_factory=dict)
    """Where each runner came from: 'module:attribute' or 'path/to/file.py:attribute'."""

    def add(self, candidate: object, source: str) -> None:
        """Turn `candidate` into a runner and keep it, or record why it cannot be one."""
        try:
            runner = as_runner(candidate)
        except Exception as error:  # a user's constructor may raise anything
            self.errors[source] = _describe(error)
            return
        name = runner.task_name
        if not _valid_name(name):
            self.errors[source] = f"invalid task name {name!r}: use letters, digits, '.', '_', '-'"
            return
        known = self.runners.get(name)
        if known is None:
            self.runners[name], self.sources[name] = runner, source
        elif _origin(known) is not _origin(runner):
            self.errors[name] = f"{source} also defines {name!r}; keeping {self.sources[name]}"


def discover(extra: Sequence[str] = (), *, entry_points: bool = True) -> Discovery:
    """The tasks of the installed entry points, then those of each module in `extra`."""
    found = Discovery()
    if entry_points:
        for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            try:
                candidate = entry_point.load()
            except MissingExtra as missing:  # not advertised: an extra not installed, no fault
                found.unavailable[entry_point.name] = str(missing)
                continue
            except Exception as error:  # a broken plugin must not stop the others
                found.errors[entry_point.name] = _describe(error)
                continue
            found.add(candidate, entry_point.value)
    for spec in extra:
        try:
            module = import_tasks_module(spec)
        except Exception as error:
            found.errors[spec] = _describe(error)
            continue
        candidates = module_candidates(module)
        near_misses = near_miss_classes(module)
        for attribute, problem in near_misses.items():
            found.errors[f"{spec}:{attribute}"] = problem
        if not candidates and not near_misses:
            found.errors[spec] = (
                f"no Task or TrialRunner found in {spec}: a task is a class with "
                f"{', '.join(TASK_MEMBERS)} (vramtune tasks check {spec} explains each)"
            )
        for attribute, candidate in candidates.items():
            found.add(candidate, f"{spec}:{attribute}")
    return found


def as_runner(candidate: object) -> TrialRunner:
    """A runner for a runner, a Task, or a class of either (instantiated without arguments)."""
    obj = candidate() if inspect.isclass(candidate) else candidate
    if isinstance(obj, TrialRunner):
        return obj
    from vramtune.worker.trial.task import Task  # imports torch: only once a torch task turns up

    if isinstance(obj, Task):
        from vramtune.worker.run.training import TorchTaskRunner

        return TorchTaskRunner(obj)
    missing = missing_members(obj)
    if missing:
        raise TypeError(describe_missing(type(obj).__qualname__, missing))
    raise TypeError(f"{type(obj).__qualname__} is neither a Task nor a TrialRunner")


def import_tasks_module(spec: str) -> ModuleType:
    """Import a dotted module name, or a .py file by path (its folder joins sys.path)."""
    path = Path(spec)
    if path.suffix != ".py":
        return importlib.import_module(spec)
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {spec}")
    name = f"vramtune_tasks_{path.stem}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ImportError(f"cannot import {spec}")
    module = importlib.util.module_from_spec(module_spec)
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        # As `python file.py` would: the user's file may import its neighbours.
        sys.path.insert(0, folder)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def module_candidates(module: ModuleType) -> dict[str, object]:
    """Module-level task instances, and task classes defined in the module itself."""
    candidates: dict[str, object] = {}
    for attribute, value in vars(module).items():
        if attribute.startswith("_"):
            continue
        if inspect.isclass(value):
            if value.__module__ == module.__name__ and _has_task_methods(value):
                candidates[attribute] = value
        elif not inspect.ismodule(value) and _has_task_methods(type(value)):
            candidates[attribute] = value
    return candidates


def near_miss_classes(module: ModuleType) -> dict[str, str]:
    """Classes of the module meant as tasks (most of the methods) that lack some members, each
    with what it lacks and the rule of each missing member."""
    found: dict[str, str] = {}
    for attribute, value in vars(module).items():
        if not inspect.isclass(value) or value.__module__ != module.__name__:
            continue
        if _has_task_methods(value) or attribute.startswith("_"):
            continue
        present = sum(callable(getattr(value, method, None)) for method in TASK_METHODS)
        if present >= NEAR_MISS_METHODS:
            found[attribute] = describe_missing(attribute, missing_members(value))
    return found


def _has_task_methods(cls: type) -> bool:
    """Whether a class has every method of the Task protocol, or of the TrialRunner protocol."""
    return any(
        all(callable(getattr(cls, method, None)) for method in methods)
        for methods in (frozenset(TASK_METHODS), _protocol_methods(TrialRunner))
    )


def _protocol_methods(protocol: type) -> frozenset[str]:
    """The public methods a protocol declares."""
    return frozenset(
        name
        for name, value in vars(protocol).items()
        if callable(value) and not name.startswith("_")
    )


def _valid_name(name: object) -> bool:
    """Whether `name` is a name the wire contract accepts."""
    try:
        _NAME.validate_python(name)
    except ValidationError:
        return False
    return True


def _origin(runner: TrialRunner) -> type:
    """The class behind a runner (a wrapped task's class), to tell a real conflict from a repeat."""
    return type(getattr(runner, "task", runner))


def _describe(error: BaseException) -> str:
    """An error as 'Type: message'."""
    return f"{type(error).__name__}: {error}"


def format_listing(discovery: Discovery) -> str:
    """What `vramtune tasks` prints: one line per task, then what failed to load."""
    rows = [("TASK", "METRIC", "BATCH", "SHAPE PARAMS", "SOURCE")]
    for name in sorted(discovery.runners):
        rows.append((name, *_summary(discovery.runners[name]), discovery.sources[name]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = [
        "  ".join([*(cell.ljust(w) for cell, w in zip(row, widths, strict=False)), row[-1]])
        for row in rows
    ]
    if not discovery.runners:
        lines.append("(no tasks)")
    if discovery.unavailable:
        lines.append("")
        lines.append("not installed (optional):")
        lines.extend(f"  {name}: {why}" for name, why in sorted(discovery.unavailable.items()))
    if discovery.errors:
        lines.append("")
        lines.append("failed to load:")
        lines.extend(f"  {name}: {error}" for name, error in sorted(discovery.errors.items()))
    return "\n".join(lines)


def _summary(runner: TrialRunner) -> tuple[str, str, str]:
    """Metric, batch-size parameter and shape parameters of a runner's task ('-' if unknown)."""
    task = getattr(runner, "task", runner)
    metric = getattr(task, "metric", None)
    shown = f"{metric.name} ({metric.direction})" if metric is not None else "-"
    shapes = ",".join(sorted(getattr(task, "shape_params", ()))) or "-"
    return shown, str(getattr(task, "batch_size_param", "-")), shapes


@dataclass(frozen=True)
class Discovered:
    """The runners the worker's command line discovered, discovered again in the child (a task
    loaded from a .py file cannot be pickled by reference)."""

    tasks: tuple[str, ...] = ()
    entry_points: bool = True

    def runners(self) -> Mapping[str, TrialRunner]:
        """The same discovery as the agent's."""
        return discover(self.tasks, entry_points=self.entry_points).runners
