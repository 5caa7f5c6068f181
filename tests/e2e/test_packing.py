"""Issue 15 section 3 end to end: one worker packs several small trials on its card.

A real server (SQLite and PostgreSQL) and a real `vramtune worker --max-trials-per-card 2`
process, whose packed trials each run in a process of their own. Quadratic footprints
(vramtune/worker/tasks/quadratic.py): 16 MiB fixed + 64 KiB per unit of width + 4 KiB per sample and
unit of width: batch 16, width 8 is about 16.5 MiB; reserved with the 10 % margin, 18.3 MiB.
Several of them fit the 96 MiB card, two slots let two run at once. 96 MiB, a card model
no other e2e test uses: the server's session is shared, and the step-time model it fits per
card model and task would learn these deliberately slow steps (test_memory's plan choice then
prefers checkpointing to micro-batches on the 64 MiB card).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import sqlalchemy as sa

from tests.e2e.conftest import PATIENCE_S, Studies, WorkerFactory, WorkerProcess, finished
from vramtune.service.testing import ServerProcess
from vramtune.service.wire import TrialOut

CARD = "96MiB"
SMALL_TRIAL = {
    "batch_size": {"type": "categorical", "choices": [16]},
    "width": {"type": "categorical", "choices": [8]},
}
# About a second and a half a trial: long enough for two to overlap on one card.
SLOW = {"step_seconds": 0.03}
BUDGET = {"max_steps": 50, "eval_every": 10}
PACKING = {"allow_packing": True}


def test_a_worker_runs_small_trials_at_once_each_completed_once(
    fleet_server: ServerProcess, studies: Studies, start_worker: WorkerFactory
) -> None:
    x = {"x": {"type": "float", "low": -2.0, "high": 2.0}}
    name = studies.create(
        {**SMALL_TRIAL, **x},
        n_trials=4,
        task_config=SLOW,
        budget=BUDGET,
        memory_policy=PACKING,
    )
    worker = start_worker(fleet_server.url, CARD, "--max-trials-per-card", "2")
    # Overlapping leases, as the server sees them: two of this worker's trials RUNNING at once.
    studies.wait_until(name, running_at_once(worker, 2))
    trials = studies.wait_until(name, finished(4))
    assert worker.finish() == 0
    assert [t.state for t in trials] == ["COMPLETE"] * 4
    assert sorted(t.number for t in trials) == [0, 1, 2, 3]
    assert {t.worker for t in trials} == {worker.name}
    assert all(t.attempt == 0 for t in trials)  # none lost, none run twice
    events = worker_events(worker)
    completed = [e["trial_id"] for e in events if e["event"] == "completed"]
    assert sorted(completed) == sorted(t.id for t in trials)  # each completed exactly once
    # ... and in the worker's own order of events, a trial started while another ran.
    assert max_overlap(events) == 2
    started = [e for e in events if e["event"] == "started"]
    assert all(e["packed"] for e in started)
    assert all(e["reserved_bytes"] < 64 * 2**20 // 2 for e in started)


def test_a_packed_trial_that_runs_out_of_memory_is_retried_alone_and_counted_once(
    fleet_server: ServerProcess, studies: Studies, start_worker: WorkerFactory
) -> None:
    # The doomed study's one trial dies above micro-batches of 15 at step 20: its prediction
    # (16 as asked) was wrong. Created first, it is offered first; the other study's trials
    # are packed beside it. (One study per behaviour: a grid over the knob would give each value
    # to one trial, but the server answers 500 to the complete of a grid study's last trial.)
    doomed_config = {**SLOW, "oom_above_micro_batch": 15, "oom_step": 20}
    # SQLite reuses a deleted study's id, and observations outlive their study (calibration):
    # only the observations made from here on are this test's.
    since = last_observation_id(fleet_server.database_url)
    doomed = studies.create(
        SMALL_TRIAL, n_trials=1, task_config=doomed_config, budget=BUDGET, memory_policy=PACKING
    )
    others = studies.create(
        SMALL_TRIAL, n_trials=3, task_config=SLOW, budget=BUDGET, memory_policy=PACKING
    )
    worker = start_worker(fleet_server.url, CARD, "--max-trials-per-card", "2")
    [oomed] = studies.wait_until(doomed, finished(1))
    neighbours = studies.wait_until(others, finished(3))
    assert worker.finish() == 0
    assert oomed.state == "COMPLETE" and oomed.attempt == 1, oomed
    assert oomed.plan is not None and oomed.plan.micro_batch is not None
    assert oomed.plan.micro_batch <= 15  # retried smaller, the same effective batch
    assert [t.state for t in neighbours] == ["COMPLETE"] * 3
    assert all(t.attempt == 0 for t in neighbours)  # its neighbours ran out of nothing
    runs = run_windows(worker_events(worker))
    [first, retry] = runs[oomed.id]
    assert first["packed"] and not retry["packed"]
    # Alone: no other trial of this worker ran at any point of the retry's run.
    for trial in neighbours:
        assert all(not overlaps(w, retry) for w in runs[trial.id]), (runs[trial.id], retry)
    # One OOM in the results: one observation, one trial counted by the dashboard.
    assert oom_observations(fleet_server.database_url, doomed, since) == 1
    assert oom_observations(fleet_server.database_url, others, since) == 0
    assert dashboard_memory(fleet_server, doomed)["oom"] == 1
    assert dashboard_memory(fleet_server, others)["oom"] == 0


# ---------------------------------------------------------------- helpers


def running_at_once(worker: WorkerProcess, count: int) -> Callable[[list[TrialOut]], bool]:
    """`count` trials RUNNING on the worker at the same time."""
    return lambda trials: (
        sum(t.state == "RUNNING" and t.worker == worker.name for t in trials) >= count
    )


def worker_events(worker: WorkerProcess) -> list[dict[str, Any]]:
    """The worker's JSON log lines (its events), in the order it wrote them."""
    events = []
    for line in worker.logs().splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if "event" in record:
                events.append(record)
    return events


