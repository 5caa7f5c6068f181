"""The trial table (sorted, filtered and paged in SQL) and one trial in full."""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from optuna.trial import TrialState
from sqlalchemy import ColumnElement, Select, and_, func, select
from sqlalchemy.orm import Session

from vramtune.common.plans import plan_in_words, stored_plan, told_outcome
from vramtune.service.dashboard import cache, schema, series, story
from vramtune.service.dashboard.errors import invalid_query
from vramtune.service.dashboard.models import Observation, TrialDetail, TrialRowOut, TrialTable
from vramtune.service.dashboard.studies_view import (
    StudyFacts,
    infeasible,
    study_facts,
    trial_params,
)
from vramtune.service.db.tables import MemoryObservationRow, StudyRow, TrialRow, WorkerRow
from vramtune.service.errors import NotFound
from vramtune.service.fleet.leases import planning_since
from vramtune.service.studies import rank_peaks, study_state
from vramtune.service.wire import PlanOut

T, V, P = schema.trials, schema.values, schema.params
SORT_COLUMNS = (
    "number",
    "state",
    "value",
    "duration",
    "predicted",
    "measured",
    "worker",
    "attempt",
    "outcome",
)
PARAM_SORT_PREFIX = "param:"
VALUE_SORT = re.compile(r"value:(\d{1,2})")  # objective i of a multi-objective study
Order = Literal["asc", "desc"]
WaitingNote = Callable[[StudyRow | None], str | None] | None
WAITING = ("pending", "waiting")  # vramtune statuses of trials that wait for a worker


@dataclass(frozen=True)
class TableQuery:
    """What the table shows: a sort, filters and a page."""

    sort: str = "number"
    order: Order = "asc"
    states: Sequence[TrialState] = ()
    outcomes: Sequence[str] = ()
    worker: str | None = None
    offset: int = 0
    limit: int = 50

    def key(self) -> tuple[object, ...]:
        """A hashable form, for the revision cache."""
        page = (self.sort, self.order, self.worker, self.offset, self.limit)
        return ("table", *page, tuple(s.name for s in self.states), tuple(self.outcomes))


def trial_table(
    session: Session, name: str, query: TableQuery, waiting_note: WaitingNote = None
) -> TrialTable:
    """One page of the study's trials, sorted and filtered in the database.

    ``waiting_note``: why trials that wait do not run (no live worker offers the task); read
    per visit, since workers come and go without the study changing its revision.
    """
    check_sort(query.sort)
    # Counted only for the note: whether the study is done.
    facts = study_facts(session, name, counted=waiting_note is not None)
    table = cache.by_revision(
        session, facts.study_id, query.key(), lambda: _table(session, facts, query)
    )
    table = _with_planning(session, table)
    # A done study's trials were all told: nothing of it waits (issue 43). A running one's
    # trials wait, or will be created only when a worker offering its task asks.
    note = waiting_note(facts.row) if waiting_note and not _done(facts) else None
    if note is None:
        return table
    rows = [r.model_copy(update={"note": note}) if r.waiting else r for r in table.rows]
    return table.model_copy(update={"rows": rows, "note": note})


def _done(facts: StudyFacts) -> bool:
    return facts.row is not None and study_state(facts.row, facts.counts) == "done"


def _with_planning(session: Session, table: TrialTable) -> TrialTable:
    """The page's running trials that a worker is planning, read per visit: a lease and its
    start change no revision the cached table is keyed by."""
    running = [r.id for r in table.rows if r.state == TrialState.RUNNING.name]
    since = planning_since(session, running)
    if not since:
        return table
    rows = [
        r.model_copy(update={"planning_since": schema.aware(since[r.id])}) if r.id in since else r
        for r in table.rows
    ]
    return table.model_copy(update={"rows": rows})


def _table(session: Session, facts: StudyFacts, query: TableQuery) -> TrialTable:
    v0 = V.alias("v0")
    base = _filtered(_joined(select(T.c.trial_id), v0), facts.study_id, query)
    total = session.scalar(select(func.count()).select_from(base.subquery())) or 0
    duration = schema.duration_seconds(session)
    page_query = _filtered(_joined(_row_columns(duration), v0), facts.study_id, query)
    page_query = _sorted(page_query, query, v0, duration)
    rows = list(session.execute(page_query.offset(query.offset).limit(query.limit)))
    return TrialTable(
        total=total,
        offset=query.offset,
        limit=query.limit,
        sort=query.sort,
        order=query.order,
        rows=_rows_out(session, rows, infeasible(session, facts)),
        workers=_study_workers(session, facts.study_id),
        outcomes=_study_outcomes(session, facts.study_id),
    )


