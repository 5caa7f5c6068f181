"""Study use cases over Optuna's storage and vramtune's tables; helpers never commit."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from contextlib import suppress
from datetime import datetime
from typing import Any

import optuna
from optuna.storages import BaseStorage
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState
from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from vramtune.common.plans import told_outcome
from vramtune.common.task_rules import study_problem
from vramtune.service.auth.audit import AuditEvent
from vramtune.service.auth.tokens import audited
from vramtune.service.db.tables import StudyRow, TrialRow, WorkerRow
from vramtune.service.errors import Conflict, Invalid, NotFound
from vramtune.service.fleet import trust
from vramtune.service.fleet.leases import end_study_leases, planning_since
from vramtune.service.fleet.offers import check_batch_param
from vramtune.service.optuna.glue import (
    SEARCH_SPACE_ATTR,
    TASK_ATTR,
    check_space_size,
    forget_study,
    make_pruner,
    make_sampler,
    search_space,
    search_space_json,
    spec_of,
)
from vramtune.service.principal import Principal
from vramtune.service.settings import Settings
from vramtune.service.wire import (
    CategoricalParam,
    ParetoFront,
    PlanOut,
    StudyCreate,
    StudyState,
    StudySummary,
    TrialOut,
    TrialPage,
)

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)


def get_row(session: Session, name: str) -> StudyRow:
    """The study row by name; NotFound if there is none."""
    row = session.scalar(select(StudyRow).where(StudyRow.name == name))
    if row is None:
        raise NotFound(f"study {name!r} not found")
    return row


# ---------------------------------------------------------------- create


def create_study(
    session: Session,
    storage: BaseStorage,
    spec: StudyCreate,
    now: datetime,
    max_points: int = Settings.model_fields["max_search_space_points"].default,
) -> StudyRow:
    """Validate the spec, create the Optuna study and the vramtune row, or neither.

    ``max_points``: Settings.max_search_space_points (service.optuna.glue.check_space_size).
    """
    check_space_size(spec, max_points)
    space = search_space(spec)
    check_task(spec)
    check_batch_param(session, spec.task, spec.search_space, spec.task_config)
    make_sampler(spec)  # built now only to reject bad names and arguments with a 422
    make_pruner(spec.pruner)
    if session.scalar(select(StudyRow.study_id).where(StudyRow.name == spec.name)) is not None:
        raise Conflict(f"study {spec.name!r} already exists")
    directions = [StudyDirection[d.upper()] for d in spec.objective_directions]
    try:
        study_id = storage.create_new_study(directions, spec.name)
    except optuna.exceptions.DuplicatedStudyError as exc:
        raise Conflict(f"study name {spec.name!r} is taken in the Optuna storage") from exc
    try:
        storage.set_study_user_attr(study_id, SEARCH_SPACE_ATTR, search_space_json(space))
        storage.set_study_user_attr(study_id, TASK_ATTR, spec.task)
        row = StudyRow(
            study_id=study_id,
            name=spec.name,
            task=spec.task,
            spec=spec.model_dump(mode="json"),
            paused=False,
            created_at=now,
        )
        session.add(row)
        session.flush()
    except BaseException:
        # Undo the Optuna study; roll back first so SQLite's write lock is released.
        session.rollback()
        storage.delete_study(study_id)
        raise
    return row


def check_task(spec: StudyCreate) -> None:
    """422 for a built-in model family's settings that no worker could build (task_rules)."""
    choices = {
        name: param.choices
        for name, param in spec.search_space.items()
        if isinstance(param, CategoricalParam)
    }
    problem = study_problem(spec.task, spec.task_config, choices)
    if problem is not None:
        raise Invalid(*problem)


# ---------------------------------------------------------------- read


def study_state(row: StudyRow, counts: dict[str, int]) -> StudyState:
    """done once the budget of finished trials is spent; else paused or running."""
    finished = sum(counts.get(state.name, 0) for state in FINISHED)
    if finished >= spec_of(row).n_trials:
        return "done"
    return "paused" if row.paused else "running"


