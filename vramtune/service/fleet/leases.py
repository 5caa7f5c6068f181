"""Leases: a trial held by one worker until an expiry, fenced by a token; helpers never commit.

Every trial call presents its lease token. A call under an unknown, foreign or ended lease
changes nothing and gets a 409, except that the call which ended the lease may be repeated and
gets the answer it got the first time (stored on the lease as its resolution). A result of
running the trial (complete, report, an OOM, a prune, any fail carrying a measured peak) needs
the lease ``start``ed first (``check_started``, else 409); a hand-back, or a fail with no
measurement, may come before.

A lease is lost when the reaper ends it (service.fleet.reaper), not at the instant it expires: until
then nobody else holds its trial, so a call under it is admitted (and a heartbeat renews it).
That is what lets a result finished while the database was away be delivered when it comes
back: the reaper measures expiry in time it could see the database.
Rows are read ``FOR UPDATE`` so that replicas on one PostgreSQL serialize on a lease and its
trial (a no-op on SQLite, where the fleet's transactions are serialized in-process).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import bindparam, inspect, select, update
from sqlalchemy.orm import Session

from vramtune.service.db.tables import LeaseRow, StudyRow, TrialRow, WorkerRow
from vramtune.service.db.writes import insert_row, set_columns
from vramtune.service.errors import Conflict, LeaseLost, NotFound
from vramtune.service.fleet import events
from vramtune.service.wire import StopReason, TrialAck

TOKEN_BYTES = 32  # 256 bits: a lease cannot be guessed


def new_token() -> str:
    """A fresh, unguessable lease token (43 URL-safe characters)."""
    return secrets.token_urlsafe(TOKEN_BYTES)


@dataclass(frozen=True)
class Grant:
    """A lease just granted: what the worker is told."""

    token: str
    expires_at: datetime


def grant(
    session: Session, trial: TrialRow, worker: WorkerRow, now: datetime, ttl_s: float
) -> Grant:
    """Lease a trial to a worker: a new lease row, and the trial marked leased.

    A trial asked in this transaction (not flushed yet) is marked on its object: it is
    inserted leased, one statement less.
    """
    granted = Grant(new_token(), now + timedelta(seconds=ttl_s))
    insert_row(
        session,
        LeaseRow,
        token=granted.token,
        trial_id=trial.trial_id,
        worker_id=worker.id,
        attempt=trial.attempt,
        active=True,
        expires_at=granted.expires_at,
        created_at=now,
    )
    # A trial that waited for a larger card is routed by this lease: its story says so.
    kind: events.EventKind = "routed" if trial.status == "waiting" else "leased"
    facts = {"worker": worker.name, "card_bytes": worker.total_bytes, "attempt": trial.attempt}
    events.record(session, trial.trial_id, kind, now, **facts)
    held = {"status": "leased", "worker_id": worker.id, "updated_at": now}
    if inspect(trial).persistent:
        set_columns(session, trial, **held)
    else:
        for name, value in held.items():
            setattr(trial, name, value)
    return granted


def resolution(
    call: str, ack: TrialAck | None = None, kind: str | None = None, stop: StopReason | None = None
) -> dict[str, Any]:
    """What ended a lease: the call, the answer it got, and the stop order a worker must hear."""
    return {
        "call": call,
        "kind": kind,
        "ack": None if ack is None else ack.model_dump(mode="json"),
        "stop": stop,
    }


def end(session: Session, lease: LeaseRow, now: datetime, how: dict[str, Any]) -> None:
    """End a lease with its resolution; calls under it are refused or replayed from now on."""
    set_columns(session, lease, active=False, ended_at=now, resolution=how)


@dataclass
class Fenced:
    """A trial call admitted under its lease, or the stored answer to replay."""

    lease: LeaseRow
    trial: TrialRow
    study: StudyRow
    worker: WorkerRow
    replay: TrialAck | None = None


# One statement for the four rows a call needs. Lease before trial, as the reaper locks them:
# replicas never wait on each other in a cycle. Built once: a statement built per call costs
# its construction and cache key (SQLAlchemy memoizes both on the statement object).
_FENCE = (
    select(LeaseRow, TrialRow, StudyRow, WorkerRow)
    .join(TrialRow, TrialRow.trial_id == LeaseRow.trial_id)
    .join(StudyRow, StudyRow.study_id == TrialRow.study_id)
    .join(WorkerRow, WorkerRow.id == LeaseRow.worker_id)
    .where(LeaseRow.token == bindparam("token"), LeaseRow.trial_id == bindparam("trial_id"))
    .with_for_update(of=[LeaseRow, TrialRow])
)


def fence(
    session: Session,
    trial_id: int,
    token: str,
    now: datetime,
    call: str,
    kind: str | None = None,
) -> Fenced:
    """Admit a call on a trial under its lease, or raise NotFound / LeaseLost / Conflict."""
    found = session.execute(_FENCE, {"token": token, "trial_id": trial_id}).first()
    if found is None:
        if session.get(TrialRow, trial_id) is None:
            raise NotFound(f"trial {trial_id} not found (or its study was deleted)")
        raise LeaseLost(f"trial {trial_id}: this lease is not the trial's (unknown or foreign)")
    lease, trial, study, worker = found
    fenced = Fenced(lease, trial, study, worker)
    if lease.active:  # past its expiry too: lost once the reaper ends it, not before
        return fenced
    fenced.replay = _replay(lease, trial_id, call, kind)
    return fenced


def planning_since(session: Session, trial_ids: list[int]) -> dict[int, datetime]:
    """When each of `trial_ids` that a worker is planning was leased: an active lease whose
    worker has not called ``start`` yet is choosing the trial's plan (predicting it)."""
    if not trial_ids:
        return {}
    query = select(LeaseRow.trial_id, LeaseRow.created_at).where(
        LeaseRow.trial_id.in_(trial_ids), LeaseRow.active.is_(True), LeaseRow.started_at.is_(None)
    )
    return {trial_id: leased for trial_id, leased in session.execute(query)}


