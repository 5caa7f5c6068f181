"""The study page's plot series: SQL selects two or three columns, Python thins them."""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any, NamedTuple

from optuna.distributions import BaseDistribution
from optuna.study import StudyDirection
from optuna.trial import TrialState
from sqlalchemy import Select, and_, select
from sqlalchemy.orm import Session

from vramtune.common.plans import ran_as, rungs_in_words, stored_plan
from vramtune.service.calibration import UNDER_PREDICTION_RATE
from vramtune.service.dashboard import cache, schema, series
from vramtune.service.dashboard.errors import invalid_query
from vramtune.service.dashboard.models import (
    Calibration,
    CardCalibration,
    History,
    MemoryScatter,
    ParetoScatter,
    RegionCategory,
    Regions,
)
from vramtune.service.dashboard.studies_view import StudyFacts, infeasible, study_facts, study_space
from vramtune.service.wire import ParamValue

T, V = schema.trials, schema.values

# Region categories, most telling first: the legend lists them in this order. A trial's
# category is what memory did to it (as asked, resized, routed, oom, infeasible) or, when it
# has not run to an end, its state; pruned is not a category but a mark on its points
# (RegionCategory.pruned), so that a pruned trial still shows how it ran.
RESIZED_BY = "resized: "
"""How a resized trial's region category starts; the rungs it used follow, in words."""
REGION_ORDER = (
    "infeasible",
    "oom",
    "waiting for a larger card",
    "resized",
    "routed",
    "as asked",
    "failed",
    "running",
    "waiting",
)
RAN = (TrialState.COMPLETE, TrialState.PRUNED)


def _direction(facts: StudyFacts, objective: int, field: str = "objective") -> StudyDirection:
    if objective >= len(facts.directions):
        raise invalid_query(field, f"the study has {len(facts.directions)} objective(s)", objective)
    return facts.directions[objective]


def _completed_values(
    session: Session, study_id: int, objective: int, skip: set[int]
) -> list[tuple[int, float]]:
    """(number, value) of completed trials not in ``skip`` with a finite value, by number."""
    query = (
        select(T.c.trial_id, T.c.number, V.c.value)
        .join(V, and_(V.c.trial_id == T.c.trial_id, V.c.objective == objective))
        .where(
            T.c.study_id == study_id,
            T.c.state == TrialState.COMPLETE,
            V.c.value_type == schema.FINITE,
        )
        .order_by(T.c.number)
    )
    return [(n, float(v)) for tid, n, v in session.execute(query) if tid not in skip]


def history(session: Session, name: str, objective: int, max_points: int) -> History:
    """Optimization history: thinned points, the exact best-so-far line."""
    facts = study_facts(session, name)
    direction = _direction(facts, objective)
    key = ("history", objective, max_points)
    return cache.by_revision(
        session,
        facts.study_id,
        key,
        lambda: _history(session, facts, direction, objective, max_points),
    )


def _history(
    session: Session, facts: StudyFacts, direction: StudyDirection, objective: int, max_points: int
) -> History:
    points = _completed_values(session, facts.study_id, objective, infeasible(session, facts))
    numbers = [n for n, _ in points]
    values = [v for _, v in points]
    best = series.best_so_far(values, direction != StudyDirection.MAXIMIZE)
    kept = series.extremes(values, max_points)
    return History(
        objective=objective,
        direction=direction.name.lower(),
        total=len(points),
        numbers=[numbers[i] for i in kept],
        values=[values[i] for i in kept],
        best_numbers=[numbers[i] for i, _ in best],
        best_values=[value for _, value in best],
        downsampled=len(kept) < len(points),
    )


def memory(session: Session, name: str, objective: int, max_points: int) -> MemoryScatter:
    """Objective against measured peak memory of completed trials, Pareto front kept exact."""
    facts = study_facts(session, name)
    direction = _direction(facts, objective)
    key = ("memory", objective, max_points)
    return cache.by_revision(
        session,
        facts.study_id,
        key,
        lambda: _memory(session, facts, direction, objective, max_points),
    )


