"""Optuna's own parameter importances, on a bounded sample of completed trials, cached.

PED-ANOVA (Optuna's default evaluator) takes ~0.1 s on 1,000 trials, but building 10,000
FrozenTrials through the storage takes seconds: the sample is read with SQL (every k-th
completed trial by number) and turned into trials of an in-memory study.

``import optuna.importance`` also imports scikit-learn when it is installed (for fANOVA, unused
here): one to four CPU-seconds, mostly holding the GIL, so every request the process serves in
the meantime slows down. Two things keep that off the page's critical path: the study page asks
for importances only once its other plots and its table are drawn, and the server imports the
evaluators in the background only after the dashboard has been quiet for a while since the start
(a visit that comes first imports them with its own importances request, after its page opened).
"""

from __future__ import annotations

import importlib
import threading
import time
import warnings
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState, create_trial
from sqlalchemy import select
from sqlalchemy.orm import Session

from vramtune.service.dashboard import schema
from vramtune.service.dashboard.errors import invalid_query
from vramtune.service.dashboard.models import Importance, Importances
from vramtune.service.dashboard.studies_view import StudyFacts, infeasible, study_facts

T, V, P = schema.trials, schema.values, schema.params
MAX_SAMPLE = 1000
MIN_TRIALS = 2
# Below this many completed trials importances are computed but mostly reflect noise.
FEW_TRIALS = 10
# A running study changes with every trial: its importances are recomputed at most this often
# (a finished study's revision stays, so they are computed once per process).
FRESH_S = 30.0
# The evaluators are imported in the background once no dashboard request has been served for
# this long (the first page after a start never competes with the import for the GIL).
QUIET_S = 10.0
QUIET_POLL_S = 1.0
EVALUATOR = "PedAnovaImportanceEvaluator"
# Optuna warns that PED-ANOVA takes a lower ``target`` as better; _target negates maximized ones.
warnings.filterwarnings(
    "ignore", message="PedAnovaImportanceEvaluator computes the importances", category=UserWarning
)


@dataclass
class _Entry:
    revision: str
    computed: float
    result: Importances


_cache: dict[tuple[str, int, int], _Entry] = {}
_locks: dict[tuple[str, int, int], threading.Lock] = defaultdict(threading.Lock)
_cache_lock = threading.Lock()
_warm = threading.Event()


