"""The reaper: ends expired leases and re-offers their trials; ends trials no card can hold.

A worker that stops heartbeating loses its leases once they expire. Its trial is offered again
(same trial, number and parameters, attempt + 1) to the next worker that fits it, up to the
study's ``max_attempts``; then it is told FAIL with the reason. A trial waiting for a larger
card is ended as infeasible once no live worker can hold it (service.routing).

Safe with several replicas on one PostgreSQL: each lease and trial is taken ``FOR UPDATE SKIP
LOCKED``, one per transaction, so two reapers never handle the same row and a trial call on
another replica waits for the reaper's decision (and then gets its 409).
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import suppress
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.fleet import fleet_transaction
from service.leases import end, expired_lease, resolution
from service.optuna_glue import load_optuna_study, spec_of
from service.routing import attempts_left, live_capacity, reoffer, tell_failed, tell_infeasible
from service.state import AppState
from service.studies import utcnow
from service.tables import LeaseRow, StudyRow, TrialRow, WorkerRow

log = logging.getLogger("vramtune.reaper")


@dataclass
class Reaped:
    """What one pass did: leases ended, and what became of their trials."""

    leases: int = 0
    reoffered: int = 0
    failed: int = 0
    infeasible: int = 0


def reap_once(state: AppState, now: datetime | None = None) -> Reaped:
    """One pass over expired leases and stranded waiting trials, each in its own transaction."""
    now = now or utcnow()
    reaped = Reaped()
    while _reap_one_lease(state, now, reaped):
        pass
    for trial_id in _waiting_trial_ids(state):
        _route_waiting(state, trial_id, now, reaped)
    _count(reaped)
    return reaped


def _reap_one_lease(state: AppState, now: datetime, reaped: Reaped) -> bool:
    """End one expired lease and re-offer or FAIL its trial; False when none is left."""
    with fleet_transaction(state) as session:
        lease = expired_lease(session, now)
        if lease is None:
            return False
        reaped.leases += 1
        trial = session.scalar(
            select(TrialRow).where(TrialRow.trial_id == lease.trial_id).with_for_update()
        )
        if trial is None or trial.status != "leased" or trial.worker_id != lease.worker_id:
            end(lease, now, resolution("reaper", stop="lease_lost"))  # nothing left to re-offer
            return True
        _lost(session, state, lease, trial, now, reaped)
        return True


def _lost(
    session: Session,
    state: AppState,
    lease: LeaseRow,
    trial: TrialRow,
    now: datetime,
    reaped: Reaped,
) -> None:
    """The lease's trial: offered again with attempt + 1, or FAILed past max_attempts."""
    study_row = session.get_one(StudyRow, trial.study_id)
    worker = session.get(WorkerRow, lease.worker_id)
    who = worker.name if worker else f"worker {lease.worker_id}"
    if attempts_left(trial, spec_of(study_row)):
        reoffer(trial, now, next_attempt=True)
        trial.message = f"lease lost: {who} stopped heartbeating; offered again"
        reaped.reoffered += 1
    else:
        reason = f"lease lost {trial.attempt + 1} times; last: {who} stopped heartbeating"
        study = load_optuna_study(state.storage, study_row)
        tell_failed(study, state.storage, trial.trial_id, reason)  # before our writes
        trial.status, trial.outcome, trial.message = "done", "failed", reason
        trial.attempt += 1
        trial.updated_at = now
        reaped.failed += 1
    end(lease, now, resolution("reaper", stop="lease_lost"))


def _waiting_trial_ids(state: AppState) -> list[int]:
    with state.sessions() as session:
        query = select(TrialRow.trial_id).where(TrialRow.status == "waiting")
        return list(session.scalars(query.order_by(TrialRow.updated_at)))


def _route_waiting(state: AppState, trial_id: int, now: datetime, reaped: Reaped) -> None:
    """End a waiting trial as infeasible once no live worker's card can hold it."""
    with fleet_transaction(state) as session:
        trial = session.scalar(
            select(TrialRow)
            .where(TrialRow.trial_id == trial_id, TrialRow.status == "waiting")
            .with_for_update(skip_locked=True)
        )
        if trial is None:
            return
        study_row = session.get_one(StudyRow, trial.study_id)
        stale_s = state.settings.worker_stale_s
        capacity = live_capacity(session, study_row.task, now, stale_s)
        if capacity >= trial.min_bytes:
            return
        reason = f"needs {trial.min_bytes} bytes; no live card holds it (largest: {capacity})"
        study = load_optuna_study(state.storage, study_row)
        spec = spec_of(study_row)
        tell_infeasible(study, state.storage, trial_id, spec, trial.min_bytes, capacity, reason)
        trial.status, trial.outcome, trial.message = "done", "infeasible", reason
        trial.updated_at = now
        reaped.infeasible += 1


def _count(reaped: Reaped) -> None:
    """Feed the reaper's counters of /metrics, when that module is installed."""
    try:
        from service.metrics import record_reaper_action
    except ImportError:  # pragma: no cover - metrics are optional
        return
    for action in ("reoffered", "failed", "infeasible"):
        record_reaper_action(action, getattr(reaped, action))


async def reaper_loop(state: AppState, stop: asyncio.Event) -> None:
    """Run until ``stop`` is set; every ``state.settings.reaper_interval_s`` reap expired leases."""
    interval = state.settings.reaper_interval_s
    while not stop.is_set():
        try:
            reaped = await asyncio.to_thread(reap_once, state)
            if reaped.leases or reaped.infeasible:
                log.info("reaper: %s", reaped)
        except Exception:  # a database outage must not end the loop; the next pass retries
            log.exception("reaper pass failed")
        with suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=interval)
