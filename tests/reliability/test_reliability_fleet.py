"""32 workers on PostgreSQL: every trial of a fixed budget accounted for, with and without
workers killed (SIGKILL) during the run."""

from __future__ import annotations

import random

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

from vramtune.service.testing import ServerFactory, upgrade_database

WORKERS = 32
N_TRIALS = 48
KILLED_RUN_TRIALS = 64
KILLS = 4
# Each kill waits for its share of the study to finish, so every one lands mid-study whatever
# the machine's speed: kill k once k/(KILLS + 2) of the budget is finished.
KILL_AT = [KILLED_RUN_TRIALS * k // (KILLS + 2) for k in range(1, KILLS + 1)]


def test_32_workers_account_for_every_trial(
    postgres_url: str, start_server: ServerFactory, fleet: Fleet
) -> None:
    """Each trial COMPLETE once, numbers 0..n-1, none RUNNING, no lease left."""
    url = upgrade_database(postgres_url)
    server = start_server(url, **FAST_FLEET)
    study = create_study(server.url, N_TRIALS)
    fleet.start(server.url, WORKERS)

    outcome = wait_for_budget(url, study, N_TRIALS)
    fleet.stop_all()  # every worker has logged what it was told

    assert_accounted(outcome, N_TRIALS)
    assert outcome.states() == {"COMPLETE": N_TRIALS}  # no fault here: nothing may fail
    told = completed_by_workers(fleet.events())
    assert set(told) == {t._trial_id for t in outcome.trials}
    assert set(told.values()) == {1}, "a worker was told 'complete' twice for one trial"
    assert len({event["worker"] for event in fleet.events() if event["event"] == "completed"}) > 1


def test_killing_workers_loses_no_trial(
    postgres_url: str, start_server: ServerFactory, fleet: Fleet
) -> None:
    """SIGKILL a worker running a trial at four points of the study: its trial is re-offered
    and finishes elsewhere."""
    url = upgrade_database(postgres_url)
    server = start_server(url, **FAST_FLEET)
    # 2 s runs: a kill lands mid-run more often than in the complete call that follows a run
    # (seconds long on a loaded machine), where the server may have taken the result already.
    study = create_study(server.url, KILLED_RUN_TRIALS, step_seconds=0.1)
    fleet.start(server.url, WORKERS)
    rng = random.Random(9)
    killed = []  # (worker, the trial it was running)
    with LeaseAuditor(url) as auditor:
        for finished in KILL_AT:
            wait_for_finished(url, study, finished)
            killed.append(fleet.kill_busy(rng))
        outcome = wait_for_budget(url, study, KILLED_RUN_TRIALS)
    fleet.stop_all()

    assert auditor.polls > 0 and auditor.doubles == [], f"two active leases: {auditor.doubles}"

    assert_accounted(outcome, KILLED_RUN_TRIALS)
    killed_ids = {victim.worker_id() for victim, _ in killed}
    assert len(killed_ids) == KILLS
    for victim, trial_id in killed:
        held = [le for le in outcome.leases[trial_id] if le.worker_id == victim.worker_id()][-1]
        # Reaped; or completed in the instant between the server's commit and the worker's log.
        how = (held.resolution or {}).get("call")
        assert how in ("reaper", "complete"), f"{victim.name}'s lease on {trial_id} ended: {how}"
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