class Activity:
    """When the dashboard last served a request, and how many it serves now."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight = 0
        self._last = time.monotonic()

    def touch(self) -> None:
        """Count now as activity (the server's start, for one)."""
        with self._lock:
            self._last = time.monotonic()

    def begin(self) -> None:
        """A request started."""
        with self._lock:
            self._in_flight += 1

    def end(self) -> None:
        """A request ended."""
        with self._lock:
            self._in_flight -= 1
            self._last = time.monotonic()

    def quiet_for(self) -> float:
        """Seconds since the last request ended (0 while one is being served)."""
        with self._lock:
            return 0.0 if self._in_flight else time.monotonic() - self._last


activity = Activity()


async def track_activity() -> AsyncIterator[None]:
    """A dependency of every dashboard route: counts the request as activity."""
    activity.begin()
    try:
        yield
    finally:
        activity.end()


def warm_up() -> None:
    """Import Optuna's importance evaluators in a background thread, once per process."""
    with _cache_lock:
        if _warm.is_set():
            return
        _warm.set()
    threading.Thread(target=_evaluator, name="vramtune-importance-import", daemon=True).start()


@asynccontextmanager
async def lifespan(_app: Any) -> AsyncIterator[None]:
    """Warm the evaluators up once the dashboard has been quiet for QUIET_S after the start."""
    stop = threading.Event()
    activity.touch()

    def when_quiet() -> None:
        while not stop.wait(QUIET_POLL_S):
            if _warm.is_set():
                return
            if activity.quiet_for() >= QUIET_S:
                warm_up()
                return

    threading.Thread(target=when_quiet, name="vramtune-importance-warm-up", daemon=True).start()
    try:
        yield
    finally:
        stop.set()


def _evaluator() -> Any:
    """Optuna's PED-ANOVA evaluator (importing optuna.importance, costly, on first use)."""
    _warm.set()  # imported now, by a request or the warm-up: the warm-up has nothing left to do
    module = importlib.import_module("optuna.importance")
    return module.PedAnovaImportanceEvaluator()


def importances(session: Session, name: str, objective: int, now: datetime) -> Importances:
    """Importances of the study's parameters for one objective, cached per study revision."""
    facts = study_facts(session, name)
    if objective >= len(facts.directions):
        raise invalid_query(
            "objective", f"the study has {len(facts.directions)} objective(s)", objective
        )
    revision = schema.revision(session, facts.study_id)
    key = (str(session.get_bind().engine.url), facts.study_id, objective)
    with _cache_lock:
        lock = _locks[key]
    with lock:  # one computation per study at a time; the others wait and reuse it
        entry = _cache.get(key)
        if entry and (entry.revision == revision or time.monotonic() - entry.computed < FRESH_S):
            return entry.result
        result = _compute(session, facts, objective, now)
        _cache[key] = _Entry(revision, time.monotonic(), result)
        return result


def _compute(session: Session, facts: StudyFacts, objective: int, now: datetime) -> Importances:
    skip = infeasible(session, facts)  # their values are placeholders
    ids = [tid for tid in session.scalars(_complete_ids(facts.study_id)) if tid not in skip]
    trials = sample_trials(session, facts, ids)
    note = None
    found: dict[str, float] = {}
    if len(trials) < MIN_TRIALS:
        note = f"needs at least {MIN_TRIALS} completed trials"
    else:
        study = optuna.create_study(directions=facts.directions)
        study.add_trials(trials)
        try:
            module = importlib.import_module("optuna.importance")
            found = module.get_param_importances(
                study, evaluator=_evaluator(), target=_target(facts, objective)
            )
        except (ValueError, RuntimeError) as error:  # e.g. no parameter varies yet
            note = str(error)
    return Importances(
        objective=objective,
        evaluator=EVALUATOR,
        n_complete=len(ids),
        n_used=len(trials),
        importances=[Importance(name=k, importance=float(v)) for k, v in found.items()],
        note=note if note or found else "no parameter varies across the sampled trials",
        caveat=_caveat(len(trials)) if found else None,
        computed_at=schema.utc(now),
    )


def _caveat(n_used: int) -> str | None:
    """A warning to show beside importances drawn from too few completed trials."""
    if n_used >= FEW_TRIALS:
        return None
    return (
        f"from {n_used} completed trials only: below {FEW_TRIALS}, importances mostly reflect "
        "noise and change as trials complete"
    )


def _target(facts: StudyFacts, objective: int) -> Callable[[FrozenTrial], float] | None:
    """Optuna's ``target=`` for one objective of a multi-objective study (None: the value).

    PED-ANOVA takes a lower target as better: a maximized objective is negated.
    """
    if len(facts.directions) == 1:
        return None
    sign = -1.0 if facts.directions[objective] == StudyDirection.MAXIMIZE else 1.0
    return lambda trial: sign * trial.values[objective]


def _complete_ids(study_id: int) -> Any:
    """Ids of the study's completed trials whose every value is finite, by number."""
    non_finite = (
        select(V.c.trial_id)
        .where(V.c.trial_id == T.c.trial_id, V.c.value_type != schema.FINITE)
        .exists()
    )
    valued = select(V.c.trial_id).where(V.c.trial_id == T.c.trial_id).exists()
    return (
        select(T.c.trial_id)
        .where(T.c.study_id == study_id, T.c.state == TrialState.COMPLETE, valued, ~non_finite)
        .order_by(T.c.number)
    )


def sample_trials(session: Session, facts: StudyFacts, ids: list[int]) -> list[FrozenTrial]:
    """Every k-th of the trials ``ids`` (at most MAX_SAMPLE, one IN list) as FrozenTrials."""
    chosen = ids[:: max(1, -(-len(ids) // MAX_SAMPLE))]
    n_objectives = len(facts.directions)
    values: dict[int, dict[int, float]] = {tid: {} for tid in chosen}
    params: dict[int, dict[str, Any]] = defaultdict(dict)
    dists: dict[int, dict[str, BaseDistribution]] = defaultdict(dict)
    for tid, index, value in session.execute(
        select(V.c.trial_id, V.c.objective, V.c.value).where(V.c.trial_id.in_(chosen))
    ):
        values[tid][index] = float(value)
    rows = session.execute(
        select(P.c.trial_id, P.c.param_name, P.c.param_value, P.c.distribution_json).where(
            P.c.trial_id.in_(chosen)
        )
    )
    for tid, pname, pvalue, pjson in rows:
        params[tid][pname] = schema.external(pvalue, pjson)
        dists[tid][pname] = schema.distribution(pjson)
    return [
        create_trial(
            params=params[tid],
            distributions=dists[tid],
            values=[found[i] for i in range(n_objectives)],
        )
        for tid, found in values.items()
        if len(found) == n_objectives
    ]