def _memory(
    session: Session, facts: StudyFacts, direction: StudyDirection, objective: int, max_points: int
) -> MemoryScatter:
    VT, W = schema.vt_trials, schema.vt_workers
    query = (
        select(T.c.number, V.c.value, VT.c.measured_peak_bytes, VT.c.outcome, W.c.card_model)
        .join(V, and_(V.c.trial_id == T.c.trial_id, V.c.objective == objective))
        .join(VT, VT.c.trial_id == T.c.trial_id)
        .outerjoin(W, W.c.id == VT.c.worker_id)
        .where(
            T.c.study_id == facts.study_id,
            T.c.state == TrialState.COMPLETE,
            V.c.value_type == schema.FINITE,
            VT.c.measured_peak_bytes.is_not(None),
        )
        .order_by(T.c.number)
    )
    rows = session.execute(query).all()
    costs = [float(r[2]) for r in rows]
    values = [float(r[1]) for r in rows]
    front = series.pareto_front(costs, values, direction != StudyDirection.MAXIMIZE)
    kept = series.spread(len(rows), max_points, keep=front)
    return MemoryScatter(
        objective=objective,
        direction=direction.name.lower(),
        total=len(rows),
        numbers=[rows[i][0] for i in kept],
        values=[values[i] for i in kept],
        measured_bytes=[rows[i][2] for i in kept],
        card_models=[rows[i][4] or "" for i in kept],
        outcomes=[rows[i][3] or "" for i in kept],
        front_numbers=[rows[i][0] for i in front],
        front_values=[values[i] for i in front],
        front_bytes=[rows[i][2] for i in front],
        downsampled=len(kept) < len(rows),
    )


def pareto(session: Session, name: str, x: int, y: int, max_points: int) -> ParetoScatter:
    """One objective against another of completed feasible trials, their front kept exact."""
    facts = study_facts(session, name)
    x_direction, y_direction = _direction(facts, x, "x"), _direction(facts, y, "y")
    if x == y:
        raise invalid_query("y", "choose two different objectives", y)
    key = ("pareto", x, y, max_points)
    return cache.by_revision(
        session,
        facts.study_id,
        key,
        lambda: _pareto(session, facts, (x, x_direction), (y, y_direction), max_points),
    )


def _pareto(
    session: Session,
    facts: StudyFacts,
    x: tuple[int, StudyDirection],
    y: tuple[int, StudyDirection],
    max_points: int,
) -> ParetoScatter:
    vx, vy = V.alias("vx"), V.alias("vy")
    query = (
        select(T.c.trial_id, T.c.number, vx.c.value, vy.c.value)
        .join(vx, and_(vx.c.trial_id == T.c.trial_id, vx.c.objective == x[0]))
        .join(vy, and_(vy.c.trial_id == T.c.trial_id, vy.c.objective == y[0]))
        .where(
            T.c.study_id == facts.study_id,
            T.c.state == TrialState.COMPLETE,
            vx.c.value_type == schema.FINITE,
            vy.c.value_type == schema.FINITE,
        )
        .order_by(T.c.number)
    )
    skip = infeasible(session, facts)
    rows = [(n, float(a), float(b)) for tid, n, a, b in session.execute(query) if tid not in skip]
    x_sign = -1.0 if x[1] == StudyDirection.MAXIMIZE else 1.0  # the front's cost is minimized
    costs = [x_sign * r[1] for r in rows]
    front = series.pareto_front(costs, [r[2] for r in rows], y[1] != StudyDirection.MAXIMIZE)
    front.sort(key=lambda i: rows[i][1])
    kept = series.spread(len(rows), max_points, keep=front)
    return ParetoScatter(
        x_objective=x[0],
        y_objective=y[0],
        x_direction=x[1].name.lower(),
        y_direction=y[1].name.lower(),
        total=len(rows),
        numbers=[rows[i][0] for i in kept],
        x=[rows[i][1] for i in kept],
        y=[rows[i][2] for i in kept],
        front_numbers=[rows[i][0] for i in front],
        front_x=[rows[i][1] for i in front],
        front_y=[rows[i][2] for i in front],
        downsampled=len(kept) < len(rows),
    )