def trial_counts(trials: Iterable[FrozenTrial]) -> dict[str, int]:
    """Trials by TrialState name, every state present (zero when none)."""
    counted = Counter(trial.state.name for trial in trials)
    return {state.name: counted.get(state.name, 0) for state in TrialState}


def best_trials(study: optuna.Study) -> list[FrozenTrial]:
    """The best feasible trial of a single-objective study, else its Pareto front."""
    if len(study.directions) > 1:
        return study.best_trials
    try:
        return [study.best_trial]
    except ValueError:  # no completed (feasible) trial yet
        return []


def summarize(storage: BaseStorage, row: StudyRow) -> StudySummary:
    """The study as listed: spec, state, counts per TrialState and best value."""
    study = optuna.load_study(study_name=row.name, storage=storage)
    counts = trial_counts(study.get_trials(deepcopy=False))
    best = best_trials(study)
    single = len(study.directions) == 1
    return StudySummary(
        id=row.study_id,
        name=row.name,
        task=row.task,
        state=study_state(row, counts),
        directions=[d.name.lower() for d in study.directions],
        n_trials=spec_of(row).n_trials,
        counts=counts,
        best_value=best[0].value if single and best else None,
        created_at=row.created_at,
        spec=spec_of(row),
    )


def get_summary(session: Session, storage: BaseStorage, name: str) -> StudySummary:
    """One study's summary; NotFound if missing from either vramtune or Optuna."""
    row = get_row(session, name)
    try:
        return summarize(storage, row)
    except KeyError as exc:
        raise NotFound(f"study {name!r} is not in the Optuna storage") from exc


def list_summaries(session: Session, storage: BaseStorage) -> list[StudySummary]:
    """Every vramtune study, oldest first (skipping one deleted from Optuna underneath)."""
    summaries = []
    for row in session.scalars(select(StudyRow).order_by(StudyRow.study_id)):
        try:
            summaries.append(summarize(storage, row))
        except KeyError:
            continue
    return summaries


# ---------------------------------------------------------------- trials


def _plan(plan: dict[str, object] | None) -> PlanOut | None:
    if plan is None:
        return None
    return PlanOut.model_validate({k: v for k, v in plan.items() if k in PlanOut.model_fields})


def rank_peaks(measured: object) -> list[int] | None:
    """Each rank's measured peak of a distributed run, from the stored `Measured`."""
    peaks = measured.get("rank_peak_bytes") if isinstance(measured, dict) else None
    return [int(peak) for peak in peaks] if isinstance(peaks, list) else None


def _duration(trial: FrozenTrial) -> float | None:
    if trial.datetime_start is None or trial.datetime_complete is None:
        return None
    return (trial.datetime_complete - trial.datetime_start).total_seconds()


def trial_out(
    trial: FrozenTrial,
    row: TrialRow | None,
    worker: WorkerRow | None,
    planning_since: datetime | None = None,
) -> TrialOut:
    """One trial as Optuna and vramtune know it (`planning_since`: its worker leased it then
    and is choosing its plan)."""
    # Every terminal path writes the ``vramtune.*`` user attributes with Optuna's state: they
    # stand in for a row that is missing or ahead of Optuna's snapshot (trials_out).
    attrs = trial.user_attrs

    def known(column: str) -> Any:
        value = getattr(row, column) if row is not None else None
        return attrs.get(f"vramtune.{column}") if value is None else value

    plan = known("plan")
    return TrialOut(
        id=trial._trial_id,
        number=trial.number,
        state=trial.state.name,
        # An infeasible trial's values are placeholders (service.fleet.routing), not results.
        values=None if attrs.get("vramtune.placeholder_values") else trial.values,
        params=trial.params,
        intermediate=dict(trial.intermediate_values),
        datetime_start=trial.datetime_start,
        datetime_complete=trial.datetime_complete,
        duration_s=_duration(trial),
        attempt=row.attempt if row else attrs.get("vramtune.attempt", 0),
        plan=_plan(plan) if plan else None,
        worker=worker.name if worker else attrs.get("vramtune.worker"),
        card_model=worker.card_model if worker else attrs.get("vramtune.card_model"),
        predicted_peak_bytes=known("predicted_peak_bytes"),
        measured_peak_bytes=known("measured_peak_bytes"),
        rank_peak_bytes=rank_peaks(attrs.get("vramtune.measured")),
        outcome=known("outcome"),
        told_outcome=told_outcome(
            known("outcome"), plan, handed_back=row is not None and row.min_bytes > 0
        ),
        planning_s=attrs.get("vramtune.planning_s"),
        planning_since=planning_since,
        prediction_source=attrs.get("vramtune.prediction_source"),
        user_attrs=attrs,
    )


