"""Retiring workers: the rows of stopped and silent workers are deleted, so that the workers
table stays bounded however often workers register, stop or vanish; helpers never commit.

Two ways out: a registration past its token's ``max_workers_per_token`` retires that token's
oldest retirable workers (service.fleet.workers.register), and the reaper retires any worker
not heard from for ``worker_retention_s`` (service.fleet.reaper). Retirable: stopped or silent
past ``worker_stale_s`` (not live), and holding no active lease.

A retired worker's ended leases go with it (``vramtune_leases.worker_id`` is a foreign key);
its trials, observations and predictions keep their results and its id (plain columns, no
foreign key), so the id is never given to another worker: see ``retire_expired``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, delete, func, or_, select
from sqlalchemy.orm import Session

from vramtune.common.logs import log_event
from vramtune.service.db.tables import LeaseRow, WorkerRow
from vramtune.service.errors import TooMany
from vramtune.service.settings import Settings

log = logging.getLogger("vramtune.fleet")

# Rows one reaper pass retires at most: a backlog is worked off over passes, in short
# transactions, instead of one long one holding the table.
RETIRE_BATCH = 500


def retirable(now: datetime, stale_s: float) -> ColumnElement[bool]:
    """Stopped or not heard from within ``stale_s``, and holding no active lease."""
    silent = WorkerRow.last_heartbeat < now - timedelta(seconds=stale_s)
    holding = (
        select(LeaseRow.id)
        .where(LeaseRow.worker_id == WorkerRow.id, LeaseRow.active.is_(True))
        .exists()
    )
    return or_(WorkerRow.stopped.is_(True), silent) & ~holding


def owned_by(token_id: int | None) -> ColumnElement[bool]:
    """The workers a token registered (None: those registered with auth off)."""
    return WorkerRow.token_id.is_(None) if token_id is None else WorkerRow.token_id == token_id


def make_room(
    session: Session, settings: Settings, token_id: int | None, now: datetime, newest: int
) -> None:
    """After worker ``newest`` registered: retire the token's oldest retirable workers until it
    has ``max_workers_per_token``; TooMany (the registration rolls back) if it cannot."""
    limit = settings.max_workers_per_token
    registered = int(session.scalar(select(func.count()).where(owned_by(token_id))) or 0)
    excess = registered - limit
    if excess <= 0:
        return
    oldest = (
        select(WorkerRow.id)
        .where(owned_by(token_id), WorkerRow.id != newest)
        .where(retirable(now, settings.worker_stale_s))
        .order_by(WorkerRow.last_heartbeat, WorkerRow.id)
        .limit(excess)
        .with_for_update(skip_locked=True)  # a worker heartbeating now is not retired under it
    )
    worker_ids = list(session.scalars(oldest))
    if len(worker_ids) < excess:  # refused before anything is deleted
        raise TooMany(
            f"this token has {registered - 1} workers registered, the limit "
            f"(VRAMTUNE_MAX_WORKERS_PER_TOKEN) is {limit}, and every one is live or holds a "
            f"lease: stop some (POST /workers/ID/stop) or wait {settings.worker_stale_s:g} s "
            "for silent ones to go stale and their leases to expire"
        )
    retire(session, worker_ids)


def retire_expired(session: Session, settings: Settings, now: datetime) -> int:
    """Retire up to RETIRE_BATCH workers not heard from for ``worker_retention_s``.

    The newest row is kept whatever its state: SQLite gives a new row the largest id + 1, so
    deleting the largest would hand its id, still named by trials and observations, to the
    next worker that registers. (Registration retires only rows older than the one it adds.)
    """
    cutoff = now - timedelta(seconds=settings.worker_retention_s)
    newest = select(func.max(WorkerRow.id)).scalar_subquery()
    expired = (
        select(WorkerRow.id)
        .where(WorkerRow.last_heartbeat < cutoff, WorkerRow.id < newest)
        .where(retirable(now, settings.worker_stale_s))
        .order_by(WorkerRow.id)
        .limit(RETIRE_BATCH)
        .with_for_update(skip_locked=True)  # replicas' reapers share the backlog
    )
    return retire(session, list(session.scalars(expired)))


def retire(session: Session, worker_ids: Sequence[int]) -> int:
    """Delete the workers and their (ended) leases; how many workers."""
    if not worker_ids:
        return 0
    session.execute(delete(LeaseRow).where(LeaseRow.worker_id.in_(worker_ids)))
    session.execute(delete(WorkerRow).where(WorkerRow.id.in_(worker_ids)))
    log_event(log, "workers_retired", workers=len(worker_ids), first=min(worker_ids))
    return len(worker_ids)
