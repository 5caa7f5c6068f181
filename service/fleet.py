"""Fleet use cases: workers register, heartbeat, pull trials and leave; helpers never commit.

Each use case runs in one ``fleet_transaction``. On PostgreSQL, replicas serialize on row locks
(``FOR UPDATE``, ``SKIP LOCKED`` for the offer of a pending trial); on SQLite those are no-ops,
and a process lock serializes the fleet's transactions instead (SQLite has one writer anyway,
and one server process). Optuna's storage writes through its own connection, so a use case
calls Optuna before its first write of vramtune's rows: on SQLite a pending write of ours
would hold the database lock the Optuna call waits for.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from datetime import datetime
from typing import Any, Literal

import optuna
from optuna.storages import BaseStorage
from optuna.trial import TrialState
from sqlalchemy import case, func, or_, select
from sqlalchemy.orm import Session

from service.db import is_sqlite
from service.errors import Conflict, NotFound
from service.leases import active_leases, end, ended_since, grant, renew, resolution
from service.optuna_glue import load_optuna_study, search_space, spec_of
from service.routing import plans_on, reoffer
from service.settings import Settings
from service.state import AppState
from service.tables import LeaseRow, StudyRow, TrialRow, WorkerRow
from service.wire import (
    Assignment,
    CardInfo,
    Heartbeat,
    HeartbeatReply,
    NextRequest,
    ParamValue,
    PlanOut,
    StopOrder,
    WorkerList,
    WorkerOut,
    WorkerRegister,
    WorkerRegistered,
)

log = logging.getLogger("vramtune.fleet")

WorkerState = Literal["live", "stale", "stopped"]

_sqlite_writes = threading.Lock()


_UNDO = "vramtune.undo"


@contextmanager
def fleet_transaction(state: AppState) -> Iterator[Session]:
    """One use case, one transaction; serialized in-process on SQLite (see the module doc).

    If the transaction rolls back (an error, or its commit failing), the Optuna writes it made
    are undone by the actions registered with ``on_rollback``, after the rollback.
    """
    lock = _sqlite_writes if is_sqlite(state.settings.database_url) else nullcontext()
    with lock, state.sessions() as session:
        try:
            with session.begin():
                yield session
        except BaseException:
            _undo(session)
            raise


def on_rollback(session: Session, action: Callable[[], object]) -> None:
    """Undo an Optuna write (which commits on its own) if the session's transaction fails."""
    session.info.setdefault(_UNDO, []).append(action)


def _undo(session: Session) -> None:
    for action in reversed(session.info.pop(_UNDO, [])):
        try:
            action()
        except Exception:  # best effort: the original error is the one to report
            log.exception("could not undo an Optuna write after a rollback")


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
    """Renew the worker's leases; order stopped what it must not run on (lost, pruned, ...)."""
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
        else:
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


# ---------------------------------------------------------------- next trial


def next_assignment(
    session: Session,
    storage: BaseStorage,
    settings: Settings,
    worker_id: int,
    body: NextRequest,
    now: datetime,
    allowed: frozenset[str] | None = None,
) -> Assignment | None:
    """Lease the worker a trial: a re-offered one that fits its card, else a new ask; or None.

    ``allowed``: the study names the caller's token is limited to (None: every study).
    """
    worker = running_worker(session, worker_id)
    studies = _open_studies(session, worker.tasks, allowed)
    found = _offered(session, storage, worker, studies) or _ask(session, storage, studies, now)
    worker.free_bytes = body.free_bytes  # written after Optuna's ask (see the module doc)
    if found is None:
        return None
    trial, row, params = found
    lease = grant(session, trial, worker, now, settings.lease_ttl_s)
    session.flush()
    spec = spec_of(row)
    return Assignment(
        trial_id=trial.trial_id,
        number=trial.number,
        attempt=trial.attempt,
        lease=lease.token,
        lease_expires_at=lease.expires_at,
        study=row.name,
        task=row.task,
        params=params,
        task_config=spec.task_config,
        budget=spec.budget,
        memory_policy=spec.memory_policy,
        n_objectives=len(spec.objective_directions),
        minimize_peak_memory=spec.minimize_peak_memory,
        plans_tried=[
            PlanOut.model_validate(plan) for plan in plans_on(trial.plans_tried, worker.card_model)
        ],
    )