def check_started(lease: LeaseRow, trial_id: int, call: str) -> None:
    """Refuse (409) a result of running a trial under a lease whose worker never said it
    started it: the ``start`` call is where the worker names the plan it runs, so a result
    without one is not a run vramtune dispatched, and must not reach Optuna or the fleet."""
    if lease.started_at is None:
        raise Conflict(
            f"trial {trial_id}: not started under this lease: call start (with the plan it "
            f"runs) before {call}"
        )


def _replay(lease: LeaseRow, trial_id: int, call: str, kind: str | None) -> TrialAck:
    """The stored answer when the same call ended this lease; else why the call is refused."""
    how = lease.resolution or {}
    ack = how.get("ack")
    if ack is not None and how.get("call") == call and how.get("kind") == kind:
        return TrialAck.model_validate(ack)
    if ack is not None:
        ended = TrialAck.model_validate(ack).resolution
        raise Conflict(f"trial {trial_id}: already ended under this lease ({ended})")
    reason = how.get("stop") or how.get("call") or "ended"
    raise LeaseLost(f"trial {trial_id}: the lease was lost ({reason}) at {lease.ended_at}Z")


def active_leases(session: Session, worker_id: int) -> list[LeaseRow]:
    """The worker's active leases, locked."""
    query = (
        select(LeaseRow)
        .where(LeaseRow.worker_id == worker_id, LeaseRow.active.is_(True))
        .order_by(LeaseRow.id)
        .with_for_update()
    )
    return list(session.scalars(query))


def extend_for_outage(session: Session, since: datetime, now: datetime) -> int:
    """Push back by ``now - since`` the expiry of the leases live at ``since``, when the
    database was last seen: a lease's time runs only while the service can see the database
    (workers could not heartbeat meanwhile). How many leases were extended."""
    query = (
        select(LeaseRow)
        .where(LeaseRow.active.is_(True), LeaseRow.expires_at > since)
        .with_for_update(skip_locked=True)  # a lease a call holds now is being settled anyway
    )
    leases = list(session.scalars(query))
    for lease in leases:
        lease.expires_at += now - since
    return len(leases)


def expired_lease(session: Session, now: datetime) -> LeaseRow | None:
    """One active, expired lease no other replica is handling (SKIP LOCKED), locked."""
    query = (
        select(LeaseRow)
        .where(LeaseRow.active.is_(True), LeaseRow.expires_at <= now)
        .order_by(LeaseRow.expires_at)
        .limit(1)
        .with_for_update(skip_locked=True)
    )
    return session.scalar(query)


def end_study_leases(session: Session, study_id: int, now: datetime) -> None:
    """End the active leases of a study being deleted, so heartbeats order them stopped."""
    trial_ids = select(TrialRow.trial_id).where(TrialRow.study_id == study_id)
    session.execute(
        update(LeaseRow)
        .where(LeaseRow.trial_id.in_(trial_ids), LeaseRow.active.is_(True))
        .values(active=False, ended_at=now, resolution=resolution("study", stop="deleted"))
    )