def _row_columns(duration: ColumnElement[Any]) -> Select[Any]:
    return select(
        T.c.trial_id,
        T.c.number,
        T.c.state,
        T.c.datetime_start,
        T.c.datetime_complete,
        duration.label("duration_s"),
        TrialRow.outcome,
        TrialRow.status.label("vt_status"),
        TrialRow.min_bytes,
        TrialRow.attempt,
        TrialRow.plan,
        TrialRow.predicted_peak_bytes,
        TrialRow.measured_peak_bytes,
        WorkerRow.name.label("worker"),
        WorkerRow.card_model,
    )


def _joined(query: Select[Any], v0: Any) -> Select[Any]:
    """Optuna's trial, its first objective, vramtune's record and its worker, side by side."""
    return (
        query.select_from(T)
        .outerjoin(v0, and_(v0.c.trial_id == T.c.trial_id, v0.c.objective == 0))
        .outerjoin(TrialRow, TrialRow.trial_id == T.c.trial_id)
        .outerjoin(WorkerRow, WorkerRow.id == TrialRow.worker_id)
    )


def _filtered(query: Select[Any], study_id: int, table: TableQuery) -> Select[Any]:
    query = query.where(T.c.study_id == study_id)
    if table.states:
        query = query.where(T.c.state.in_(list(table.states)))
    if table.outcomes:
        named = [o for o in table.outcomes if o != "none"]
        condition: ColumnElement[bool] = TrialRow.outcome.in_(named)
        if "none" in table.outcomes:
            condition = condition | TrialRow.outcome.is_(None)
        query = query.where(condition)
    if table.worker:
        query = query.where(WorkerRow.name == table.worker)
    return query


def _sorted(
    query: Select[Any], table: TableQuery, v0: Any, duration: ColumnElement[Any]
) -> Select[Any]:
    """The query ordered by the table's sort key (nulls last), then by trial number."""
    if table.sort.startswith(PARAM_SORT_PREFIX):
        sort_param = P.alias("sort_param")
        pname = table.sort[len(PARAM_SORT_PREFIX) :]
        query = query.outerjoin(
            sort_param,
            and_(sort_param.c.trial_id == T.c.trial_id, sort_param.c.param_name == pname),
        )
        column: ColumnElement[Any] = sort_param.c.param_value
    elif found := VALUE_SORT.fullmatch(table.sort):
        sort_value = V.alias("sort_value")
        query = query.outerjoin(
            sort_value,
            and_(
                sort_value.c.trial_id == T.c.trial_id,
                sort_value.c.objective == int(found.group(1)),
            ),
        )
        column = sort_value.c.value
    else:
        column = _sort_columns(v0, duration)[table.sort]
    ordered = column.asc() if table.order == "asc" else column.desc()
    tiebreak = T.c.number.asc() if table.order == "asc" else T.c.number.desc()
    return query.order_by(ordered.nulls_last(), tiebreak)


def _sort_columns(v0: Any, duration: ColumnElement[Any]) -> dict[str, ColumnElement[Any]]:
    return {
        "number": T.c.number,
        "state": T.c.state,
        "value": v0.c.value,
        "duration": duration,
        "predicted": TrialRow.predicted_peak_bytes,
        "measured": TrialRow.measured_peak_bytes,
        "worker": WorkerRow.name,
        "attempt": TrialRow.attempt,
        "outcome": TrialRow.outcome,
    }


def check_sort(sort: str) -> str:
    """The sort key if the table knows it, else a 422 naming the field."""
    if (
        sort in SORT_COLUMNS
        or VALUE_SORT.fullmatch(sort)
        or (sort.startswith(PARAM_SORT_PREFIX) and len(sort) > len(PARAM_SORT_PREFIX))
    ):
        return sort
    columns = ", ".join(SORT_COLUMNS)
    raise invalid_query("sort", f"sort by one of {columns}, value:<i> or param:<name>", sort)


def _rows_out(session: Session, rows: list[Any], infeasible: set[int]) -> list[TrialRowOut]:
    ids = [r.trial_id for r in rows]
    params = trial_params(session, ids)
    values = _all_values(session, ids)
    return [
        TrialRowOut(
            id=r.trial_id,
            number=r.number,
            state=r.state.name,
            values=values.get(r.trial_id),
            feasible=r.trial_id not in infeasible,
            params=params[r.trial_id],
            outcome=r.outcome,
            told_outcome=told_outcome(r.outcome, r.plan, handed_back=(r.min_bytes or 0) > 0),
            attempt=r.attempt or 0,
            plan=plan_out(r.plan),
            plan_words=plan_in_words(plan_out(r.plan)),
            predicted_bytes=r.predicted_peak_bytes,
            measured_bytes=r.measured_peak_bytes,
            worker=r.worker,
            card_model=r.card_model,
            datetime_start=schema.aware(r.datetime_start),
            datetime_complete=schema.aware(r.datetime_complete),
            # The duration the table sorts by, from SQL: in Python it would differ below SQLite's
            # millisecond date precision, and a page could look out of order.
            duration_s=None if r.duration_s is None else float(r.duration_s),
            waiting=r.vt_status in WAITING,
        )
        for r in rows
    ]


