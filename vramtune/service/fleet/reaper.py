"""The reaper: ends expired leases and re-offers their trials; ends trials no card can hold.

A worker that stops heartbeating loses its leases once they expire, in time the service could
see the database (reaper_loop). Its trial is offered again
(same trial, number and parameters, attempt + 1) to the next worker that fits it, up to the
study's ``max_attempts``; then it is told FAIL with the reason. A trial waiting for a larger
card is ended as infeasible once no live worker can hold it (service.fleet.routing). Workers
not heard from for ``worker_retention_s`` are retired (vramtune.service.fleet.retirement).

Safe with several replicas on one PostgreSQL: each lease and trial is taken ``FOR UPDATE SKIP
LOCKED``, one per transaction, so two reapers never handle the same row and a trial call on
another replica waits for the reaper's decision (and then gets its 409).
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import suppress
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import Any

from optuna.trial import TrialState
from sqlalchemy import select
from sqlalchemy.exc import DBAPIError, TimeoutError as SQLAlchemyTimeout
from sqlalchemy.orm import Session

from vramtune.common.logs import log_event, one_line
from vramtune.common.units import human_bytes
from vramtune.service.db.tables import LeaseRow, StudyRow, TrialRow, WorkerRow
from vramtune.service.fleet import events
from vramtune.service.fleet.leases import end, expired_lease, extend_for_outage, resolution
from vramtune.service.fleet.retirement import retire_expired
from vramtune.service.fleet.routing import (
    OptunaTell,
    attempts_left,
    live_capacity,
    reoffer,
    tell_failed,
    tell_infeasible,
)
from vramtune.service.fleet.workers import fleet_transaction
from vramtune.service.metrics import record_reaper_action
from vramtune.service.optuna.glue import spec_of
from vramtune.service.state import AppState

log = logging.getLogger("vramtune.reaper")


@dataclass
class Reaped:
    """What one pass did: leases ended, and what became of their trials."""

    leases: int = 0
    reoffered: int = 0
    failed: int = 0
    infeasible: int = 0
    retired: int = 0  # workers whose rows were deleted


@dataclass
class _Pass:
    """One pass of the reaper: where, as of when, and its tally."""

    state: AppState
    now: datetime
    reaped: Reaped


def reap_once(
    state: AppState,
    now: datetime | None = None,
    expire_leases: bool = True,
    route_waiting: bool = True,
) -> Reaped:
    """One pass over expired leases and stranded waiting trials (unless told to leave either
    alone), each in its own transaction."""
    run = _Pass(state, now or state.clock(), Reaped())
    while expire_leases and _reap_one_lease(run):
        pass
    for trial_id in _waiting_trial_ids(state) if route_waiting else []:
        _route_waiting(run, trial_id)
    with fleet_transaction(state) as session:
        run.reaped.retired = retire_expired(session, state.settings, run.now)
    _count(run.reaped)
    return run.reaped


def _reap_one_lease(run: _Pass) -> bool:
    """End one expired lease and re-offer or FAIL its trial; False when none is left."""
    with fleet_transaction(run.state) as session:
        lease = expired_lease(session, run.now)
        if lease is None:
            return False
        run.reaped.leases += 1
        trial = session.scalar(
            select(TrialRow).where(TrialRow.trial_id == lease.trial_id).with_for_update()
        )
        # A trial no longer held under this lease has nothing left to re-offer.
        held = trial is not None and trial.status == "leased" and trial.worker_id == lease.worker_id
        then = "not_held"
        if held and trial is not None:
            then = "settled"
            if not _settled_in_optuna(run, trial):
                _retry_or_fail(session, run, lease, trial)
                then = "reoffered" if trial.status == "pending" else "failed"
        end(session, lease, run.now, resolution("reaper", stop="lease_lost"))
        facts: dict[str, Any] = {"trial_id": lease.trial_id, "worker_id": lease.worker_id}
        facts |= {"lease_id": lease.id, "expired_at": lease.expires_at, "then": then}
        facts["attempt"] = None if trial is None else trial.attempt
    log_event(log, "lease_reaped", **facts)  # once committed
    return True


def _retry_or_fail(session: Session, run: _Pass, lease: LeaseRow, trial: TrialRow) -> None:
    """Offer the trial again with attempt + 1, or FAIL it past the study's max_attempts."""
    study_row = session.get_one(StudyRow, trial.study_id)
    worker = session.get(WorkerRow, lease.worker_id)
    who = worker.name if worker else f"worker {lease.worker_id}"
    if attempts_left(trial, spec_of(study_row)):
        reoffer(trial, run.now, next_attempt=True)
        trial.message = f"lease lost: {who} stopped heartbeating; offered again"
        run.reaped.reoffered += 1
        events.record(session, trial.trial_id, "lease_lost", run.now, worker=who, then="offered")
        return
    reason = f"lease lost {trial.attempt + 1} times; last: {who} stopped heartbeating"
    events.record(session, trial.trial_id, "lease_lost", run.now, worker=who, then="failed")
    tell_failed(OptunaTell(session, run.state.storage, study_row, run.now), trial, reason)
    trial.status, trial.outcome, trial.message = "done", "failed", reason
    trial.attempt += 1
    trial.updated_at = run.now
    run.reaped.failed += 1


