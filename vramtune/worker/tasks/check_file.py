"""`vramtune tasks check FILE`: a user's task file checked the way a worker would load and run it.

Loading errors come first (a class that lacks members is named with each missing member's
rule); then, given a configuration (a study file's smallest one, or JSON), each Task runs the
contract checks of `vramtune.worker.tasks.contract`, and each task that runs trials itself
(TrainerTask, LightningTask) its real path (`vramtune.worker.tasks.runner_check`). Exit codes:
0 all kept, 1 a rule broken or nothing loadable, 2 a bad --study or --config.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from vramtune.service.wire import StudyCreate
from vramtune.worker.tasks.contract import Finding, format_findings
from vramtune.worker.tasks.registry import discover
from vramtune.worker.trial.rungs import rungs_in_words, supported_rungs
from vramtune.worker.trial.runner import TrialRunner

NO_CONFIG_HINT = "loads; add --study STUDY or --config JSON to build, train, evaluate and trace it"


def check_file(path: str, *, study: str | None, config: str | None, device: str) -> tuple[str, int]:
    """The report `vramtune tasks check` prints, and its exit code."""
    try:
        task_name, chosen = _configuration(study, config)
    except ValueError as bad:
        return str(bad), 2
    found = discover([path], entry_points=False)
    lines = [f"{source}: {error}" for source, error in sorted(found.errors.items())]
    broken = bool(found.errors) or not found.runners
    for name, runner in sorted(found.runners.items()):
        if chosen is None:
            lines.append(f"{name}: {NO_CONFIG_HINT}")
        elif task_name in (None, name):
            findings = _findings(runner, chosen, device)
            lines.append(format_findings(name, findings))
            broken |= not all(f.passed for f in findings)
        lines.append(rungs_line(name, runner))
    if task_name is not None and task_name not in found.runners:
        lines.append(
            f"--study: the study asks for task {task_name!r}, which {path} does not define"
        )
        broken = True
    return "\n".join(lines), int(broken)


def _findings(runner: TrialRunner, config: dict[str, Any], device: str) -> list[Finding]:
    """A Task's contract, member by member; a runner's real path (TrainerTask, LightningTask:
    they run trials themselves), stage by stage."""
    task = getattr(runner, "task", None)
    if task is None:
        from vramtune.worker.tasks.runner_check import run_runner_checks

        return run_runner_checks(runner, config, device)
    from vramtune.worker.tasks.contract import run_checks

    return run_checks(task, config, device)


def rungs_line(name: str, runner: TrialRunner) -> str:
    """Which rungs plans may use for the task: the answer the worker's plan chooser and its
    registration (the dashboard's advice) use too (worker/trial/rungs.py). The offloads are
    named for CUDA cards whatever --device is: a fleet's cards may differ from this machine."""
    rungs = supported_rungs(runner, None)
    return f"{name}: supports the rungs {rungs_in_words(rungs)}"


def _configuration(
    study: str | None, config: str | None
) -> tuple[str | None, dict[str, Any] | None]:
    """(the study's task or None, the configuration to check or None)."""
    if config is not None:
        try:
            parsed = json.loads(config)
        except json.JSONDecodeError as error:
            raise ValueError(f"--config: not JSON ({error})") from None
        if not isinstance(parsed, dict):
            raise ValueError("--config: give a JSON object of parameter values")
        return None, parsed
    if study is None:
        return None, None
    try:
        spec = StudyCreate.model_validate(yaml.safe_load(Path(study).read_text()))
    except (OSError, yaml.YAMLError, ValidationError) as error:
        raise ValueError(f"--study: {study}: {error}") from None
    from vramtune.worker.tasks.contract import smallest_config

    return spec.task, smallest_config(spec)