def _all_values(session: Session, trial_ids: list[int]) -> dict[int, list[float]]:
    """Every objective value of the given trials, in objective order."""
    found: dict[int, list[float]] = defaultdict(list)
    if trial_ids:
        for tid, value, vtype in session.execute(
            select(V.c.trial_id, V.c.value, V.c.value_type)
            .where(V.c.trial_id.in_(trial_ids))
            .order_by(V.c.trial_id, V.c.objective)
        ):
            found[tid].append(schema.stored_value(value, vtype))
    return dict(found)


def plan_out(plan: dict[str, Any] | None) -> PlanOut | None:
    """A stored plan as the wire shows it (unknown keys dropped); {} is "as asked"."""
    return None if plan is None else stored_plan(plan)


def _study_workers(session: Session, study_id: int) -> list[str]:
    query = (
        select(WorkerRow.name)
        .join(TrialRow, TrialRow.worker_id == WorkerRow.id)
        .where(TrialRow.study_id == study_id)
        .distinct()
        .order_by(WorkerRow.name)
    )
    return list(session.scalars(query))


def _study_outcomes(session: Session, study_id: int) -> list[str]:
    query = (
        select(TrialRow.outcome)
        .where(TrialRow.study_id == study_id, TrialRow.outcome.is_not(None))
        .distinct()
        .order_by(TrialRow.outcome)
    )
    return [o for o in session.scalars(query) if o is not None]


# ---------------------------------------------------------------- one trial


def trial_detail(session: Session, name: str, number: int, max_points: int) -> TrialDetail:
    """One trial: the table's row plus its intermediate curve, message, plans and runs."""
    facts = study_facts(session, name)
    v0 = V.alias("v0")
    query = _joined(_row_columns(schema.duration_seconds(session)), v0).where(
        T.c.study_id == facts.study_id, T.c.number == number
    )
    found = session.execute(query).first()
    if found is None:
        raise NotFound(f"study {name!r} has no trial {number}")
    row = _rows_out(session, [found], infeasible(session, facts))[0]
    steps, values = _intermediate(session, found.trial_id)
    kept = series.extremes([v if math.isfinite(v) else 0.0 for v in values], max_points)
    record = session.get(TrialRow, found.trial_id)
    attrs = _user_attrs(session, found.trial_id)
    return TrialDetail(
        **row.model_dump(),
        intermediate_steps=[steps[i] for i in kept],
        intermediate_values=[values[i] for i in kept],
        intermediate_total=len(steps),
        message=record.message if record else None,
        plans_tried=[p for p in (plan_out(p) for p in (record.plans_tried if record else [])) if p],
        planning_s=attrs.get("vramtune.planning_s"),
        prediction_source=attrs.get("vramtune.prediction_source"),
        user_attrs=attrs,
        rank_peak_bytes=rank_peaks(attrs.get("vramtune.measured")),
        observations=_observations(session, found.trial_id, found.datetime_start),
        events=story.trial_events(session, found.trial_id, found.datetime_start),
    )


def _intermediate(session: Session, trial_id: int) -> tuple[list[int], list[float]]:
    IV = schema.intermediate
    rows = list(
        session.execute(
            select(IV.c.step, IV.c.intermediate_value, IV.c.intermediate_value_type)
            .where(IV.c.trial_id == trial_id)
            .order_by(IV.c.step)
        )
    )
    steps = [step for step, _, _ in rows]
    values = [schema.stored_value(v, t) for _, v, t in rows]
    return steps, values


def _user_attrs(session: Session, trial_id: int) -> dict[str, Any]:
    A = schema.trial_user_attrs
    rows = session.execute(select(A.c.key, A.c.value_json).where(A.c.trial_id == trial_id))
    return {key: json.loads(value) for key, value in rows}


def _observations(session: Session, trial_id: int, since: datetime | None) -> list[Observation]:
    """The trial's runs. Observations outlive a deleted study (the calibration's history), and
    SQLite reuses a deleted trial's id: only those since the trial began are this trial's."""
    OBS = MemoryObservationRow
    query = select(OBS).where(OBS.trial_id == trial_id).order_by(OBS.id)
    rows = session.scalars(query if since is None else query.where(OBS.created_at >= since))
    return [
        Observation(
            card_model=o.card_model,
            outcome=o.outcome,
            plan=plan_out(o.plan),
            predicted_allocated=o.predicted_allocated,
            measured_allocated=o.measured_allocated,
            measured_reserved=o.measured_reserved,
            created_at=schema.utc(o.created_at),
        )
        for o in rows
    ]
