"""Helpers for the worker's tests: the Task contract check (shipped in the package as
`worker.tasks.contract`, run by `vramtune tasks check`), a recording reporter, a simulated card
and one trial run through the worker's own loop.

Use the contract from a test::

    from task_contract import check_task

    def test_my_task_keeps_the_contract() -> None:
        check_task(MyTask(), {"width": 16, "batch_size": 8}, bad_configs=[{"width": 0}])
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vramtune.service.wire import CardInfo, Plan, TrainBudget
from vramtune.worker.run.training import TorchTaskRunner
from vramtune.worker.tasks.contract import check_task, cpu_threads
from vramtune.worker.trial.runner import CardSpec, RunResult
from vramtune.worker.trial.task import Task

__all__ = ["GIB", "RecordingReporter", "check_task", "cpu_threads", "run_trial", "simulated_card"]

GIB = 1024**3


class RecordingReporter:
    """A Reporter that keeps what was reported and prunes or stops when told to."""

    def __init__(self, prune_at: int | None = None, stop_after: int | None = None) -> None:
        self.reports: list[tuple[int, float]] = []
        self.prune_at = prune_at
        self.stop_after = stop_after
        self.polls = 0

    def report(self, step: int, value: float) -> bool:
        """Keep the value; prune from step `prune_at` on."""
        self.reports.append((step, value))
        return self.prune_at is not None and step >= self.prune_at

    def stop_reason(self) -> str | None:
        """'paused' once polled more than `stop_after` times."""
        self.polls += 1
        return "paused" if self.stop_after is not None and self.polls > self.stop_after else None


def simulated_card(limit_bytes: int = GIB) -> CardSpec:
    """A CPU card of `limit_bytes`, as ``--device cpu --memory-limit`` gives."""
    info = CardInfo(
        model="simulated", total_bytes=limit_bytes, free_bytes=limit_bytes, simulated=True
    )
    return CardSpec(info=info, device="cpu")


def run_trial(
    task: Task,
    config: Mapping[str, Any],
    *,
    steps: int,
    eval_every: int | None = None,
    plan: Plan | None = None,
    limit_bytes: int = GIB,
    reporter: RecordingReporter | None = None,
) -> RunResult:
    """Train `config` for `steps` steps on a simulated CPU card with the worker's own loop."""
    budget = TrainBudget(max_steps=steps, eval_every=eval_every or steps)
    card, reporter = simulated_card(limit_bytes), reporter or RecordingReporter()
    with cpu_threads(1):
        return TorchTaskRunner(task).run(config, plan or Plan(), budget, card, reporter)
