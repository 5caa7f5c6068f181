"""Issue 3 end to end: crashes, lost leases, shutdowns and restarts with real workers."""

from __future__ import annotations

import signal

import pytest

from tests.e2e.conftest import Studies, WorkerFactory, finished, running_on
from vramtune.service.testing import ServerProcess
from vramtune.service.wire import (
    CardInfo,
    CompleteRequest,
    Measured,
    NextRequest,
    Plan,
    WorkerRegister,
)
from vramtune.worker.loop.api import LeaseLost, ServerClient

# The database is part of what this tests: it runs on SQLite and PostgreSQL (tests/conftest.py).
pytestmark = pytest.mark.both_databases

X = {"x": {"type": "float", "low": -2.0, "high": 2.0}}
# About two seconds a trial: long enough to kill or stop a worker in the middle of one.
SLOW = {"step_seconds": 0.02}
SLOW_BUDGET = {"max_steps": 100, "eval_every": 20}


def test_a_killed_workers_trial_is_reoffered_and_completed_by_another(
    fleet_server: ServerProcess, studies: Studies, start_worker: WorkerFactory
) -> None:
    name = studies.create(X, n_trials=2, task_config=SLOW, budget=SLOW_BUDGET)
    doomed = start_worker(fleet_server.url)
    studies.wait_until(name, running_on(doomed))
    doomed.signal(signal.SIGKILL)
    assert doomed.wait() == -signal.SIGKILL
    rescuer = start_worker(fleet_server.url)
    trials = studies.wait_until(name, finished(2))
    assert rescuer.finish() == 0
    assert [t.state for t in trials] == ["COMPLETE", "COMPLETE"]
    assert sorted(t.number for t in trials) == [0, 1]
    assert {t.worker for t in trials} == {rescuer.name}
    reoffered = [t for t in trials if t.attempt > 0]
    assert reoffered, "the killed worker's trial came back as a new attempt"


def test_a_late_complete_under_a_lost_lease_is_refused_and_told_once(
    fleet_server: ServerProcess, studies: Studies, start_worker: WorkerFactory
) -> None:
    name = studies.create(X, n_trials=1)
    client = ServerClient(fleet_server.url)
    card = CardInfo(model="simulated-cpu-64MiB", total_bytes=2**26, free_bytes=2**26)
    register = WorkerRegister(name="silent", device="cpu", card=card, tasks=["quadratic"])
    silent = client.register(register)
    stale = client.next(silent.worker_id, NextRequest(free_bytes=2**26))
    assert stale is not None and stale.study == name
    # The silent worker never heartbeats: its lease expires, a real worker gets the trial.
    rescuer = start_worker(fleet_server.url)
    [done] = studies.wait_until(name, finished(1))
    assert rescuer.finish() == 0
    assert done.state == "COMPLETE" and done.attempt > stale.attempt
    late = CompleteRequest(
        lease=stale.lease,
        values=[123.0],
        plan=Plan(),
        measured=Measured(peak_allocated_bytes=1),
        duration_s=1.0,
    )
    with pytest.raises(LeaseLost):
        client.complete(stale.trial_id, late)
    [after] = studies.trials(name)
    assert after.values == done.values != [123.0]
    assert studies.summary(name).counts.get("COMPLETE") == 1
    client.close()


def test_sigterm_hands_the_trial_back_and_exits_cleanly(
    fleet_server: ServerProcess, studies: Studies, start_worker: WorkerFactory
) -> None:
    name = studies.create(X, n_trials=1, task_config=SLOW, budget=SLOW_BUDGET)
    leaving = start_worker(fleet_server.url)
    studies.wait_until(name, running_on(leaving))
    leaving.signal(signal.SIGTERM)
    assert leaving.wait() == 0
    [handed_back] = studies.trials(name)
    assert handed_back.state != "FAIL"
    assert '"kind": "interrupted"' in leaving.logs()
    finisher = start_worker(fleet_server.url)
    [done] = studies.wait_until(name, finished(1))
    assert finisher.finish() == 0
    assert done.state == "COMPLETE" and done.worker == finisher.name
    assert done.attempt == handed_back.attempt, "an interrupted run is not a failed attempt"


def test_workers_carry_on_across_a_server_restart(
    fleet_server: ServerProcess, studies: Studies, start_worker: WorkerFactory
) -> None:
    budget = {"max_steps": 100, "eval_every": 20}
    name = studies.create(X, n_trials=4, task_config={"step_seconds": 0.01}, budget=budget)
    worker = start_worker(fleet_server.url, "64MiB", "--exit-when-idle", "3")
    studies.wait_until(name, lambda trials: any(t.state == "COMPLETE" for t in trials))
    fleet_server.restart()
    assert worker.process.poll() is None, "the worker survived the restart"
    trials = studies.wait_until(name, finished(4))
    assert worker.wait() == 0
    assert [t.state for t in trials] == ["COMPLETE"] * 4
    assert sorted(t.number for t in trials) == list(range(4))