Found = tuple[TrialRow, StudyRow, dict[str, ParamValue]]


def _open_studies(
    session: Session, tasks: Sequence[str], allowed: frozenset[str] | None
) -> list[StudyRow]:
    """Unpaused studies of the tasks a worker runs, oldest first (a queue of studies)."""
    query = select(StudyRow).where(StudyRow.paused.is_(False), StudyRow.task.in_(tasks))
    if allowed is not None:
        query = query.where(StudyRow.name.in_(allowed))
    return list(session.scalars(query.order_by(StudyRow.created_at, StudyRow.study_id)))


def _offered(
    session: Session, storage: BaseStorage, worker: WorkerRow, studies: Sequence[StudyRow]
) -> Found | None:
    """A pending or waiting trial this card can hold; waiting ones (for a larger card) first."""
    if not studies:
        return None
    by_id = {row.study_id: row for row in studies}
    query = (
        select(TrialRow)
        .where(
            TrialRow.study_id.in_(by_id),
            TrialRow.status.in_(("pending", "waiting")),
            TrialRow.min_bytes <= worker.total_bytes,
            # a waiting trial is not offered back to the card that handed it back
            or_(TrialRow.status == "pending", TrialRow.worker_id != worker.id),
        )
        .order_by(case((TrialRow.status == "waiting", 0), else_=1), TrialRow.updated_at)
        .limit(1)
        .with_for_update(skip_locked=True)  # replicas take different trials, never the same
    )
    trial = session.scalar(query)
    if trial is None:
        return None
    params: dict[str, Any] = storage.get_trial(trial.trial_id).params
    return trial, by_id[trial.study_id], params


def _ask(
    session: Session, storage: BaseStorage, studies: Sequence[StudyRow], now: datetime
) -> Found | None:
    """A new trial from the first study with budget left, asked of its Optuna sampler."""
    for candidate in studies:
        # Counted first without the lock, so a spent study never serializes the fleet's asks.
        if _trials_used(session, candidate.study_id) >= spec_of(candidate).n_trials:
            continue
        row = _lock_open_study(session, candidate.study_id)
        if row is None or _trials_used(session, row.study_id) >= spec_of(row).n_trials:
            continue
        try:
            study = load_optuna_study(storage, row)
        except NotFound:  # deleted from Optuna underneath; the other studies may have work
            continue
        asked = study.ask(fixed_distributions=search_space(spec_of(row)))
        return _record_asked(session, storage, row, asked, now), row, asked.params
    return None


def _lock_open_study(session: Session, study_id: int) -> StudyRow | None:
    """The study row, locked until commit so replicas count its budget one at a time."""
    query = (
        select(StudyRow)
        .where(StudyRow.study_id == study_id, StudyRow.paused.is_(False))
        .with_for_update()
        .execution_options(populate_existing=True)
    )
    return session.scalar(query)


def _trials_used(session: Session, study_id: int) -> int:
    """Trials of the study's budget already asked (vramtune asks every trial of its studies)."""
    query = select(func.count()).select_from(TrialRow).where(TrialRow.study_id == study_id)
    return int(session.scalar(query) or 0)


def _record_asked(
    session: Session, storage: BaseStorage, row: StudyRow, asked: optuna.Trial, now: datetime
) -> TrialRow:
    """vramtune's row of a trial Optuna just created; FAILed in Optuna if it is not recorded."""
    on_rollback(session, lambda: storage.set_trial_state_values(asked._trial_id, TrialState.FAIL))
    trial = TrialRow(
        trial_id=asked._trial_id,
        study_id=row.study_id,
        number=asked.number,
        status="pending",
        attempt=0,
        min_bytes=0,
        plans_tried=[],
        updated_at=now,
    )
    session.add(trial)
    return trial
