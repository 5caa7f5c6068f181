"""32 workers on PostgreSQL: every trial of a fixed budget accounted for, with and without
workers killed (SIGKILL) during the run."""

from __future__ import annotations

import random
import time

from reliability_helpers import (
    FAST_FLEET,
    Fleet,
    LeaseAuditor,
    assert_accounted,
    completed_by_workers,
    create_study,
    wait_for_budget,
    wait_for_finished,
)

from service.testing import ServerFactory, upgrade_database

WORKERS = 32
N_TRIALS = 48
KILLED_RUN_TRIALS = 64  # long enough for the kills to land while trials run
KILLS = 4


def test_32_workers_account_for_every_trial(
    postgres_url: str, start_server: ServerFactory, fleet: Fleet
) -> None:
    """Each trial COMPLETE once, numbers 0..n-1, none RUNNING, no lease left."""
    url = upgrade_database(postgres_url)
    server = start_server(url, **FAST_FLEET)
    study = create_study(server.url, N_TRIALS)
    fleet.start(server.url, WORKERS, "--exit-when-idle", "30")

    outcome = wait_for_budget(url, study, N_TRIALS)

    assert_accounted(outcome, N_TRIALS)
    assert outcome.states() == {"COMPLETE": N_TRIALS}  # no fault here: nothing may fail
    told = completed_by_workers(fleet.events())
    assert set(told) == {t._trial_id for t in outcome.trials}
    assert set(told.values()) == {1}, "a worker was told 'complete' twice for one trial"
    assert len({event["worker"] for event in fleet.events() if event["event"] == "completed"}) > 1


def test_killing_workers_loses_no_trial(
    postgres_url: str, start_server: ServerFactory, fleet: Fleet
) -> None:
    """SIGKILL a random worker every ~2 s: its trials are re-offered and finish elsewhere."""
    url = upgrade_database(postgres_url)
    server = start_server(url, **FAST_FLEET)
    study = create_study(server.url, KILLED_RUN_TRIALS, step_seconds=0.02)
    fleet.start(server.url, WORKERS, "--exit-when-idle", "30")
    rng = random.Random(9)
    killed = []
    with LeaseAuditor(url) as auditor:
        wait_for_finished(url, study, WORKERS // 4)  # the fleet is up and running trials
        while len(killed) < KILLS:
            time.sleep(2.0)
            if wait_for_finished(url, study, 0).finished() > KILLED_RUN_TRIALS * 7 // 8:
                break
            victim = fleet.kill_random(rng)
            assert victim is not None
            killed.append(victim)
        outcome = wait_for_budget(url, study, KILLED_RUN_TRIALS)

    assert auditor.polls > 0 and auditor.doubles == [], f"two active leases: {auditor.doubles}"

    assert len(killed) >= 2, "the study finished before the workers could be killed"
    assert_accounted(outcome, KILLED_RUN_TRIALS)
    killed_ids = {e["worker_id"] for w in killed for e in w.events() if e["event"] == "registered"}
    reaped = [
        lease
        for leases in outcome.leases.values()
        for lease in leases
        if lease.worker_id in killed_ids and (lease.resolution or {}).get("call") == "reaper"
    ]
    assert reaped, "no killed worker held a lease: the kills tested nothing"
    states = {t._trial_id: t.state.name for t in outcome.trials}
    for lease in reaped:
        row = outcome.rows[lease.trial_id]
        assert row.attempt >= 1, f"trial {lease.trial_id} was not re-offered"
        if states[lease.trial_id] == "COMPLETE":
            assert row.worker_id not in killed_ids, f"trial {lease.trial_id}: finished by whom?"
    counts = completed_by_workers(fleet.events())
    assert all(n == 1 for n in counts.values()), "a trial was acknowledged complete twice"
