"""Dispatch: which trial a worker that asks for work gets, and its lease; helpers never commit.

A trial that waits for a card of this size is offered first; else the study's sampler is asked
(on an in-memory draft, service.optuna.drafts) and the new trial is written with its lease in
one ``fleet_transaction`` (service.fleet.workers).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from datetime import datetime

from optuna.trial import FrozenTrial
from sqlalchemy import case, func, or_, select
from sqlalchemy.orm import Session

from service.db.tables import StudyRow, TrialRow, WorkerRow
from service.fleet import predictions
from service.fleet.leases import grant
from service.fleet.routing import live_capacity, plans_on
from service.fleet.workers import fleet_transaction, running_worker
from service.optuna import rows as optuna_rows
from service.optuna.drafts import Turn, draft_trials, one_batch_at_a_time
from service.optuna.glue import asked_trial, spec_of, strategy
from service.state import AppState
from service.wire import Assignment, NextRequest, PlanOut

# Samplers asked ahead of the workers: one transaction asks several, and the extra ones wait
# as pending trials (RUNNING in Optuna) for the next calls. As many as half the workers running
# the study's trials now, at most ASK_AHEAD_MAX: a lone worker asks one at a time. Random and
# quasi-Monte Carlo lose nothing (they do not read the study's trials); TPE's batch shares one
# Parzen fit on the history as the batch began (service.optuna.tpe: its drafts are not lied
# about to each other, trials asked before are, constant liar). The other samplers see each
# result before they propose again: one at a time.
ASK_AHEAD_SAMPLERS = frozenset({"random", "qmc", "tpe"})
ASK_AHEAD_MAX = 8
# Samplers whose batch is costly: one batch of a study at a time per process; the asks that
# waited for it take its trials (service.optuna.drafts.one_batch_at_a_time).
ONE_BATCH_SAMPLERS = frozenset({"tpe"})


def next_assignment(
    state: AppState,
    worker_id: int,
    body: NextRequest,
    now: datetime,
    allowed: frozenset[str] | None = None,
    token_id: int | None = None,
) -> Assignment | None:
    """Lease the worker a trial: a re-offered one that fits its card, else a new ask; or None.

    ``allowed``: the study names the caller's token is limited to (None: every study);
    ``token_id``: the caller's token, which must be the worker's. The sampler runs between
    two transactions, holding neither a lock nor a connection.
    """
    with fleet_transaction(state) as session:
        worker = running_worker(session, worker_id, token_id)
        worker.free_bytes = body.free_bytes
        studies = _open_studies(session, worker.tasks, allowed)
        offered = _offered(session, worker, studies)
        if offered is not None:
            return _lease(session, state, offered, worker, now)
        askable = [
            (
                row,
                optuna_rows.count_trials(session, row.study_id),
                _ask_count(session, row, left),
                left,
            )
            for row, left in _budgets_left(session, studies)
        ]
    for row, number, count, left in askable:
        with _batching(state, row) as turn:
            # one that waited for another batch first takes a trial of it, drafting none;
            # a batch is drafted for the asks queued behind it too
            count = min(max(count, turn.queued + 1), ASK_AHEAD_MAX, left)
            for size in (0, count) if turn.waited else (count,):
                try:
                    assignment = _ask_and_lease(state, worker_id, row, number, size, now)
                except KeyError:  # deleted from Optuna underneath; other studies may have work
                    break
                if assignment is not None:
                    return assignment
    return None


def _batching(state: AppState, row: StudyRow) -> AbstractContextManager[Turn]:
    """One batch at a time for ONE_BATCH_SAMPLERS (first come, first served), else no wait."""
    if spec_of(row).sampler.name in ONE_BATCH_SAMPLERS:
        return one_batch_at_a_time(state.storage, row.study_id)
    return nullcontext(Turn(waited=False, queued=0))


def _ask_and_lease(
    state: AppState, worker_id: int, row: StudyRow, number: int, count: int, now: datetime
) -> Assignment | None:
    """Draft ``count`` trials (none: only take one inserted meanwhile), lease the first."""
    how = strategy(state.storage, row)
    drafts = (
        draft_trials(state.storage, row.study_id, row.name, how.sampler, how.space, number, count)
        if count
        else []
    )
    with fleet_transaction(state) as session:
        worker = running_worker(session, worker_id)
        asked = _record_asked(session, worker, row.study_id, drafts, now)
        return _lease(session, state, asked[0], worker, now) if asked else None


def _lease(
    session: Session, state: AppState, trial: TrialRow, worker: WorkerRow, now: datetime
) -> Assignment:
    """Grant the worker a lease on the trial; the assignment it is answered with."""
    row = session.get_one(StudyRow, trial.study_id)
    lease = grant(session, trial, worker, now, state.settings.lease_ttl_s)
    session.flush()
    spec = spec_of(row)
    params = asked_trial(state.storage, row, trial).params
    config = {**spec.task_config, **params}
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
        predictions=predictions.shared_for(session, worker, row.task, config),
        larger_card_bytes=_larger_card(session, state, worker, row.task, now),
    )


def _larger_card(
    session: Session, state: AppState, worker: WorkerRow, task: str, now: datetime
) -> int | None:
    """The largest live card of another worker for `task`, when larger than this worker's
    (worker/time_routing.py hands a slow resize back to it)."""
    stale_s = state.settings.worker_stale_s
    largest = live_capacity(session, task, now, stale_s, exclude=worker.id)
    return largest if largest > worker.total_bytes else None


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
    session: Session,
    worker: WorkerRow,
    study_id: int,
    drafts: Sequence[FrozenTrial],
    now: datetime,
) -> list[TrialRow]:
    """Insert drafted trials, Optuna's rows and vramtune's, as far as the budget still allows.

    Optuna's study row is locked until commit: replicas number and count one ask at a time,
    for the few statements of the insert only (the sampler ran before). The trials are
    pending: the caller leases the first, the next calls are offered the others.

    Workers that found no pending trial together all drafted and queued on that lock; the
    first inserted trials ahead for the others. Once it holds the lock, an ask takes such a
    trial and drops its drafts (Optuna never saw them): the study is not over-asked, and the
    queue on the lock drains at the cost of one read each, not one insert each.
    """
    row = session.scalar(
        select(StudyRow).where(StudyRow.study_id == study_id, StudyRow.paused.is_(False))
    )
    if row is None or not optuna_rows.lock_study(session, study_id):
        return []  # paused or deleted meanwhile
    inserted_meanwhile = _offered(session, worker, [row])
    if inserted_meanwhile is not None:
        return [inserted_meanwhile]
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
