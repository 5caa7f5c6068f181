"""Every kind of task resized by the rungs it can take and only those (issue 43): a PlainTask
without checkpointable blocks, and the same MLP as a LightningTask and as a TrainerTask (no
checkpoint_modules, no gradient checkpointing), each on a real server and two real CPU workers
on small simulated cards loading the task file with --tasks, under the default memory policy
(which lists checkpointing). SQLite only: the task kind, not the database, is the subject.

Four widths at one batch, one trial each (a grid): one fits the small card as asked, one fits it
only in micro-batches, one has more parameters and gradients than the small card holds and is
routed to the large one, one fits no card. Before issue 43 the plan chooser picked
checkpointing for the PlainTask and the trial failed ("marks no modules for checkpointing").
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.e2e.conftest import Studies, WorkerFactory, finished, running_on
from vramtune.common.plans import rungs_of
from vramtune.service.testing import ServerProcess
from vramtune.service.wire import TrialOut

HERE = Path(__file__).parent
KINDS = {  # task name: (its task file, its batch parameter)
    "plain-widths": (HERE / "plain_widths.py", "batch_size"),
    "lightning-widths": (HERE / "kind_widths.py", "batch_size"),
    "trainer-widths": (HERE / "kind_widths.py", "per_device_train_batch_size"),
}
SMALL_CARD, LARGE_CARD = "8MiB", "32MiB"
BATCH = 256
# Parameters and gradients (SGD keeps no state) are about 600 B per unit of width, the
# activations of the batch as asked about 8 B per unit of width and example:
AS_ASKED = 16  # a few hundred KiB in all: fits the small card as asked
MICRO_BATCHES = 4096  # 2.4 MiB of weights, 8 MiB of activations: micro-batches on the small card
ROUTED = 16384  # 9.4 MiB of weights: more than the small card's budget; the large one holds it
INFEASIBLE = 65536  # 37.5 MiB of weights: more than any card


@pytest.mark.parametrize("task", list(KINDS))
def test_a_task_without_blocks_is_resized_routed_or_infeasible_never_failed(
    task: str, fleet_server: ServerProcess, studies: Studies, start_worker: WorkerFactory
) -> None:
    task_file, batch_param = str(KINDS[task][0]), KINDS[task][1]
    # The large card is kept busy until the small one has leased every trial: a trial the
    # large card leased first would run there as asked, not resized or routed. A quadratic
    # trial that would run for many minutes holds it; deleting its study stops it.
    large = start_worker(fleet_server.url, LARGE_CARD, "--tasks", task_file)
    blocker = studies.create(
        {"x": {"type": "float", "low": -2.0, "high": 2.0}},
        task_config={"step_seconds": 0.01},
        budget={"max_steps": 100_000, "eval_every": 1000},
    )
    studies.wait_until(blocker, running_on(large), timeout=300)  # it warms up first
    widths = [AS_ASKED, MICRO_BATCHES, ROUTED, INFEASIBLE]
    name = studies.create(
        {"width": {"type": "categorical", "choices": widths}},
        task=task,
        task_config={batch_param: BATCH},
        n_trials=len(widths),
        sampler={"name": "grid"},
        budget={"max_steps": 2, "eval_every": 2},
        directions=["minimize"],
        metric_names=["loss"],
    )
    small = start_worker(fleet_server.url, SMALL_CARD, "--tasks", task_file)
    # Three end on the small card (the infeasible one: the large card is live, and too small);
    # the routed one waits for the large card.
    studies.wait_until(name, _ended(3), timeout=300)
    studies.client.delete(blocker)
    trials = studies.wait_until(name, finished(len(widths)), timeout=300)
    by_width = {trial.params["width"]: trial for trial in trials}
    assert sorted(by_width) == widths, trials
    assert [t for t in trials if t.state == "FAIL"] == [], trials
    assert by_width[AS_ASKED].outcome == "as_asked", by_width[AS_ASKED]
    resized = by_width[MICRO_BATCHES]
    assert resized.outcome == "resized" and resized.worker == small.name, resized
    assert resized.plan is not None and rungs_of(resized.plan) == ["micro_batch"], resized
    routed = by_width[ROUTED]
    assert routed.outcome == "routed" and routed.state == "COMPLETE", routed
    assert routed.worker == large.name, routed
    assert by_width[INFEASIBLE].outcome == "infeasible", by_width[INFEASIBLE]
    for trial in trials:  # no plan asked for a rung the task cannot take
        assert trial.plan is None or not trial.plan.checkpointing, trial


def _ended(count: int) -> Callable[[list[TrialOut]], bool]:
    """At least `count` trials ended with their outcome recorded."""
    return lambda trials: finished(count)([t for t in trials if t.outcome is not None])
