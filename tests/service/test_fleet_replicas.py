"""Two server replicas on one PostgreSQL, 16 concurrent workers: no double assignment, no loss.

Each worker is a thread with its own HTTP client on one of the two servers. Some workers
"die" holding a trial (they stop heartbeating and register again as a new worker), so both
replicas' reapers race to re-offer those trials while the other workers keep pulling.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from typing import Any

import httpx
import optuna
import pytest
from optuna.trial import TrialState
from sqlalchemy import create_engine, func, select
from sqlalchemy.pool import NullPool

from vramtune.service.db.tables import LeaseRow, TrialRow
from vramtune.service.testing import ServerFactory, upgrade_database

GIB = 2**30
N_TRIALS = 48
N_WORKERS = 16
PLAN = {"micro_batch": None, "accumulation": 1, "checkpointing": False, "bf16": False}


class Record:
    """What the workers saw, shared between their threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.accepted: Counter[int] = Counter()  # trial id -> completes answered 200
        self.errors: list[str] = []

    def complete_accepted(self, trial_id: int) -> None:
        with self.lock:
            self.accepted[trial_id] += 1

    def error(self, text: str) -> None:
        with self.lock:
            self.errors.append(text)


def register(http: httpx.Client, name: str) -> int:
    """A new worker id for the 'quadratic' task."""
    card = {"model": "Sim 8G", "total_bytes": 8 * GIB, "free_bytes": 8 * GIB}
    body = {"name": name, "device": "cpu", "card": card, "tasks": ["quadratic"]}
    return int(http.post("/workers", json=body).json()["worker_id"])


def study_done(http: httpx.Client) -> bool:
    """Whether every trial of the budget has finished."""
    return bool(http.get("/studies/replicas").json()["state"] == "done")


def run_worker(base: str, index: int, record: Record, stop: threading.Event) -> None:
    """Pull, heartbeat, complete until the study is done; 'die' on every 7th first attempt."""
    with httpx.Client(base_url=f"{base}/api/v1", timeout=60) as http:
        worker_id = register(http, f"w{index}")
        while not stop.is_set():
            response = http.post(f"/workers/{worker_id}/next", json={"free_bytes": 8 * GIB})
            if response.status_code == 204:
                if study_done(http):
                    return
                time.sleep(0.2)
                continue
            if response.status_code != 200:
                record.error(f"next: {response.status_code} {response.text}")
                return
            assignment: dict[str, Any] = response.json()
            if assignment["number"] % 7 == 3 and assignment["attempt"] == 0:
                worker_id = register(http, f"w{index}-reborn")  # the old id never beats again
                continue
            http.post(f"/workers/{worker_id}/heartbeat", json={})
            _complete(http, assignment, record)


def _complete(http: httpx.Client, assignment: dict[str, Any], record: Record) -> None:
    """Start the trial, then complete it, as a worker does."""
    trial = f"/trials/{assignment['trial_id']}"
    started = http.post(f"{trial}/start", json={"lease": assignment["lease"], "plan": PLAN})
    if started.status_code != 200:
        if started.status_code != 409:  # 409: the lease expired on a loaded machine
            record.error(f"start: {started.status_code} {started.text}")
        return
    body = {
        "lease": assignment["lease"],
        "values": [assignment["params"]["x"] ** 2],
        "plan": PLAN,
        "measured": {"peak_allocated_bytes": GIB},
        "duration_s": 0.01,
    }
    response = http.post(f"{trial}/complete", json=body)
    if response.status_code == 200:
        record.complete_accepted(assignment["trial_id"])
    elif response.status_code != 409:  # 409: the lease expired on a loaded machine; re-offered
        record.error(f"complete: {response.status_code} {response.text}")


