"""Where a trial goes when it cannot run where it was: re-offer, wait, retry, or end it.

Routing of a hand-back (DESIGN.md section 2, step 5): a trial that does not fit its worker's
card waits for a live card at least as large as the smallest footprint the worker could reach;
when the fleet has no such card it is ended as infeasible for memory, and told to Optuna as a
COMPLETE trial with a violated constraint, because that is the only way Optuna's
constraint-aware samplers learn: TPE, NSGA-II and GP read ``trial.constraints`` of COMPLETE
trials only (TPE also of PRUNED ones) and never look at FAIL trials. Measured with TPE on a
two-parameter space, 40 % infeasible, 60 trials, 8 seeds: told FAIL, 14.9 of the last 15
suggestions were infeasible; told COMPLETE with the constraint, 5.9 (GP: 0 of 15).

The constraint is written both ways readers understand: ``constraints:memory`` (Optuna 5's
``Trial.set_constraint``) and the older ``constraints`` list that optuna-dashboard 0.21 reads.
Optuna merges the two, so samplers see two equal constraints: feasibility is unchanged and
TPE's and NSGA-II's violation sums are doubled for every trial alike, so their ordering holds.
Every COMPLETE trial carries it (feasible ones with the negative headroom on their card),
because GP requires the same number of constraints on all trials.

An infeasible trial's objective values are placeholders, marked by the user attribute
``vramtune.placeholder_values``: just worse than the worst value of the feasible trials so far
(one float step), infinitely bad before any (+inf when minimized, -inf when maximized), and for
a peak-memory objective the footprint the worker reached, a true lower bound. Optuna's
``best_trial`` and Pareto front skip infeasible trials by their constraint; readers that rank
COMPLETE trials by value alone do not: optuna-dashboard 0.21's "Best Trial" is
``RDBStorage.get_best_trial``, an SQL min/max (optuna-dashboard issue 772), and it draws its
Pareto front from values only. A placeholder so never beats, nor ties, a feasible trial there
(0.0, the placeholder before any feasible trial until issue 35, stayed the best of a minimized
study for good). Samplers do not mind: TPE and NSGA-II rank infeasible trials by their
violation, not their values, and GP replaces infinite values by the worst finite one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import optuna
from optuna.storages import BaseStorage
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState
from sqlalchemy import bindparam, func, select
from sqlalchemy.orm import Session

from vramtune.service.db.tables import (
    MemoryObservationRow,
    StudyRow,
    TokenRow,
    TrialRow,
    WorkerRow,
)
from vramtune.service.optuna import rows as optuna_rows
from vramtune.service.optuna.glue import load_optuna_study, spec_of, tell
from vramtune.service.principal import Principal
from vramtune.service.wire import StudyCreate

MEMORY_CONSTRAINT = "memory"
CONSTRAINT_ATTR = f"constraints:{MEMORY_CONSTRAINT}"  # Optuna 5's Trial.set_constraint key
LEGACY_CONSTRAINTS_ATTR = "constraints"  # the list optuna-dashboard 0.21 reads
MAX_OOM_RETRIES = 1  # DESIGN.md section 2, step 9: an OOM'd trial is retried once
ATTR = "vramtune."  # prefix of the user attributes vramtune writes on a trial


@dataclass(frozen=True)
class OptunaTell:
    """Where a trial is told to Optuna: the transaction, the storage, its study, the time."""

    session: Session
    storage: BaseStorage
    study: StudyRow
    now: datetime


_CARDS = select(
    WorkerRow.id,
    WorkerRow.total_bytes,
    WorkerRow.tasks,
    WorkerRow.cards,
    WorkerRow.token_id,
    TokenRow.scopes,
    TokenRow.studies,
    TokenRow.revoked_at,
    TokenRow.expires_at,
).outerjoin(TokenRow, TokenRow.id == WorkerRow.token_id)
_LIVE_CARDS = _CARDS.where(
    WorkerRow.stopped.is_(False), WorkerRow.last_heartbeat >= bindparam("cutoff")
)  # built once (a worker's next reads it): see vramtune.service.fleet.leases._FENCE
# Advice with no live card names the largest registered lately (the newest 1,000 workers).
_REGISTERED_CARDS = _CARDS.order_by(WorkerRow.id.desc()).limit(1000)


def live_cards(
    session: Session,
    study: StudyRow,
    now: datetime,
    stale_s: float | None,
    believe_up_to: int,
    min_cards: int = 1,
) -> dict[int, int]:
    """The live workers that may lease a trial of ``study`` (they run its task, and their
    token is live, a worker's and valid for the study) with at least ``min_cards`` cards (a
    node's, for a distributed trial): worker id -> card size as believed (``believed``).
    ``stale_s`` None: every worker registered lately, live or not (advice's fallback).

    Counting every token's cards, a trial handed back waited for another team's card that
    would never be offered it, and advice quoted another team's card (issue 47).
    """
    if stale_s is None:
        rows = session.execute(_REGISTERED_CARDS)
    else:
        rows = session.execute(_LIVE_CARDS, {"cutoff": now - timedelta(seconds=stale_s)})
    # tasks is a JSON list: filtered here, portably, rather than with a dialect's JSON operator
    cards = {
        row.id: row.total_bytes
        for row in rows
        if study.task in row.tasks and row.cards >= min_cards and _may_lease(row, study, now)
    }
    return believed(session, cards, believe_up_to)


def _may_lease(row: Any, study: StudyRow, now: datetime) -> bool:
    """Whether the worker's token (None: auth off, registered without one) may lease a trial
    of the study now, as the guard and ``next`` would decide."""
    if row.token_id is None:
        return True
    if row.scopes is None or row.revoked_at is not None:  # deleted or revoked
        return False
    if row.expires_at is not None and row.expires_at <= now:
        return False
    studies = None if row.studies is None else frozenset(row.studies)
    principal = Principal(name="", scopes=frozenset(row.scopes), studies=studies)
    return principal.has_scope("worker") and principal.allows_study(study.name)


def believed(session: Session, cards: dict[int, int], bound: int) -> dict[int, int]:
    """Card sizes as routing counts them: a size within ``bound`` (settings.max_card_bytes) as
    registered; a larger one only as far as its worker has measured a completed run on it. A
    worker that claims a huge card so makes no trial wait for it, and is offered no trial
    handed back as too large for the real cards (a new trial, which needs no size, still)."""
    over = [wid for wid, total in cards.items() if total > bound]
    if not over:
        return cards
    shown = _largest_runs(session, over)
    return {
        wid: min(total, shown.get(wid, 0)) if total > bound else total
        for wid, total in cards.items()
    }


def _largest_runs(session: Session, worker_ids: list[int]) -> dict[int, int]:
    """Per worker, the largest peak it measured in a completed run."""
    o = MemoryObservationRow
    query = (
        select(o.worker_id, func.max(o.measured_allocated), func.max(o.measured_reserved))
        .where(o.worker_id.in_(worker_ids), o.outcome == "complete")
        .group_by(o.worker_id)
    )
    return {
        wid: max(allocated or 0, reserved or 0)
        for wid, allocated, reserved in session.execute(query)
        if wid is not None
    }


def largest_card(cards: dict[int, int], exclude: int | None = None) -> int:
    """The largest of ``live_cards`` but the excluded worker's; 0 when none."""
    return max((total for wid, total in cards.items() if wid != exclude), default=0)


def live_capacity(
    session: Session,
    study: StudyRow,
    now: datetime,
    stale_s: float | None,
    believe_up_to: int,
    exclude: int | None = None,
    min_cards: int = 1,
) -> int:
    """The largest card (as believed) of a live worker that may lease a trial of ``study``
    with at least ``min_cards`` cards (``live_cards``); 0 when none."""
    cards = live_cards(session, study, now, stale_s, believe_up_to, min_cards)
    return largest_card(cards, exclude)


def headroom(footprint: int, card_bytes: int) -> float:
    """The memory constraint: footprint over card, relative (> 0 infeasible, <= 0 fits)."""
    if card_bytes <= 0:
        return 1.0
    return (footprint - card_bytes) / card_bytes


def write_constraint(session: Session, trial_id: int, value: float) -> None:
    """Store the memory constraint as Optuna 5 and optuna-dashboard 0.21 both read it."""
    constraint = {CONSTRAINT_ATTR: value, LEGACY_CONSTRAINTS_ATTR: [value]}
    optuna_rows.set_attrs(session, trial_id, constraint, system=True)


def write_attrs(session: Session, trial_id: int, attrs: dict[str, Any]) -> None:
    """Set ``vramtune.<key>`` user attributes of a trial (skipping None values)."""
    values = {ATTR + key: value for key, value in attrs.items() if value is not None}
    optuna_rows.set_attrs(session, trial_id, values, system=False)


def _feasible(trial: FrozenTrial) -> bool:
    return all(value <= 0 for value in trial.constraints.values())


def placeholder_values(study: optuna.Study, spec: StudyCreate, footprint: int) -> list[float]:
    """Objective values of an infeasible trial: worse than every feasible one, then its
    footprint."""
    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    feasible = [t.values for t in done if t.values is not None and _feasible(t)]
    values = []
    for index, direction in enumerate(study.directions[: len(spec.directions)]):
        values.append(worse_than_all([v[index] for v in feasible], direction))
    if spec.minimize_peak_memory:
        values.append(float(footprint))
    return values


def worse_than_all(seen: Sequence[float], direction: StudyDirection) -> float:
    """One float step worse than the worst of `seen`; the worst there is when none was seen."""
    away = math.inf if direction == StudyDirection.MINIMIZE else -math.inf
    if not seen:
        return away
    worst = max(seen) if direction == StudyDirection.MINIMIZE else min(seen)
    return math.nextafter(float(worst), away)


def tell_infeasible(
    call: OptunaTell, trial: TrialRow, footprint: int, capacity: int, reason: str
) -> float:
    """End a trial no card of the fleet can hold: COMPLETE with a violated constraint."""
    value = max(headroom(footprint, capacity), 1e-9)  # strictly > 0: infeasible
    write_constraint(call.session, trial.trial_id, value)
    write_attrs(
        call.session,
        trial.trial_id,
        {
            "outcome": "infeasible",
            "placeholder_values": True,
            "min_footprint_bytes": footprint,
            "largest_card_bytes": capacity,
            "fail_reason": reason,
        },
    )
    study = load_optuna_study(call.storage, call.study)
    values = placeholder_values(study, spec_of(call.study), footprint)
    tell(call.session, call.storage, call.study, trial, TrialState.COMPLETE, call.now, values)
    return value


def tell_failed(call: OptunaTell, trial: TrialRow, reason: str, outcome: str = "failed") -> None:
    """Tell Optuna the trial FAILed, with the reason and the outcome as user attributes."""
    write_attrs(call.session, trial.trial_id, {"fail_reason": reason[:4096], "outcome": outcome})
    tell(call.session, call.storage, call.study, trial, TrialState.FAIL, call.now)


def reoffer(trial: TrialRow, now: datetime, next_attempt: bool) -> None:
    """Put the trial back to be offered to the next worker that fits it (same number, params)."""
    trial.status = "pending"
    trial.attempt += 1 if next_attempt else 0
    trial.updated_at = now


def attempts_left(trial: TrialRow, spec: StudyCreate) -> bool:
    """Whether one more attempt stays within the study's ``max_attempts``."""
    return trial.attempt + 1 < spec.max_attempts


def plans_on(plans_tried: Sequence[dict[str, Any]], card_model: str) -> list[dict[str, Any]]:
    """The plans that ran out of memory on one card model (without the card model key)."""
    return [
        {k: v for k, v in plan.items() if k != "card_model"}
        for plan in plans_tried
        if plan.get("card_model") == card_model
    ]
