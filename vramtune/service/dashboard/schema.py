"""Optuna's tables (its own ORM models' tables) and the conversions every dashboard query needs.

The dashboard reads Optuna's tables with SQL instead of ``load_study``: aggregating 10,000
trials in the database takes milliseconds where building 10,000 FrozenTrials takes seconds.
Optuna's schema (version 12) is read, never written.
"""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from enum import Enum
from functools import lru_cache
from typing import Any

from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
    json_to_distribution,
)
from optuna.storages._rdb import models
from optuna.trial import TrialState
from sqlalchemy import ColumnElement, Float, and_, case, cast, extract, func, or_, select
from sqlalchemy.orm import Session

from vramtune.service.dashboard.models import ParamInfo
from vramtune.service.db.tables import LeaseRow, MemoryObservationRow, StudyRow, TrialRow, WorkerRow

# Optuna's tables, re-exported: the dashboard's queries name them as schema.<table>.
from vramtune.service.optuna.tables import (
    directions as directions,
    intermediate as intermediate,
    params as params,
    studies as studies,
    study_system_attrs as study_system_attrs,
    trial_system_attrs as trial_system_attrs,
    trial_user_attrs as trial_user_attrs,
    trials as trials,
    values as values,
)
from vramtune.service.wire import ParamValue

CONSTRAINTS_KEY = "constraints"  # optuna.study._constrained_optimization._CONSTRAINTS_KEY

# vramtune's tables as Core tables: selecting plain columns skips the ORM's per-row work.
vt_studies = StudyRow.__table__
vt_trials = TrialRow.__table__
vt_workers = WorkerRow.__table__
vt_leases = LeaseRow.__table__
vt_observations = MemoryObservationRow.__table__

FINITE = models.TrialValueModel.TrialValueType.FINITE
INF_POS = models.TrialValueModel.TrialValueType.INF_POS
INF_NEG = models.TrialValueModel.TrialValueType.INF_NEG


def utc(moment: datetime) -> datetime:
    """A stored naive-UTC datetime made explicit, so that browsers do not read it as local."""
    return moment.replace(tzinfo=UTC)


def aware(moment: datetime | None) -> datetime | None:
    """utc() of a datetime that may be missing."""
    return None if moment is None else utc(moment)


def duration_seconds(session: Session) -> ColumnElement[Any]:
    """SQL for datetime_complete - datetime_start in seconds, in this session's dialect."""
    start, end = trials.c.datetime_start, trials.c.datetime_complete
    if session.get_bind().dialect.name == "sqlite":
        return (func.julianday(end) - func.julianday(start)) * 86400.0
    return cast(extract("epoch", end - start), Float)


@lru_cache(maxsize=4096)
def distribution(distribution_json: str) -> BaseDistribution:
    """A parameter's distribution from its stored JSON (the same JSON repeats on every trial)."""
    return json_to_distribution(distribution_json)


def external(param_value: float, distribution_json: str) -> ParamValue:
    """A stored parameter value as the user sees it (a choice, an int, a float)."""
    return external_of(param_value, distribution(distribution_json))


def external_of(param_value: float, dist: BaseDistribution) -> ParamValue:
    """A stored parameter value in a known distribution as the user sees it."""
    value: ParamValue = dist.to_external_repr(param_value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def param_info(name: str, dist: BaseDistribution) -> ParamInfo:
    """Name, kind and range of a parameter."""
    if isinstance(dist, CategoricalDistribution):
        return ParamInfo(name=name, kind="categorical", choices=list(dist.choices))
    kind = "int" if isinstance(dist, IntDistribution) else "float"
    assert isinstance(dist, FloatDistribution | IntDistribution)
    return ParamInfo(name=name, kind=kind, log=dist.log, low=dist.low, high=dist.high)


def infeasible(session: Session, study_id: int) -> set[int]:
    """Trials of the study that violate a constraint (vramtune's memory constraint included).

    A trial is infeasible when any of its constraints is > 0 (Optuna keeps them as system
    attributes: ``constraints:<key>`` numbers and the older ``constraints`` list). Rows that can
    only hold values <= 0 (a leading minus) are skipped in SQL: most trials are feasible.
    """
    A = trial_system_attrs
    candidates = (
        select(A.c.trial_id, A.c.value_json)
        .join(trials, trials.c.trial_id == A.c.trial_id)
        .where(
            trials.c.study_id == study_id,
            or_(A.c.key == CONSTRAINTS_KEY, A.c.key.startswith(CONSTRAINTS_KEY + ":")),
            or_(
                and_(A.c.value_json.not_like("-%"), A.c.value_json.not_like("[-%")),
                A.c.value_json.like("%,%"),
            ),
        )
    )
    return {tid for tid, value in session.execute(candidates) if _violates(json.loads(value))}


def _violates(value: Any) -> bool:
    values = value if isinstance(value, list) else [value]
    return any(isinstance(v, int | float) and v > 0 for v in values)


def stored_value(value: float | None, value_type: Enum) -> float:
    """An objective or intermediate value as Optuna stored it: the infinities (and an
    intermediate NaN) as a type without a value; the wire says them as strings (ObjectiveValue)."""
    if value_type.name == "INF_POS":
        return math.inf
    if value_type.name == "INF_NEG":
        return -math.inf
    if value_type.name == "NAN" or value is None:  # SQLite keeps a NaN as NULL
        return math.nan
    return float(value)


def revision(session: Session, study_id: int) -> str:
    """A token that changes whenever a trial, an intermediate value or vramtune's record does."""
    trial_stats = session.execute(
        select(
            func.count(),
            func.sum(case((trials.c.state == TrialState.RUNNING, 1), else_=0)),
            func.max(trials.c.datetime_complete),
            func.max(trials.c.trial_id),
        ).where(trials.c.study_id == study_id)
    ).one()
    IV = intermediate
    reports = session.scalar(
        select(func.count())
        .select_from(IV)
        .join(trials, trials.c.trial_id == IV.c.trial_id)
        .where(trials.c.study_id == study_id, trials.c.state == TrialState.RUNNING)
    )
    vt = session.execute(
        select(func.count(), func.max(vt_trials.c.updated_at)).where(
            vt_trials.c.study_id == study_id
        )
    ).one()
    parts = [*trial_stats, reports, *vt]
    return "-".join("" if p is None else str(p) for p in parts)
