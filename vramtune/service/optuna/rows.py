"""Optuna's rows of a trial, written in vramtune's own transaction.

Optuna's RDBStorage commits once per write (create, each parameter, each attribute, the
values, the state): a trial cost ~95 statements and 18 commits when every worker call went
through it, and a server dying between Optuna's commit and vramtune's left a RUNNING Optuna
trial no vramtune row knew of. Here every worker call writes Optuna's rows and vramtune's
rows in one session, one commit: atomic, and a few statements per call
(bench/results/service_throughput.md).

The rows are Optuna's own tables through Optuna's own table definitions
(``optuna.storages._rdb.models``), written as RDBStorage writes them: naive UTC datetimes,
internal parameter representations, JSON attributes, ±inf as a value type. The tests read
every trial back with plain ``optuna.load_study``. Reads (a sampler's history, a pruner's
study) still go through Optuna's storage.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cache
from typing import Any

from optuna.distributions import distribution_to_json
from optuna.storages._rdb import models
from optuna.trial import FrozenTrial, TrialState
from sqlalchemy import Select, Table, bindparam, delete, func, insert, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import BindParameter
from sqlalchemy.sql.selectable import ScalarSelect

from vramtune.service.errors import Conflict
from vramtune.service.optuna import tables as optuna_tables

_TRIALS = optuna_tables.trials
_PARAMS = optuna_tables.params
_VALUES = optuna_tables.values
_INTERMEDIATE = optuna_tables.intermediate
_USER_ATTRS = optuna_tables.trial_user_attrs
_SYSTEM_ATTRS = optuna_tables.trial_system_attrs
_STUDIES = optuna_tables.studies

# Statements of every trial call, built once: see vramtune.service.fleet.leases._FENCE.
_INSERT_TRIALS = insert(_TRIALS).returning(_TRIALS.c.trial_id, sort_by_parameter_order=True)
_INSERT_PARAMS = insert(_PARAMS)
_FINISH = (
    update(_TRIALS)
    .where(_TRIALS.c.trial_id == bindparam("finished_id"), _TRIALS.c.state == TrialState.RUNNING)
    .values(
        state=bindparam("finished_state", type_=_TRIALS.c.state.type),
        datetime_complete=bindparam("finished_at", type_=_TRIALS.c.datetime_complete.type),
    )
    .returning(_TRIALS.c.trial_id)
)


def lock_study(session: Session, study_id: int) -> bool:
    """Lock Optuna's study row until commit, as RDBStorage does to number a new trial.

    ``FOR NO KEY UPDATE``, not RDBStorage's ``FOR UPDATE``: both exclude each other and
    themselves (askers still number one at a time), but it does not wait for the ``KEY SHARE``
    lock that every insert referencing the study holds until commit (a complete's observation
    row, any trial call's rows): with ``FOR UPDATE`` an ask waited for every trial call in
    flight, ~110 ms of a ~220 ms ``next`` at 16 workers. A no-op on SQLite.
    """
    return session.execute(lock_study_query(study_id)).first() is not None


def lock_study_query(study_id: int | BindParameter[Any]) -> Select[tuple[int]]:
    """``lock_study``'s statement, for a caller that joins a condition of its own to it (the
    lock stays on Optuna's study row only)."""
    return (
        select(_STUDIES.c.study_id)
        .where(_STUDIES.c.study_id == study_id)
        .with_for_update(key_share=True, of=_STUDIES)
    )


def count_trials_query(study_id: int | BindParameter[Any]) -> ScalarSelect[int]:
    """How many trials the study has in Optuna (the number the next one gets), as a scalar
    subquery: callers count it in the statement that counts their own rows."""
    return select(func.count()).where(_TRIALS.c.study_id == study_id).scalar_subquery()


def count_trials(session: Session, study_id: int) -> int:
    """How many trials the study has in Optuna (the number the next one gets)."""
    return int(session.scalar(select(count_trials_query(study_id))) or 0)


def insert_trials(
    session: Session,
    study_id: int,
    drafts: Sequence[FrozenTrial],
    now: datetime,
    first: int | None = None,
) -> list[FrozenTrial]:
    """Insert RUNNING trials with the drafts' parameters and attributes; returns them numbered.

    The caller holds ``lock_study``: the numbers follow the count of the study's trials
    (``first``, when the caller counted them under the lock), which is what RDBStorage assigns
    under the same lock. A few statements for all the drafts.
    """
    if not drafts:
        return []
    first = count_trials(session, study_id) if first is None else first
    rows = [
        {
            "study_id": study_id,
            "number": first + i,
            "state": TrialState.RUNNING,
            "datetime_start": now,
        }
        for i in range(len(drafts))
    ]
    trial_ids = list(session.scalars(_INSERT_TRIALS, rows))
    for i, (draft, trial_id) in enumerate(zip(drafts, trial_ids, strict=True)):
        draft.number, draft._trial_id, draft.datetime_start = first + i, trial_id, now
    params = [
        {
            "trial_id": draft._trial_id,
            "param_name": name,
            "param_value": draft.distributions[name].to_internal_repr(value),
            "distribution_json": distribution_to_json(draft.distributions[name]),
        }
        for draft in drafts
        for name, value in draft.params.items()
    ]
    if params:
        session.execute(_INSERT_PARAMS, params)
    for draft in drafts:  # samplers that set attributes while asking are not batched (fleet)
        set_attrs(session, draft._trial_id, draft.system_attrs, system=True)
        set_attrs(session, draft._trial_id, draft.user_attrs, system=False)
    return list(drafts)


def set_attrs(session: Session, trial_id: int, attrs: Mapping[str, Any], system: bool) -> None:
    """Set user (or system) attributes of a trial in one statement, replacing equal keys."""
    if attrs:
        rows = [
            {"trial_id": trial_id, "key": k, "value_json": json.dumps(v)} for k, v in attrs.items()
        ]
        _upsert(session, _SYSTEM_ATTRS if system else _USER_ATTRS, rows, "key", "value_json")


def _upsert(
    session: Session, table: Table, rows: list[dict[str, Any]], key: str, *cols: str
) -> None:
    """Insert rows of a trial, replacing those with an equal (trial_id, key): one statement.

    As RDBStorage does on PostgreSQL and SQLite; elsewhere, delete and insert.
    """
    dialect = session.get_bind().dialect.name
    if dialect in ("postgresql", "sqlite"):
        statement = _upsert_statement(dialect, table, key, cols)
        session.execute(statement, rows)
        return
    trial_id, replaced = rows[0]["trial_id"], [row[key] for row in rows]
    session.execute(delete(table).where(table.c.trial_id == trial_id, table.c[key].in_(replaced)))
    session.execute(insert(table), rows)


@cache  # built once: its cache key is then memoized
def _upsert_statement(dialect: str, table: Table, key: str, cols: tuple[str, ...]) -> Any:
    """``INSERT ... ON CONFLICT (trial_id, key) DO UPDATE SET cols`` on PostgreSQL or SQLite."""
    upsert = (postgresql if dialect == "postgresql" else sqlite).insert(table)
    replace = {col: upsert.excluded[col] for col in cols}
    keys = [table.c.trial_id, table.c[key]]
    return upsert.on_conflict_do_update(index_elements=keys, set_=replace)


def finish(
    session: Session,
    trial_id: int,
    state: TrialState,
    now: datetime,
    values: Sequence[float] | None = None,
) -> None:
    """End a RUNNING trial with its state and values; Conflict if Optuna has it finished.

    Vramtune's lease and Optuna's state commit together, so a finished trial under an active
    lease means somebody finished it in Optuna directly: the worker's call is refused.
    """
    params = {"finished_id": trial_id, "finished_state": state, "finished_at": now}
    ended = session.execute(_FINISH, params).first()
    if ended is None:
        current = session.scalar(select(_TRIALS.c.state).where(_TRIALS.c.trial_id == trial_id))
        if current is None:
            raise Conflict(f"trial {trial_id} is not in the Optuna storage")
        raise Conflict(f"trial {trial_id} already finished in Optuna ({current.name})")
    if values:
        rows = [
            {"trial_id": trial_id, "objective": i, "value": stored, "value_type": kind}
            for i, (stored, kind) in enumerate(map(_stored, values))
        ]
        _upsert(session, _VALUES, rows, "objective", "value", "value_type")


def _stored(value: float) -> tuple[float | None, models.TrialValueModel.TrialValueType]:
    return models.TrialValueModel.value_to_stored_repr(value)


def set_intermediate(session: Session, trial_id: int, step: int, value: float) -> None:
    """Store an intermediate value; the caller has checked the step is new for the trial."""
    stored, kind = models.TrialIntermediateValueModel.intermediate_value_to_stored_repr(value)
    session.execute(
        insert(_INTERMEDIATE).values(
            trial_id=trial_id, step=step, intermediate_value=stored, intermediate_value_type=kind
        )
    )
