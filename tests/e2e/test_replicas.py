"""One server of two processes (`vramtune serve --processes 2`) on PostgreSQL: one worker per
trial at a time. Two replicas with sixteen workers are tested in
tests/reliability/test_reliability_server.py (real workers, a live lease auditor) and
tests/service/test_fleet_replicas.py (random and TPE)."""

from __future__ import annotations

import itertools
import signal
from collections import defaultdict
from datetime import datetime

import pytest
import sqlalchemy as sa

from tests.e2e.conftest import FAST_FLEET, Studies, WorkerFactory, finished
from vramtune.service.client import Client
from vramtune.service.testing import ServerFactory, upgrade_database
from vramtune.service.wire import TrialOut

# Workers heartbeating two server processes on two cores: slower periods than FAST_FLEET's, and
# more patience (a bound on failure, not a timing assertion).
FLEET = FAST_FLEET | {"lease_ttl_s": 8.0, "heartbeat_interval_s": 1.0, "worker_stale_s": 8.0}
PATIENCE_S = 300.0


@pytest.mark.slow
def test_one_server_of_two_processes_runs_a_study_to_its_end(
    postgres_url: str, servers: ServerFactory, start_worker: WorkerFactory
) -> None:
    upgrade_database(postgres_url)
    server = servers(postgres_url, processes=2, **FLEET)  # `vramtune serve --processes 2`
    n_trials = 24
    trials = _run_to_the_end([server.url], start_worker, n_trials, 6, max_steps=10)
    assert [t.state for t in trials] == ["COMPLETE"] * n_trials
    assert sorted(t.number for t in trials) == list(range(n_trials))
    _assert_one_lease_at_a_time(postgres_url, n_trials)


def _run_to_the_end(
    urls: list[str], start_worker: WorkerFactory, n_trials: int, n_workers: int, max_steps: int
) -> list[TrialOut]:
    """A study of n_trials run by n_workers spread over the servers; every worker then exits 0."""
    with Client(urls[0]) as client:
        studies = Studies(client)
        name = studies.create(
            {"x": {"type": "float", "low": -2.0, "high": 2.0}},
            n_trials=n_trials,
            task_config={"step_seconds": 0.01},
            budget={"max_steps": max_steps, "eval_every": max_steps // 2},
        )
        workers = [start_worker(urls[i % len(urls)]) for i in range(n_workers)]
        trials = studies.wait_until(name, finished(n_trials), PATIENCE_S)
        for worker in workers:
            worker.signal(signal.SIGTERM)
        assert [worker.wait(PATIENCE_S) for worker in workers] == [0] * n_workers
    return trials


def _assert_one_lease_at_a_time(url: str, n_trials: int) -> None:
    """No trial ever had two leases whose lifetimes overlap."""
    engine = sa.create_engine(url)
    with engine.connect() as connection:
        rows = connection.execute(
            sa.text("SELECT trial_id, created_at, ended_at FROM vramtune_leases ORDER BY id")
        ).all()
    engine.dispose()
    leases: dict[int, list[tuple[datetime, datetime]]] = defaultdict(list)
    for trial_id, created, ended in rows:
        assert ended is not None, f"trial {trial_id} still has a live lease"
        leases[trial_id].append((created, ended))
    assert len(leases) == n_trials
    for trial_id, spans in leases.items():
        spans.sort()
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end <= start, f"trial {trial_id} had two leases at once"
