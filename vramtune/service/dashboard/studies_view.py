"""The studies list and one study's overview, aggregated in SQL."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from optuna.distributions import BaseDistribution
from optuna.study import StudyDirection
from optuna.trial import TrialState
from sqlalchemy import ColumnElement, and_, case, func, or_, select
from sqlalchemy.orm import Session

from vramtune.service.dashboard import cache, schema
from vramtune.service.dashboard.models import (
    BestTrial,
    DashboardState,
    MemoryCounts,
    ParamInfo,
    StudyListItem,
    StudyListOut,
    StudyOverview,
)
from vramtune.service.db.tables import MemoryObservationRow, StudyRow
from vramtune.service.errors import NotFound
from vramtune.service.optuna.glue import search_space, spec_of
from vramtune.service.studies import study_state

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
RATE_WINDOW = timedelta(hours=1)
T, V = schema.trials, schema.values


@dataclass
class StudyFacts:
    """What one request knows about one study."""

    study_id: int
    name: str
    directions: list[StudyDirection]
    row: StudyRow | None
    counts: dict[str, int]
    infeasible_ids: set[int] | None = field(default=None, repr=False)


def infeasible(session: Session, facts: StudyFacts) -> set[int]:
    """The study's trials that violate a constraint (read once per request).

    vramtune's own record says so for its studies (``outcome`` is "infeasible" exactly when
    the memory constraint it sets is > 0); a plain Optuna study's constraints are read.
    """
    if facts.infeasible_ids is None:
        if facts.row is None:
            facts.infeasible_ids = schema.infeasible(session, facts.study_id)
        else:
            VT = schema.vt_trials
            query = select(VT.c.trial_id).where(
                VT.c.study_id == facts.study_id, VT.c.outcome == "infeasible"
            )
            facts.infeasible_ids = set(session.scalars(query))
    return facts.infeasible_ids


def list_studies(session: Session, now: datetime) -> StudyListOut:
    """Every Optuna study in the database, vramtune's with their task and budget."""
    facts = _facts(session, None)
    ids = [f.study_id for f in facts]
    activity = _activity(session, ids, now)
    memory = _memory_counts(session, ids)
    items = [
        _list_item(session, f, activity.get(f.study_id), memory.get(f.study_id), now) for f in facts
    ]
    return StudyListOut(studies=items, now=schema.utc(now))


def _list_item(
    session: Session,
    facts: StudyFacts,
    activity: Activity | None,
    memory: MemoryCounts | None,
    now: datetime,
) -> StudyListItem:
    best = best_feasible(session, facts) if len(facts.directions) == 1 else None
    return StudyListItem(
        id=facts.study_id,
        name=facts.name,
        task=facts.row.task if facts.row else None,
        state=_state(facts),
        directions=[d.name.lower() for d in facts.directions],
        n_trials=spec_of(facts.row).n_trials if facts.row else None,
        counts=facts.counts,
        memory=(memory or MemoryCounts()) if facts.row else None,
        finished=_finished(facts.counts),
        running=facts.counts.get(TrialState.RUNNING.name, 0),
        best_value=best[2] if best else None,
        trials_per_hour=activity.rate(now) if activity else None,
        created_at=schema.aware(facts.row.created_at if facts.row else None),
        last_activity=schema.aware(activity.last if activity else None),
    )


def _memory_counts(session: Session, ids: list[int]) -> dict[int, MemoryCounts]:
    """Each vramtune study's resized, routed, infeasible and ever-OOMed trials, in one query."""
    VT, OBS = schema.vt_trials, schema.vt_observations
    oomed = select(OBS.c.trial_id).where(OBS.c.outcome == "oom")
    ran_out = or_(VT.c.outcome == "oom", VT.c.trial_id.in_(oomed.scalar_subquery()))
    # Routed: ended on a larger card after a hand-back, however it ended there (a pruned one
    # keeps "pruned" as its outcome, and min_bytes > 0 from the hand-back: vramtune.common.plans).
    routed = and_(
        VT.c.min_bytes > 0,
        VT.c.status == "done",
        VT.c.outcome.is_not(None),
        VT.c.outcome != "infeasible",
    )

    def count(condition: ColumnElement[bool]) -> ColumnElement[int]:
        return func.sum(case((condition, 1), else_=0))

    query = (
        select(
            VT.c.study_id,
            count(VT.c.outcome == "resized"),
            count(routed),
            count(and_(routed, VT.c.outcome == "pruned")),
            count(VT.c.outcome == "infeasible"),
            count(ran_out),
        )
        .where(VT.c.study_id.in_(ids))
        .group_by(VT.c.study_id)
    )
    fields = ("resized", "routed", "routed_pruned", "infeasible", "oom")
    return {
        sid: MemoryCounts.model_validate(
            {name: int(n or 0) for name, n in zip(fields, counts, strict=True)}
        )
        for sid, *counts in session.execute(query)
    }


