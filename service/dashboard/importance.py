"""Optuna's own parameter importances, on a bounded sample of completed trials, cached.

PED-ANOVA (Optuna's default evaluator) takes ~0.1 s on 1,000 trials, but building 10,000
FrozenTrials through the storage takes seconds: the sample is read with SQL (every k-th
completed trial by number) and turned into trials of an in-memory study. ``optuna.importance``
imports scikit-learn and SciPy (a second or more): a background thread imports it a few seconds
after the server started, or at once when a study page is requested, while the browser loads
plotly.js: the server starts without waiting for it, and a study page rarely does.
"""

from __future__ import annotations

import importlib
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.trial import FrozenTrial, TrialState, create_trial
from sqlalchemy import and_, func, select
from sqlalchemy.orm import Session

from service.dashboard import schema
from service.dashboard.errors import invalid_query
from service.dashboard.models import Importance, Importances
from service.dashboard.studies_view import StudyFacts, infeasible, study_facts

T, V, P = schema.trials, schema.values, schema.params
MAX_SAMPLE = 1000
MIN_TRIALS = 2
# A cached result is served while it is this young, even if trials finished since.
FRESH_S = 30.0
# Seconds after the server started before the evaluators are imported in the background.
WARM_UP_DELAY_S = 3.0


@dataclass
class _Entry:
    n_complete: int
    computed: float
    result: Importances


_cache: dict[tuple[str, int, int], _Entry] = {}
_locks: dict[tuple[str, int, int], threading.Lock] = defaultdict(threading.Lock)
_cache_lock = threading.Lock()
_warm = threading.Event()


def warm_up() -> None:
    """Import Optuna's importance evaluators in a background thread, once per process."""
    with _cache_lock:
        if _warm.is_set():
            return
        _warm.set()
    threading.Thread(target=_evaluator, name="vramtune-importance-import", daemon=True).start()


@asynccontextmanager
async def lifespan(_app: Any) -> AsyncIterator[None]:
    """Warm the evaluators up a little after the server started (not during its start)."""
    stop = threading.Event()

    def later() -> None:
        if not stop.wait(WARM_UP_DELAY_S):
            warm_up()

    threading.Thread(target=later, name="vramtune-importance-warm-up", daemon=True).start()
    try:
        yield
    finally:
        stop.set()


def _evaluator() -> Any:
    """Optuna's PED-ANOVA evaluator (importing optuna.importance, costly, on first use)."""
    module = importlib.import_module("optuna.importance")
    return module.PedAnovaImportanceEvaluator()


def importances(session: Session, name: str, objective: int) -> Importances:
    """Importances of the study's parameters for one objective (cached while fresh)."""
    facts = study_facts(session, name)
    if objective >= len(facts.directions):
        raise invalid_query(
            "objective", f"the study has {len(facts.directions)} objective(s)", objective
        )
    n_complete = _n_complete(session, facts.study_id)
    key = (str(session.get_bind().engine.url), facts.study_id, objective)
    with _cache_lock:
        lock = _locks[key]
    with lock:  # one computation per study at a time; the others wait and reuse it
        entry = _cache.get(key)
        if entry and (
            entry.n_complete == n_complete or time.monotonic() - entry.computed < FRESH_S
        ):
            return entry.result
        result = _compute(session, facts, objective, n_complete)
        _cache[key] = _Entry(n_complete, time.monotonic(), result)
        return result


def _n_complete(session: Session, study_id: int) -> int:
    count = session.scalar(
        select(func.count()).where(T.c.study_id == study_id, T.c.state == TrialState.COMPLETE)
    )
    return int(count or 0)


def _compute(session: Session, facts: StudyFacts, objective: int, n_complete: int) -> Importances:
    skip = infeasible(session, facts)  # their values are placeholders
    trials = sample_trials(session, facts.study_id, objective, n_complete, skip)
    evaluator = "PedAnovaImportanceEvaluator"
    note = None
    found: dict[str, float] = {}
    if len(trials) < MIN_TRIALS:
        note = f"needs at least {MIN_TRIALS} completed trials"
    else:
        study = optuna.create_study(direction=facts.directions[objective])
        study.add_trials(trials)
        try:
            module = importlib.import_module("optuna.importance")
            found = module.get_param_importances(study, evaluator=_evaluator())
        except (ValueError, RuntimeError) as error:  # e.g. no parameter varies yet
            note = str(error)
    return Importances(
        objective=objective,
        evaluator=evaluator,
        n_complete=n_complete - len(skip),
        n_used=len(trials),
        importances=[Importance(name=k, importance=float(v)) for k, v in found.items()],
        note=note if note or found else "no parameter varies across the sampled trials",
        computed_at=schema.utc(schema.utcnow()),
    )


def sample_trials(
    session: Session, study_id: int, objective: int, n_complete: int, skip: set[int]
) -> list[FrozenTrial]:
    """Every k-th completed trial not in ``skip`` (at most MAX_SAMPLE) as FrozenTrials."""
    stride = max(1, -(-n_complete // MAX_SAMPLE))
    ranked = (
        select(T.c.trial_id, V.c.value, func.row_number().over(order_by=T.c.number).label("rank"))
        .join(V, and_(V.c.trial_id == T.c.trial_id, V.c.objective == objective))
        .where(
            T.c.study_id == study_id,
            T.c.state == TrialState.COMPLETE,
            V.c.value_type == schema.FINITE,
        )
        .subquery()
    )
    chosen = select(ranked.c.trial_id, ranked.c.value).where((ranked.c.rank - 1) % stride == 0)
    values = {tid: float(value) for tid, value in session.execute(chosen) if tid not in skip}
    params: dict[int, dict[str, Any]] = defaultdict(dict)
    dists: dict[int, dict[str, BaseDistribution]] = defaultdict(dict)
    rows = session.execute(
        select(P.c.trial_id, P.c.param_name, P.c.param_value, P.c.distribution_json).where(
            P.c.trial_id.in_(select(chosen.subquery().c.trial_id))
        )
    )
    for tid, pname, pvalue, pjson in rows:
        params[tid][pname] = schema.external(pvalue, pjson)
        dists[tid][pname] = schema.distribution(pjson)
    return [
        create_trial(params=params[tid], distributions=dists[tid], value=value)
        for tid, value in values.items()
    ]