def trials_out(session: Session, trials: Sequence[FrozenTrial]) -> list[TrialOut]:
    """Trials joined with vramtune's rows and the workers that ran them."""
    ids = [trial._trial_id for trial in trials]
    rows = {
        r.trial_id: r for r in session.scalars(select(TrialRow).where(TrialRow.trial_id.in_(ids)))
    }
    worker_ids = {r.worker_id for r in rows.values() if r.worker_id is not None}
    workers = {
        w.id: w for w in session.scalars(select(WorkerRow).where(WorkerRow.id.in_(worker_ids)))
    }
    planning = planning_since(session, [t._trial_id for t in trials if not t.state.is_finished()])
    out = []
    for trial in trials:
        row = rows.get(trial._trial_id)
        if row is not None and row.status == "done" and not trial.state.is_finished():
            # Told since Optuna's snapshot of it was read (vramtune's rows are read after it):
            # the trial reads as that snapshot has it, its vramtune.* attributes with it (every
            # tell writes them with the state), not with an end its state does not show yet.
            row = None
        worker = workers.get(row.worker_id) if row and row.worker_id is not None else None
        out.append(trial_out(trial, row, worker, planning.get(trial._trial_id)))
    return out


def trial_page(
    session: Session,
    storage: BaseStorage,
    name: str,
    states: Sequence[TrialState] | None,
    offset: int,
    limit: int,
) -> TrialPage:
    """Trials of a study in number order, filtered by state, one page of them."""
    row = get_row(session, name)
    trials = storage.get_all_trials(row.study_id, deepcopy=False, states=states)
    page = sorted(trials, key=lambda t: t.number)[offset : offset + limit]
    return TrialPage(
        trials=trials_out(session, page), total=len(trials), offset=offset, limit=limit
    )


def best(session: Session, storage: BaseStorage, name: str) -> ParetoFront:
    """The best trial, or the Pareto front of a multi-objective study."""
    row = get_row(session, name)
    study = optuna.load_study(study_name=row.name, storage=storage)
    return ParetoFront(trials=trials_out(session, best_trials(study)))


# ---------------------------------------------------------------- pause, resume, delete


def set_paused(
    session: Session, name: str, paused: bool, now: datetime, by: Principal | None = None
) -> StudyRow:
    """Pause (no new trials are handed out) or resume a study; audited as done ``by``."""
    row = get_row(session, name)
    was = row.paused
    row.paused = paused
    session.flush()
    event: AuditEvent = "study_paused" if paused else "study_resumed"
    audited(session, event, by, f"study {name}", now, study_id=row.study_id, changed=was != paused)
    return row


def delete_study(
    session: Session, storage: BaseStorage, name: str, now: datetime, by: Principal | None = None
) -> None:
    """Delete the Optuna study, then vramtune's rows of it and the knowledge only it used
    (the fleet's memory observations and predictions are kept)."""
    row = get_row(session, name)
    # Optuna first: on SQLite its write must not wait behind our session's lock. Already gone
    # from Optuna is fine; our rows are removed still.
    with suppress(KeyError):
        storage.delete_study(row.study_id)
    forget_study(storage, row.study_id)
    audited(
        session, "study_deleted", by, f"study {name}", now, study_id=row.study_id, task=row.task
    )
    # Leases are ended, not deleted: the next heartbeat orders their workers to stop.
    end_study_leases(session, row.study_id, now)
    session.execute(delete(TrialRow).where(TrialRow.study_id == row.study_id))
    # Its own knowledge goes with it (the fleet's stays): SQLite reuses the id (issue 47).
    trust.forget_study_knowledge(session, row)
    session.delete(row)
    session.flush()