def _facts(session: Session, name: str | None, counted: bool = True) -> list[StudyFacts]:
    """Name, directions, vramtune row and state counts of every study (or the one named)."""
    query = select(schema.studies.c.study_id, schema.studies.c.study_name)
    if name is not None:
        query = query.where(schema.studies.c.study_name == name)
    named = {sid: sname for sid, sname in session.execute(query.order_by("study_id"))}
    if not named:
        return []
    ids = list(named)
    dirs: dict[int, list[StudyDirection]] = defaultdict(list)
    d = schema.directions
    for sid, direction in session.execute(
        select(d.c.study_id, d.c.direction).where(d.c.study_id.in_(ids)).order_by(d.c.objective)
    ):
        dirs[sid].append(direction)
    rows = {
        r.study_id: r for r in session.scalars(select(StudyRow).where(StudyRow.study_id.in_(ids)))
    }
    counts = _counts(session, ids) if counted else {sid: _zero_counts() for sid in ids}
    return [
        StudyFacts(
            sid, named[sid], dirs[sid] or [StudyDirection.MINIMIZE], rows.get(sid), counts[sid]
        )
        for sid in ids
    ]


def _counts(session: Session, ids: list[int]) -> dict[int, dict[str, int]]:
    """Trials per TrialState name of each study, every state present."""
    counts = {sid: _zero_counts() for sid in ids}
    query = (
        select(T.c.study_id, T.c.state, func.count())
        .where(T.c.study_id.in_(ids))
        .group_by(T.c.study_id, T.c.state)
    )
    for sid, state, count in session.execute(query):
        counts[sid][state.name] = count
    return counts


def _zero_counts() -> dict[str, int]:
    return {state.name: 0 for state in TrialState}


def _finished(counts: dict[str, int]) -> int:
    return sum(counts.get(state.name, 0) for state in FINISHED)


def _state(facts: StudyFacts) -> DashboardState:
    if facts.row is not None:
        return study_state(facts.row, facts.counts)
    return "running" if facts.counts.get(TrialState.RUNNING.name, 0) else "idle"


def best_feasible(session: Session, facts: StudyFacts) -> tuple[int, int, float] | None:
    """(trial id, number, value) of the best feasible completed trial by the first objective."""
    skip = infeasible(session, facts)
    minimize = facts.directions[0] != StudyDirection.MAXIMIZE
    # -inf, the finite values, then +inf (Optuna stores the infinities as types without a value)
    types = V.c.value_type
    rank = case((types == schema.INF_NEG, 0), (types == schema.INF_POS, 2), else_=1)
    query = (
        select(T.c.trial_id, T.c.number, V.c.value, V.c.value_type)
        .join(V, and_(V.c.trial_id == T.c.trial_id, V.c.objective == 0))
        .where(T.c.study_id == facts.study_id, T.c.state == TrialState.COMPLETE)
        .order_by(
            *((rank.asc(), V.c.value.asc()) if minimize else (rank.desc(), V.c.value.desc())),
            T.c.number,
        )
        .limit(len(skip) + 1)  # the best feasible one is among these
    )
    for trial_id, number, value, value_type in session.execute(query):
        if trial_id not in skip:
            return trial_id, number, schema.stored_value(value, value_type)
    return None


@dataclass
class Activity:
    """When a study's trials started and finished, for its rate."""

    first_start: datetime | None
    last: datetime | None
    finished_in_window: int
    finished: int
    running: int

    def rate(self, now: datetime) -> float | None:
        """Finished trials per hour over the last hour, or over the whole run once it stopped."""
        if self.first_start is None or self.finished == 0:
            return None
        if self.running or (self.last is not None and now - self.last < RATE_WINDOW):
            hours = min(now - self.first_start, RATE_WINDOW).total_seconds() / 3600
            return self.finished_in_window / hours if hours > 0 else None
        end = self.last or now
        hours = (end - self.first_start).total_seconds() / 3600
        return self.finished / hours if hours > 0 else None


def _activity(session: Session, ids: list[int], now: datetime) -> dict[int, Activity]:
    since = now - RATE_WINDOW
    finished = T.c.datetime_complete.is_not(None)
    query = (
        select(
            T.c.study_id,
            func.min(T.c.datetime_start),
            func.max(func.coalesce(T.c.datetime_complete, T.c.datetime_start)),
            func.sum(case((T.c.datetime_complete >= since, 1), else_=0)),
            func.sum(case((finished, 1), else_=0)),
            func.sum(case((T.c.state == TrialState.RUNNING, 1), else_=0)),
        )
        .where(T.c.study_id.in_(ids))
        .group_by(T.c.study_id)
    )
    return {
        sid: Activity(first, last, int(window or 0), int(done or 0), int(running or 0))
        for sid, first, last, window, done, running in session.execute(query)
    }


# ---------------------------------------------------------------- one study


def study_facts(session: Session, name: str, counted: bool = False) -> StudyFacts:
    """The named study's facts (counts only when asked for); NotFound when there is none."""
    found = _facts(session, name, counted)
    if not found:
        raise NotFound(f"study {name!r} not found")
    return found[0]