def calibration(session: Session, name: str, max_points: int) -> Calibration:
    """Predicted against measured allocated peak of every run, per card model."""
    facts = study_facts(session, name)
    key = ("calibration", max_points)
    return cache.by_revision(
        session, facts.study_id, key, lambda: _calibration(session, facts, max_points)
    )


def _calibration(session: Session, facts: StudyFacts, max_points: int) -> Calibration:
    OBS = schema.vt_observations
    query = (
        select(
            OBS.c.card_model,
            T.c.number,
            OBS.c.predicted_allocated,
            OBS.c.measured_allocated,
            OBS.c.outcome,
        )
        .join(T, T.c.trial_id == OBS.c.trial_id)
        .where(OBS.c.study_id == facts.study_id, OBS.c.predicted_allocated.is_not(None))
        .order_by(OBS.c.card_model, OBS.c.id)
    )
    by_card: dict[str, list[Any]] = defaultdict(list)
    for row in session.execute(query):
        by_card[row[0]].append(row)
    per_card = max(1, max_points // max(1, len(by_card)))
    cards = [_card_calibration(card, rows, per_card) for card, rows in sorted(by_card.items())]
    return Calibration(
        cards=cards,
        target_under_fraction=UNDER_PREDICTION_RATE,
        downsampled=any(len(c.numbers) < c.n for c in cards),
    )


def _card_calibration(card: str, rows: list[Any], max_points: int) -> CardCalibration:
    biases = sorted(r[3] / r[2] - 1 for r in rows if r[2] > 0)
    errors = sorted(abs(b) for b in biases)
    under = [i for i, r in enumerate(rows) if r[3] > r[2]]
    kept = series.spread(len(rows), max_points, keep=under)
    return CardCalibration(
        card_model=card,
        n=len(rows),
        median_bias=series.quantile(biases, 0.5),
        median_abs_error=series.quantile(errors, 0.5),
        p95_abs_error=series.quantile(errors, 0.95),
        under_fraction=len(under) / len(rows) if rows else None,
        numbers=[rows[i][1] for i in kept],
        predicted_bytes=[rows[i][2] for i in kept],
        measured_bytes=[rows[i][3] for i in kept],
        outcomes=[rows[i][4] for i in kept],
    )


# Parameters that usually drive memory: the region map shows them first.
MEMORY_PARAM = re.compile(r"batch|width|seq|len|hidden|dim|layer|head|size|embed", re.IGNORECASE)


def regions(session: Session, name: str, x: str | None, y: str | None, max_points: int) -> Regions:
    """Each trial's outcome at its (x, y) parameter values; rare outcomes are never thinned.

    Without x or y, the study's likeliest memory parameters are chosen (and named in the answer).
    """
    facts = study_facts(session, name)
    space = study_space(session, facts)
    if not space and x is None and y is None:
        return Regions(x="", y="", total=0, categories=[], downsampled=False)
    x, y = _plane_axes(list(space), x, y)
    for field, param in (("x", x), ("y", y)):
        if param not in space:
            raise invalid_query(field, f"the study has no parameter {param!r}", param)
    key = ("regions", x, y, max_points)
    return cache.by_revision(
        session, facts.study_id, key, lambda: _regions(session, facts, space, x, y, max_points)
    )


def _plane_axes(names: list[str], x: str | None, y: str | None) -> tuple[str, str]:
    """The asked parameters, the missing ones filled with memory-related ones first."""
    ranked = sorted(names, key=lambda n: MEMORY_PARAM.search(n) is None)  # stable: memory first
    if x is None:
        x = next((n for n in ranked if n != y), y or "")
    if y is None:
        y = next((n for n in ranked if n != x), x)
    return x, y


def _regions(
    session: Session,
    facts: StudyFacts,
    space: dict[str, BaseDistribution],
    x: str,
    y: str,
    max_points: int,
) -> Regions:
    oomed = _oomed(session, facts.study_id)
    skip = infeasible(session, facts)
    grouped: dict[str, list[Point]] = defaultdict(list)
    for tid, number, xv, yv, state, outcome, status, plan, min_bytes in session.execute(
        _plane(facts.study_id, x, y)
    ):
        ran = stored_plan(plan or {})
        if state == TrialState.PRUNED and outcome == "pruned":  # how it ran, from its plan
            outcome = ran_as(ran, routed=bool(min_bytes))
        category = region_category(state, outcome, status, tid in oomed, tid in skip)
        if category == "resized":  # the plot names the rungs it used
            category = f"{RESIZED_BY}{rungs_in_words(ran)}"
        grouped[category].append(
            Point(
                number,
                schema.external_of(xv, space[x]),
                schema.external_of(yv, space[y]),
                state == TrialState.PRUNED,
            )
        )
    total = sum(len(points) for points in grouped.values())
    out = _thin_categories(grouped, max_points)
    kept = sum(len(c.numbers) for c in out)
    return Regions(x=x, y=y, total=total, categories=out, downsampled=kept < total)


def _plane(study_id: int, x: str, y: str) -> Select[Any]:
    """Trials holding both parameters: ids, values of x and y, state and vramtune's record."""
    px, py = schema.params.alias("px"), schema.params.alias("py")
    VT = schema.vt_trials
    return (
        select(
            T.c.trial_id,
            T.c.number,
            px.c.param_value,
            py.c.param_value,
            T.c.state,
            VT.c.outcome,
            VT.c.status,
            VT.c.plan,
            VT.c.min_bytes,
        )
        .join(px, and_(px.c.trial_id == T.c.trial_id, px.c.param_name == x))
        .join(py, and_(py.c.trial_id == T.c.trial_id, py.c.param_name == y))
        .outerjoin(VT, VT.c.trial_id == T.c.trial_id)
        .where(T.c.study_id == study_id)
    )


def _oomed(session: Session, study_id: int) -> set[int]:
    """Trials that ran out of memory at least once."""
    OBS = schema.vt_observations
    query = (
        select(OBS.c.trial_id).where(OBS.c.study_id == study_id, OBS.c.outcome == "oom").distinct()
    )
    return set(session.scalars(query))


class Point(NamedTuple):
    """One trial on the region map."""

    number: int
    x: ParamValue
    y: ParamValue
    pruned: bool


def region_category(
    state: TrialState, outcome: str | None, status: str | None, had_oom: bool, infeasible: bool
) -> str:
    """Where a trial lands on the region map: its memory outcome, else its state.

    ``outcome`` of a pruned trial is how it ran (as_asked, resized, routed); a trial that ran
    out of memory once is "oom" whatever came after, since its prediction missed.
    """
    if status == "waiting":
        return "waiting for a larger card"
    if outcome == "infeasible" or infeasible:
        return "infeasible"
    if outcome == "oom" or (had_oom and state != TrialState.RUNNING):
        return "oom"
    if state in RAN:
        return outcome if outcome in ("resized", "routed") else "as asked"
    return {
        TrialState.FAIL: "failed",
        TrialState.RUNNING: "running",
        TrialState.WAITING: "waiting",
    }.get(state, state.name.lower())


def _thin_categories(grouped: dict[str, list[Point]], max_points: int) -> list[RegionCategory]:
    """Share ``max_points`` so that small categories keep every point and large ones are thinned."""
    budget = max_points
    remaining = len(grouped)
    out: list[RegionCategory] = []
    for name, points in sorted(grouped.items(), key=lambda item: len(item[1])):
        share = max(1, budget // max(1, remaining))
        kept = [points[i] for i in series.spread(len(points), share)]
        budget -= len(kept)
        remaining -= 1
        out.append(
            RegionCategory(
                name=name,
                count=len(points),
                numbers=[p.number for p in kept],
                x=[p.x for p in kept],
                y=[p.y for p in kept],
                pruned=[p.pruned for p in kept],
            )
        )
    rank = {name: i for i, name in enumerate(REGION_ORDER)}
    return sorted(out, key=lambda c: (rank.get(_category_kind(c.name), len(rank)), c.name))


def _category_kind(name: str) -> str:
    """A region category's place in REGION_ORDER: 'resized: ...' ranks as 'resized'."""
    return "resized" if name.startswith(RESIZED_BY) else name