_OUTCOMES = {TrialState.FAIL: "failed", TrialState.PRUNED: "pruned"}


def _settled_in_optuna(run: _Pass, trial: TrialRow) -> bool:
    """Mark done a trial Optuna has finished (or lost) already, e.g. after a failed commit."""
    try:
        told = run.state.storage.get_trial(trial.trial_id).state
    except KeyError:
        told = None  # gone from Optuna: nothing left to run or tell
    if told is not None and not told.is_finished():
        return False
    trial.status, trial.updated_at = "done", run.now
    trial.outcome = _OUTCOMES.get(told, trial.outcome) if told else "failed"
    trial.message = f"already {told.name if told else 'gone'} in Optuna; not offered again"
    return True


def _waiting_trial_ids(state: AppState) -> list[int]:
    with state.sessions() as session:
        query = select(TrialRow.trial_id).where(TrialRow.status == "waiting")
        return list(session.scalars(query.order_by(TrialRow.updated_at)))


def _route_waiting(run: _Pass, trial_id: int) -> None:
    """End a waiting trial as infeasible once no live worker's card can hold it.

    The trial is locked only once it is to end: a lock taken on every pass to look at it made
    a worker's ``next`` skip it (SKIP LOCKED) whenever the two met, and that worker was told
    there was no work while the trial waited for just its card (PostgreSQL).
    """
    with fleet_transaction(run.state) as session:
        looked = session.get(TrialRow, trial_id)
        if looked is None or looked.status != "waiting":
            return
        study_row = session.get_one(StudyRow, looked.study_id)
        settings = run.state.settings
        capacity = live_capacity(
            session,
            study_row,
            run.now,
            settings.worker_stale_s,
            settings.max_card_bytes,
            min_cards=looked.min_world_size,
        )
        if capacity >= looked.min_bytes:
            return
        trial = session.scalar(
            select(TrialRow)
            .where(TrialRow.trial_id == trial_id, TrialRow.status == "waiting")
            .with_for_update(skip_locked=True)
            .execution_options(populate_existing=True)
        )
        if trial is None or trial.min_world_size != looked.min_world_size:
            return  # taken meanwhile, or waiting for other cards now: the next pass looks again
        if capacity >= trial.min_bytes or _settled_in_optuna(run, trial):
            return
        cards = "" if trial.min_world_size == 1 else f" on each of {trial.min_world_size} cards"
        needs, largest = human_bytes(trial.min_bytes), human_bytes(capacity)
        reason = f"needs {needs}{cards}; no live card holds it (largest: {largest})"
        telling = OptunaTell(session, run.state.storage, study_row, run.now)
        tell_infeasible(telling, trial, trial.min_bytes, capacity, reason)
        trial.status, trial.outcome, trial.message = "done", "infeasible", reason
        trial.updated_at = run.now
        run.reaped.infeasible += 1
        footprint = trial.min_bytes
        events.record(
            session,
            trial_id,
            "infeasible",
            run.now,
            footprint_bytes=footprint,
            largest_card_bytes=capacity,
        )
        log_event(
            log, "infeasible", trial_id=trial_id, study=study_row.name, min_bytes=trial.min_bytes
        )