@dataclass(frozen=True)
class _Settled:
    """The parts of the overview that change only when the study's revision does."""

    objective_names: list[str]
    infeasible: int
    best: BestTrial | None
    params: list[ParamInfo]
    card_models: list[str]


def overview(session: Session, name: str, now: datetime) -> StudyOverview:
    """The study page's header: state, counts, best trial, parameters, card models, revision."""
    facts = study_facts(session, name, counted=True)
    activity = _activity(session, [facts.study_id], now).get(facts.study_id)
    spec = spec_of(facts.row) if facts.row else None
    peak_memory = bool(spec and spec.minimize_peak_memory)
    revision = schema.revision(session, facts.study_id)
    settled = cache.by_revision(
        session, facts.study_id, "overview", lambda: _settled(session, facts, peak_memory), revision
    )
    return StudyOverview(
        id=facts.study_id,
        name=facts.name,
        task=facts.row.task if facts.row else None,
        state=_state(facts),
        directions=[d.name.lower() for d in facts.directions],
        objective_names=settled.objective_names,
        n_trials=spec.n_trials if spec else None,
        counts=facts.counts,
        finished=_finished(facts.counts),
        running=facts.counts.get(TrialState.RUNNING.name, 0),
        infeasible=settled.infeasible,
        best=settled.best,
        params=settled.params,
        card_models=settled.card_models,
        minimize_peak_memory=peak_memory,
        trials_per_hour=activity.rate(now) if activity else None,
        revision=revision,
        now=schema.utc(now),
    )


def _settled(session: Session, facts: StudyFacts, peak_memory: bool) -> _Settled:
    return _Settled(
        objective_names=_objective_names(session, facts, peak_memory),
        infeasible=len(infeasible(session, facts)),
        best=_best_trial(session, facts),
        params=[schema.param_info(n, d) for n, d in study_space(session, facts).items()],
        card_models=_card_models(session, facts.study_id),
    )


def _objective_names(session: Session, facts: StudyFacts, peak_memory_last: bool) -> list[str]:
    """The spec's or Optuna's metric names, else objective 0, 1...; peak memory named as such."""
    given = spec_of(facts.row).metric_names if facts.row else None
    if given:
        return [*given, "peak memory (bytes)"] if peak_memory_last else list(given)
    a = schema.study_system_attrs
    stored = session.scalar(
        select(a.c.value_json).where(
            a.c.study_id == facts.study_id, a.c.key == "study:metric_names"
        )
    )
    names = [f"objective {i}" for i in range(len(facts.directions))]
    if stored:
        loaded = json.loads(stored)
        if isinstance(loaded, list) and len(loaded) == len(names):
            names = [str(n) for n in loaded]
    elif len(names) == 1:
        names = ["value"]
    if peak_memory_last and len(names) > 1:
        names[-1] = "peak memory (bytes)"
    return names


def _best_trial(session: Session, facts: StudyFacts) -> BestTrial | None:
    """The best feasible completed trial of a single-objective study."""
    if len(facts.directions) != 1:
        return None
    found = best_feasible(session, facts)
    if found is None:
        return None
    trial_id, number, value = found
    params = trial_params(session, [trial_id])[trial_id]
    return BestTrial(number=number, values=[value], params=params)


def trial_params(session: Session, trial_ids: list[int]) -> dict[int, dict[str, Any]]:
    """External parameter values of the given trials, by trial id."""
    P = schema.params
    out: dict[int, dict[str, Any]] = {tid: {} for tid in trial_ids}
    if not trial_ids:
        return out
    for tid, pname, pvalue, pjson in session.execute(
        select(P.c.trial_id, P.c.param_name, P.c.param_value, P.c.distribution_json).where(
            P.c.trial_id.in_(trial_ids)
        )
    ):
        out[tid][pname] = schema.external(pvalue, pjson)
    return out


# A plain Optuna study's parameters are read from its latest trials (its space may be dynamic).
SPACE_SAMPLE = 1000


def study_space(session: Session, facts: StudyFacts) -> dict[str, BaseDistribution]:
    """The study's parameters by name: its spec's space, or its latest trials' distributions."""
    if facts.row is not None:
        return search_space(spec_of(facts.row))
    P = schema.params
    recent = (
        select(T.c.trial_id)
        .where(T.c.study_id == facts.study_id)
        .order_by(T.c.trial_id.desc())
        .limit(SPACE_SAMPLE)
    )
    latest = (
        select(func.max(P.c.param_id))
        .where(P.c.trial_id.in_(recent.scalar_subquery()))
        .group_by(P.c.param_name)
    )
    rows = session.execute(
        select(P.c.param_name, P.c.distribution_json).where(
            P.c.param_id.in_(latest.scalar_subquery())
        )
    )
    return {pname: schema.distribution(pjson) for pname, pjson in sorted(rows)}


def _card_models(session: Session, study_id: int) -> list[str]:
    OBS = MemoryObservationRow
    return list(
        session.scalars(
            select(OBS.card_model)
            .where(OBS.study_id == study_id)
            .distinct()
            .order_by(OBS.card_model)
        )
    )
