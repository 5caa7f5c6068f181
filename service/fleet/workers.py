"""Workers: they register, heartbeat and leave, and are listed; helpers never commit.

What a worker that asks for work gets is service.fleet.dispatch.

Each use case runs in one ``fleet_transaction``, which writes Optuna's rows of a trial and
vramtune's together (service.optuna.rows): a call either happened whole or not at all. On
PostgreSQL, replicas serialize on row locks (``FOR UPDATE``, ``SKIP LOCKED`` for the offer of a
pending trial); on SQLite those are no-ops, and a process lock serializes the fleet's
transactions instead (SQLite has one writer anyway, and one server process).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from datetime import datetime
from typing import Literal

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.api.errors import Conflict, NotFound
from service.db.engine import is_sqlite
from service.db.tables import LeaseRow, StudyRow, TrialRow, WorkerRow
from service.fleet.leases import active_leases, end, ended_since, renew, resolution
from service.fleet.routing import reoffer
from service.settings import Settings
from service.state import AppState
from service.wire import (
    CardInfo,
    Heartbeat,
    HeartbeatReply,
    StopOrder,
    WorkerList,
    WorkerOut,
    WorkerRegister,
    WorkerRegistered,
)

log = logging.getLogger("vramtune.fleet")

WorkerState = Literal["live", "stale", "stopped"]

_sqlite_writes = threading.Lock()


@contextmanager
def fleet_transaction(state: AppState) -> Iterator[Session]:
    """One use case, one transaction; serialized in-process on SQLite (see the module doc)."""
    lock = _sqlite_writes if is_sqlite(state.settings.database_url) else nullcontext()
    with lock, state.sessions() as session, session.begin():
        yield session


# ---------------------------------------------------------------- workers


def register(
    session: Session, settings: Settings, body: WorkerRegister, now: datetime
) -> WorkerRegistered:
    """Record a worker and its card; the answer carries its id and the heartbeat period."""
    worker = WorkerRow(
        name=body.name,
        device=body.device,
        card_model=body.card.model,
        total_bytes=body.card.total_bytes,
        free_bytes=body.card.free_bytes,
        card=body.card.model_dump(mode="json"),
        constants=body.constants.model_dump(mode="json"),
        tasks=sorted(set(body.tasks)),
        registered_at=now,
        last_heartbeat=now,
        stopped=False,
        trials_done=0,
    )
    session.add(worker)
    session.flush()
    return WorkerRegistered(
        worker_id=worker.id,
        heartbeat_interval_s=settings.heartbeat_interval_s,
        lease_ttl_s=settings.lease_ttl_s,
    )


def get_worker(session: Session, worker_id: int) -> WorkerRow:
    """The worker row; NotFound if there is none."""
    worker = session.get(WorkerRow, worker_id)
    if worker is None:
        raise NotFound(f"worker {worker_id} not found: register first (POST /workers)")
    return worker


def running_worker(session: Session, worker_id: int) -> WorkerRow:
    """The worker row of a worker that has not stopped; Conflict if it has."""
    worker = get_worker(session, worker_id)
    if worker.stopped:
        raise Conflict(f"worker {worker_id} has stopped: register again to rejoin")
    return worker


def worker_state(worker: WorkerRow, now: datetime, stale_s: float) -> WorkerState:
    """live, stale (no heartbeat for ``stale_s``) or stopped."""
    if worker.stopped:
        return "stopped"
    return "stale" if (now - worker.last_heartbeat).total_seconds() > stale_s else "live"


def heartbeat(
    session: Session, settings: Settings, worker_id: int, body: Heartbeat, now: datetime
) -> HeartbeatReply:
    """Renew the leases of the trials the worker runs; order stopped what it must not run on.

    A lease of a trial the worker does not list is left to expire (the reaper then offers the
    trial again): its assignment was lost on the way. Not ended at once, because a heartbeat
    sent before a next's answer arrived may be read after that next.
    """
    leases = active_leases(session, worker_id)  # leases before the worker: the lock order
    worker = running_worker(session, worker_id)
    stops = [
        StopOrder(trial_id=lease.trial_id, reason=lease.resolution["stop"])
        for lease in ended_since(session, worker_id, worker.last_heartbeat)
        if lease.resolution and lease.resolution.get("stop")
    ]
    trials = _trials_by_id(session, [lease.trial_id for lease in leases])
    paused = _paused_studies(session, {trial.study_id for trial in trials.values()})
    renewing = []
    for lease in leases:
        trial = trials.get(lease.trial_id)
        if lease.expires_at <= now:
            stops.append(StopOrder(trial_id=lease.trial_id, reason="lease_lost"))
        elif trial is None:  # its study was deleted underneath
            end(lease, now, resolution("study", stop="deleted"))
            stops.append(StopOrder(trial_id=lease.trial_id, reason="deleted"))
        elif body.trials is None or lease.trial_id in body.trials:
            renewing.append(lease.id)
            if trial.study_id in paused:
                stops.append(StopOrder(trial_id=lease.trial_id, reason="paused"))
    renew(session, renewing, now, settings.lease_ttl_s)
    worker.last_heartbeat = now
    if body.free_bytes is not None:
        worker.free_bytes = body.free_bytes
    return HeartbeatReply(stop=stops)


def _trials_by_id(session: Session, trial_ids: Sequence[int]) -> dict[int, TrialRow]:
    query = select(TrialRow).where(TrialRow.trial_id.in_(trial_ids))
    return {trial.trial_id: trial for trial in session.scalars(query)}


def _paused_studies(session: Session, study_ids: set[int]) -> set[int]:
    query = select(StudyRow.study_id).where(
        StudyRow.study_id.in_(study_ids), StudyRow.paused.is_(True)
    )
    return set(session.scalars(query))


def stop_worker(session: Session, worker_id: int, now: datetime) -> None:
    """The worker leaves: its leases end now and their trials are offered again."""
    leases = active_leases(session, worker_id)
    worker = get_worker(session, worker_id)
    trials = _trials_by_id(session, [lease.trial_id for lease in leases])
    for lease in leases:
        end(lease, now, resolution("stop"))
        trial = trials.get(lease.trial_id)
        if trial is not None and trial.status == "leased":
            reoffer(trial, now, next_attempt=False)  # the worker left, the trial did not fail
    worker.stopped = True


def list_workers(session: Session, settings: Settings, now: datetime) -> WorkerList:
    """The fleet: every worker with its card, state and the trials it holds now."""
    current: dict[int, list[int]] = {}
    holding = select(LeaseRow.worker_id, LeaseRow.trial_id).where(LeaseRow.active.is_(True))
    for worker_id, trial_id in session.execute(holding.order_by(LeaseRow.id)):
        current.setdefault(worker_id, []).append(trial_id)
    workers = session.scalars(select(WorkerRow).order_by(WorkerRow.id))
    return WorkerList(
        workers=[
            WorkerOut(
                id=w.id,
                name=w.name,
                device=w.device,
                card=CardInfo.model_validate({**w.card, "free_bytes": w.free_bytes}),
                tasks=list(w.tasks),
                state=worker_state(w, now, settings.worker_stale_s),
                last_heartbeat=w.last_heartbeat,
                current_trials=current.get(w.id, []),
                trials_done=w.trials_done,
            )
            for w in workers
        ]
    )