def _count(reaped: Reaped) -> None:
    """Feed the reaper's counters of /metrics."""
    for action in ("reoffered", "failed", "infeasible", "retired"):
        record_reaper_action(action, getattr(reaped, action))


def extend_after_outage(state: AppState, since: datetime, now: datetime) -> int:
    """The database is back after a pass failed: leases get the time it was away back."""
    with fleet_transaction(state) as session:
        return extend_for_outage(session, since, now)


@dataclass
class Sight:
    """What the reaper loop has seen of the database: when a pass first and last reached it,
    since when passes have failed (None while they succeed) and how many leases the passes of
    this outage extended."""

    first: datetime | None = None
    last: datetime | None = None
    failing_since: datetime | None = None
    extended: int = 0

    def in_restart_grace(self, now: datetime, grace_s: float) -> bool:
        """Whether ``now`` is within ``grace_s`` of the first pass that reached the database.

        Workers could not heartbeat while this process was not running: however long the
        server was down, each gets a lease TTL after it came back before its leases expire
        (and ``worker_stale_s`` before it is judged gone).
        """
        return self.first is None or now < self.first + timedelta(seconds=grace_s)


def _catch_up(state: AppState, sight: Sight, now: datetime) -> None:
    """After failed passes: extend the leases by the time since the database was last seen."""
    if sight.failing_since is None or sight.last is None:
        return
    sight.extended += extend_after_outage(state, sight.last, now)
    sight.last = now  # extended up to now: a failure of the reap that follows adds only its own


def _reaper_pass(state: AppState, sight: Sight, now: datetime) -> None:
    """One pass of the loop: catch up after an outage, then reap (leases only past the grace)."""
    _catch_up(state, sight, now)
    settings = state.settings
    # Nor is a worker judged stale, and its waiting trials ended infeasible, by heartbeats it
    # could not send while this process was down.
    reaped = reap_once(
        state,
        now,
        expire_leases=not sight.in_restart_grace(now, settings.lease_ttl_s),
        route_waiting=not sight.in_restart_grace(now, settings.worker_stale_s),
    )
    sight.first, sight.last = sight.first or now, now
    if sight.failing_since is not None:  # one line for the whole outage's end
        outage_s = round((now - sight.failing_since).total_seconds(), 1)
        since, extended = sight.failing_since, sight.extended
        log_event(log, "database_back", failing_since=since, outage_s=outage_s, leases=extended)
        sight.failing_since, sight.extended = None, 0
    if reaped.leases or reaped.infeasible or reaped.retired:
        log_event(log, "reaper_pass", **asdict(reaped))


def _pass_failed(sight: Sight, now: datetime, error: Exception) -> None:
    """One line per failed pass: what failed and since when (an outage is not a bug to trace).

    An error that is not the database's shows its traceback once, when the failures begin.
    """
    first = sight.failing_since is None
    sight.failing_since = sight.failing_since or now
    if first and not _is_database_error(error):
        log.exception("reaper pass failed")
        return
    log_event(
        log,
        "reaper_pass_failed",
        level=logging.WARNING,
        error=one_line(error),
        failing_since=sight.failing_since,
        database_last_seen=sight.last,
    )


def _is_database_error(error: BaseException | None) -> bool:
    """Whether the error, or one it was raised from, is the database driver's."""
    while error is not None:
        if isinstance(error, DBAPIError | SQLAlchemyTimeout):
            return True
        error = error.__cause__ or error.__context__
    return False


async def reaper_loop(state: AppState, stop: asyncio.Event) -> None:
    """Run until ``stop`` is set; every ``state.settings.reaper_interval_s`` reap expired leases.

    Expiry counts only time the database could be seen, from this process: no lease expires
    within a lease TTL of the first pass that reached the database (a restart), and after failed
    passes the first pass that reaches it again extends the leases by the time since the last
    good pass, before it reaps. With several replicas each extends by the outage it saw: a lease
    of a dead worker may live that much longer, a result finished during the outage or while the
    server was down is not refused.
    """
    interval = state.settings.reaper_interval_s
    sight = Sight()
    while not stop.is_set():
        now = state.clock()
        try:
            await asyncio.to_thread(_reaper_pass, state, sight, now)
        except Exception as error:  # a database outage must not end the loop; the next retries
            _pass_failed(sight, now, error)
        with suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=interval)
