"""Fleet use cases: workers register, heartbeat, pull trials and leave; helpers never commit.

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

from optuna.trial import FrozenTrial
from sqlalchemy import case, func, or_, select
from sqlalchemy.orm import Session

from service.api.errors import Conflict, NotFound
from service.db.engine import is_sqlite
from service.db.tables import LeaseRow, StudyRow, TrialRow, WorkerRow
from service.fleet.leases import active_leases, end, ended_since, grant, renew, resolution
from service.fleet.routing import plans_on, reoffer
from service.optuna import rows as optuna_rows
from service.optuna.drafts import draft_trial
from service.optuna.glue import asked_trial, spec_of, strategy
from service.settings import Settings
from service.state import AppState
from service.wire import (
    Assignment,
    CardInfo,
    Heartbeat,
    HeartbeatReply,
    NextRequest,
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

# Samplers that draw without reading the study's trials (random, quasi-Monte Carlo) lose
# nothing when trials are asked ahead of the workers: one transaction asks several, and the
# extra ones wait as pending trials (RUNNING in Optuna) for the next calls. As many as half
# the workers running the study's trials now, at most ASK_AHEAD_MAX: a lone worker asks one
# at a time. The other samplers see each result before they propose again: one at a time.
ASK_AHEAD_SAMPLERS = frozenset({"random", "qmc"})
ASK_AHEAD_MAX = 8


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


# ---------------------------------------------------------------- next trial


def next_assignment(
    state: AppState,
    worker_id: int,
    body: NextRequest,
    now: datetime,
    allowed: frozenset[str] | None = None,
) -> Assignment | None:
    """Lease the worker a trial: a re-offered one that fits its card, else a new ask; or None.

    ``allowed``: the study names the caller's token is limited to (None: every study). The
    sampler runs between two transactions, holding neither a lock nor a connection.
    """
    with fleet_transaction(state) as session:
        worker = running_worker(session, worker_id)
        worker.free_bytes = body.free_bytes
        studies = _open_studies(session, worker.tasks, allowed)
        offered = _offered(session, worker, studies)
        if offered is not None:
            return _lease(session, state, offered, worker, now)
        askable = [
            (row, optuna_rows.count_trials(session, row.study_id), _ask_count(session, row, left))
            for row, left in _budgets_left(session, studies)
        ]
    for row, number, count in askable:
        how = strategy(state.storage, row)
        try:
            drafts = [
                draft_trial(
                    state.storage, row.study_id, row.name, how.sampler, how.space, number + i
                )
                for i in range(count)
            ]
        except KeyError:  # deleted from Optuna underneath; the other studies may have work
            continue
        with fleet_transaction(state) as session:
            asked = _record_asked(session, row.study_id, drafts, now)
            if asked:
                return _lease(session, state, asked[0], running_worker(session, worker_id), now)
    return None


def _lease(
    session: Session, state: AppState, trial: TrialRow, worker: WorkerRow, now: datetime
) -> Assignment:
    """Grant the worker a lease on the trial; the assignment it is answered with."""
    row = session.get_one(StudyRow, trial.study_id)
    lease = grant(session, trial, worker, now, state.settings.lease_ttl_s)
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
        params=asked_trial(state.storage, row, trial).params,
        task_config=spec.task_config,
        budget=spec.budget,
        memory_policy=spec.memory_policy,
        n_objectives=len(spec.objective_directions),
        minimize_peak_memory=spec.minimize_peak_memory,
        plans_tried=[
            PlanOut.model_validate(plan) for plan in plans_on(trial.plans_tried, worker.card_model)
        ],
    )


def _open_studies(
    session: Session, tasks: Sequence[str], allowed: frozenset[str] | None
) -> list[StudyRow]:
    """Unpaused studies of the tasks a worker runs, oldest first (a queue of studies)."""
    query = select(StudyRow).where(StudyRow.paused.is_(False), StudyRow.task.in_(tasks))
    if allowed is not None:
        query = query.where(StudyRow.name.in_(allowed))
    return list(session.scalars(query.order_by(StudyRow.created_at, StudyRow.study_id)))


def _offered(session: Session, worker: WorkerRow, studies: Sequence[StudyRow]) -> TrialRow | None:
    """A pending or waiting trial this card can hold; waiting ones (for a larger card) first."""
    if not studies:
        return None
    query = (
        select(TrialRow)
        .where(
            TrialRow.study_id.in_([row.study_id for row in studies]),
            TrialRow.status.in_(("pending", "waiting")),
            TrialRow.min_bytes <= worker.total_bytes,
            # a waiting trial is not offered back to the card that handed it back
            or_(TrialRow.status == "pending", TrialRow.worker_id != worker.id),
        )
        .order_by(
            case((TrialRow.status == "waiting", 0), else_=1), TrialRow.updated_at, TrialRow.trial_id
        )
        .limit(1)
        .with_for_update(skip_locked=True)  # replicas take different trials, never the same
    )
    return session.scalar(query)


def _budgets_left(session: Session, studies: Sequence[StudyRow]) -> list[tuple[StudyRow, int]]:
    """The studies that have trials of their budget left to ask, with how many."""
    lefts = [(row, _budget_left(session, row)) for row in studies]
    return [(row, left) for row, left in lefts if left > 0]


def _budget_left(session: Session, row: StudyRow) -> int:
    """Trials of the study's budget not asked yet (vramtune asks every trial of its studies)."""
    used = select(func.count()).select_from(TrialRow).where(TrialRow.study_id == row.study_id)
    return spec_of(row).n_trials - int(session.scalar(used) or 0)


def _ask_count(session: Session, row: StudyRow, left: int) -> int:
    """How many trials to ask in one go (see ASK_AHEAD_SAMPLERS), within the budget left."""
    if spec_of(row).sampler.name not in ASK_AHEAD_SAMPLERS:
        return 1
    running = select(func.count()).where(
        TrialRow.study_id == row.study_id, TrialRow.status == "leased"
    )
    return max(1, min(left, ASK_AHEAD_MAX, int(session.scalar(running) or 0) // 2))


def _record_asked(
    session: Session, study_id: int, drafts: Sequence[FrozenTrial], now: datetime
) -> list[TrialRow]:
    """Insert drafted trials, Optuna's rows and vramtune's, as far as the budget still allows.

    Optuna's study row is locked until commit: replicas number and count one ask at a time,
    for the few statements of the insert only (the sampler ran before). The trials are
    pending: the caller leases the first, the next calls are offered the others.
    """
    row = session.scalar(
        select(StudyRow).where(StudyRow.study_id == study_id, StudyRow.paused.is_(False))
    )
    if row is None or not optuna_rows.lock_study(session, study_id):
        return []  # paused or deleted meanwhile
    asked = optuna_rows.insert_trials(
        session, study_id, drafts[: max(_budget_left(session, row), 0)], now
    )
    trials = [
        TrialRow(
            trial_id=trial._trial_id,
            study_id=study_id,
            number=trial.number,
            status="pending",
            attempt=0,
            min_bytes=0,
            params=trial.params,
            plans_tried=[],
            updated_at=now,
        )
        for trial in asked
    ]
    session.add_all(trials)
    return trials