@pytest.mark.parametrize(
    "sampler",
    [
        {"name": "random"},
        # TPE is asked in batches sharing one Parzen fit, one batch per replica at a time
        {"name": "tpe", "args": {"n_startup_trials": 2}},
    ],
)
def test_two_replicas_sixteen_workers(
    postgres_url: str, start_server: ServerFactory, sampler: dict[str, Any]
) -> None:
    url = upgrade_database(postgres_url)
    settings = {"lease_ttl_s": 3, "reaper_interval_s": 0.2, "worker_stale_s": 3}
    servers = [start_server(url, **settings).url for _ in range(2)]
    spec = {
        "name": "replicas",
        "task": "quadratic",
        "search_space": {"x": {"type": "float", "low": -3.0, "high": 3.0}},
        "sampler": sampler,
        "pruner": {"name": "none"},
        "n_trials": N_TRIALS,
        "max_attempts": 5,
    }
    assert httpx.post(f"{servers[0]}/api/v1/studies", json=spec).status_code == 201
    record, stop = Record(), threading.Event()
    auditor = LeaseAuditor(url, stop)
    auditor.start()
    threads = [
        threading.Thread(target=run_worker, args=(servers[i % 2], i, record, stop), daemon=True)
        for i in range(N_WORKERS)
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 240  # a limit on waiting, not a timing assertion
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    stop.set()
    auditor.join(30)
    assert not any(thread.is_alive() for thread in threads), "workers did not finish"
    assert auditor.polls > 0 and auditor.doubles == []  # one active lease per trial at a time
    assert record.errors == []

    trials = optuna.load_study(study_name="replicas", storage=url).get_trials()
    assert len(trials) == N_TRIALS  # the budget, across both replicas
    assert sorted(t.number for t in trials) == list(range(N_TRIALS))  # unique numbers
    assert all(t.state == TrialState.COMPLETE for t in trials)  # nothing lost or stuck
    complete_ids = {t._trial_id for t in trials}
    assert set(record.accepted) == complete_ids
    assert set(record.accepted.values()) == {1}  # each trial's result taken exactly once
    _assert_leases_of_each_trial_in_turn(url, complete_ids)


class LeaseAuditor(threading.Thread):
    """Polls the database while the workers run: no trial may ever hold two active leases."""

    def __init__(self, url: str, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.engine = create_engine(url, poolclass=NullPool)
        self.stop = stop
        self.polls = 0
        self.doubles: list[tuple[int, int]] = []

    def run(self) -> None:
        doubled = (
            select(LeaseRow.trial_id, func.count())
            .where(LeaseRow.active.is_(True))
            .group_by(LeaseRow.trial_id)
            .having(func.count() > 1)
        )
        with self.engine.connect() as connection:
            while not self.stop.wait(0.02):
                # One statement, one snapshot: the active leases at one instant.
                self.doubles += [(t, n) for t, n in connection.execute(doubled)]
                connection.rollback()
                self.polls += 1
        self.engine.dispose()


def _assert_leases_of_each_trial_in_turn(url: str, trial_ids: set[int]) -> None:
    """Per trial, every lease but the last ended without a result; the last one completed it."""
    engine = create_engine(url, poolclass=NullPool)
    with engine.connect() as connection:
        leases = connection.execute(select(LeaseRow).order_by(LeaseRow.id)).all()
        statuses = set(connection.execute(select(TrialRow.status)).scalars())
    engine.dispose()
    assert statuses == {"done"}
    by_trial: dict[int, list[Any]] = defaultdict(list)
    for lease in leases:
        by_trial[lease.trial_id].append(lease)
    assert set(by_trial) == trial_ids
    reoffered = 0
    for trial_leases in by_trial.values():
        assert not any(lease.active for lease in trial_leases)
        calls = [(lease.resolution or {}).get("call") for lease in trial_leases]
        assert calls[-1] == "complete" and calls.count("complete") == 1
        attempts = [lease.attempt for lease in trial_leases]
        assert attempts == sorted(attempts)
        reoffered += len(trial_leases) > 1
    assert reoffered >= N_TRIALS // 7  # the dead workers' trials went through the reapers
