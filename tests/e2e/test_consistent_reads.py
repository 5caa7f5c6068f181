"""Issue 49: no read sees a trial half-told, while a real worker tells trials of every kind.

One study mixes the four ways a trial ends (Random sampler over categorical choices): a width
no card holds (handed back, told COMPLETE infeasible with placeholder values), an ``x`` the
threshold pruner prunes at the first report, ``objectives: 2`` in a one-objective study (the
worker reports the wrong number of values: FAIL) and the rest COMPLETE. A reader thread lists
the trials in a tight loop, through the Python client and the dashboard's trial table, while
the worker tells them; every read must parse and show each trial as one moment of it.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import pytest

from tests.e2e.conftest import PATIENCE_S, SMALL, Studies, WorkerFactory
from vramtune.service.client import Client
from vramtune.service.dashboard.models import TrialRowOut, TrialTable
from vramtune.service.testing import ServerProcess
from vramtune.service.wire import TrialOut

# The database is part of what this tests: it runs on SQLite and PostgreSQL (tests/conftest.py).
pytestmark = pytest.mark.both_databases

# How long the reader reads at least; then until every kind of ending and MIN_TOLD trials in
# all were told (a loaded machine tells fewer in READ_S), within PATIENCE_S.
READ_S = 12.0
MIN_TOLD = 12
INFEASIBLE_WIDTH = 8192  # 512 MiB of weights alone: no card of the fleet holds it
MIXED = {
    "width": {"type": "categorical", "choices": [64, 96, 128, INFEASIBLE_WIDTH]},
    "x": {"type": "categorical", "choices": [0.0, 0.5, 10.0]},  # 10: ~81, over the threshold
    "objectives": {"type": "categorical", "choices": [1, 2]},
}
THRESHOLD = {"name": "threshold", "args": {"upper": 50.0}}
# Outcomes only a trial that ended has (a RUNNING one may carry "oom": it is retried).
ENDED = {"as_asked", "resized", "routed", "infeasible", "failed", "pruned"}
OUTCOMES_OF = {"PRUNED": {"pruned"}, "FAIL": {"failed", "oom"}}
ENDINGS = {"infeasible", "pruned", "failed", "as_asked"}  # each told at least once while read


def half_told(trial: TrialOut) -> str | None:
    """What of the trial does not belong to one moment of it; None when nothing."""
    placeholders = trial.user_attrs.get("vramtune.placeholder_values") is True
    if trial.state == "COMPLETE":
        if trial.outcome not in ENDED - {"failed", "pruned"}:
            return f"COMPLETE with outcome {trial.outcome}"
        if (trial.outcome == "infeasible") != placeholders:
            return f"COMPLETE {trial.outcome} with placeholder mark {placeholders}"
        if placeholders:
            return None if trial.values is None else f"infeasible with values {trial.values}"
        if trial.values is None or not all(map(math.isfinite, trial.values)):
            return f"COMPLETE with values {trial.values}"
        return None
    if trial.values is not None:
        return f"{trial.state} with values {trial.values}"
    if trial.state in OUTCOMES_OF and trial.outcome not in OUTCOMES_OF[trial.state]:
        return f"{trial.state} with outcome {trial.outcome}"
    if trial.state == "RUNNING" and trial.outcome in ENDED:
        return f"RUNNING with outcome {trial.outcome}"
    return None


def half_shown(row: TrialRowOut) -> str | None:
    """half_told of a row of the dashboard's trial table."""
    if row.state == "COMPLETE":
        if row.values is None or (row.outcome == "infeasible") == row.feasible:
            return f"COMPLETE {row.outcome} with values {row.values}, feasible {row.feasible}"
        return None
    if row.values is not None:
        return f"{row.state} with values {row.values}"
    if row.state == "RUNNING" and row.outcome in ENDED:
        return f"RUNNING with outcome {row.outcome}"
    return None


@dataclass
class Reads:
    """What the reader saw: how many reads, the problems, the last read's endings."""

    count: int = 0
    problems: list[str] = field(default_factory=list)
    endings: Counter[str] = field(default_factory=Counter)

    def enough(self) -> bool:
        """Whether every kind of ending, and MIN_TOLD trials in all, were told."""
        return set(self.endings) >= ENDINGS and self.endings.total() >= MIN_TOLD


def read_until(url: str, name: str, stop: threading.Event, reads: Reads) -> None:
    """List the study's trials through the client, then the dashboard's table, until stopped."""
    table = f"{url}/api/v1/dashboard/studies/{name}/trials"
    with Client(url) as client, httpx.Client(timeout=30) as http:
        while not stop.is_set():
            try:
                trials = client.trials(name, limit=1000).trials
                rows = TrialTable.model_validate_json(
                    http.get(table, params={"limit": 500}).content
                ).rows
            except Exception as error:  # a page that does not parse is the failure itself
                reads.problems.append(f"read {reads.count}: {error}")
                return
            reads.count += 1
            for trial in trials:
                if problem := half_told(trial):
                    reads.problems.append(f"read {reads.count}, trial {trial.number}: {problem}")
            for row in rows:
                if problem := half_shown(row):
                    reads.problems.append(f"read {reads.count}, row {row.number}: {problem}")
            reads.endings = Counter(t.outcome or t.state for t in trials if t.state != "RUNNING")
            if reads.problems:
                return


def test_no_read_sees_a_trial_half_told(
    fleet_server: ServerProcess, studies: Studies, start_worker: WorkerFactory
) -> None:
    name = studies.create(MIXED, n_trials=10_000, pruner=THRESHOLD)
    reads, stop = Reads(), threading.Event()
    reader = threading.Thread(target=read_until, args=(fleet_server.url, name, stop, reads))
    worker = start_worker(fleet_server.url, SMALL)
    began = time.monotonic()
    reader.start()
    try:
        while reader.is_alive() and time.monotonic() - began < PATIENCE_S:
            if time.monotonic() - began >= READ_S and reads.enough():
                break
            time.sleep(0.2)
    finally:
        stop.set()
        reader.join()
        worker.stop()
    assert not reads.problems, f"{len(reads.problems)} in {reads.count} reads: {reads.problems[:5]}"
    assert set(reads.endings) >= ENDINGS, reads.endings
    print(f"{reads.count} reads, {dict(reads.endings)} told")