def run_windows(events: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """Per trial, each run's window in log order: from its start to the end of its run (a
    packed run frees its slot before its final call is sent; a lone run ends with that call)."""
    runs: dict[int, list[dict[str, Any]]] = {}
    for index, event in enumerate(events):
        trial_id = event.get("trial_id")
        if event["event"] == "started":
            window = {"start": index, "end": len(events), "packed": event["packed"]}
            runs.setdefault(trial_id, []).append(window)
        elif trial_id in runs and runs[trial_id][-1]["end"] == len(events):
            last = runs[trial_id][-1]
            if event["event"] == "slot_freed" or (
                event["event"] in ("completed", "failed") and not last["packed"]
            ):
                last["end"] = index
    return runs


def overlaps(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two run windows overlap in log order."""
    return bool(a["start"] < b["end"] and b["start"] < a["end"])


def max_overlap(events: list[dict[str, Any]]) -> int:
    """The most runs in progress at once, in log order."""
    changes = sorted(
        (index, step)
        for runs in run_windows(events).values()
        for window in runs
        for index, step in ((window["start"], 1), (window["end"], -1))
    )
    running, most = 0, 0
    for _, step in changes:  # at one index an end (-1) sorts before a start
        running += step
        most = max(most, running)
    return most


def _scalar(database_url: str, query: str, **params: Any) -> int:
    engine = sa.create_engine(database_url)
    try:
        with engine.connect() as connection:
            return int(connection.execute(sa.text(query), params).scalar_one())
    finally:
        engine.dispose()


def last_observation_id(database_url: str) -> int:
    """The id of the newest memory observation (0 when none)."""
    return _scalar(database_url, "SELECT coalesce(max(id), 0) FROM vramtune_memory_observations")


def oom_observations(database_url: str, study: str, since: int) -> int:
    """Memory observations with outcome oom in the study, newer than observation `since`."""
    return _scalar(
        database_url,
        "SELECT count(*) FROM vramtune_memory_observations o "
        "JOIN vramtune_studies s ON s.study_id = o.study_id "
        "WHERE s.name = :name AND o.outcome = 'oom' AND o.id > :since",
        name=study,
        since=since,
    )


def dashboard_memory(server: ServerProcess, study: str) -> dict[str, int]:
    """The dashboard's memory counts of one study (resized, routed, infeasible, oom)."""
    response = httpx.get(f"{server.url}/api/v1/dashboard/studies", timeout=PATIENCE_S)
    assert response.status_code == 200, response.text
    [item] = [s for s in response.json()["studies"] if s["name"] == study]
    memory: dict[str, int] = item["memory"]
    return memory
