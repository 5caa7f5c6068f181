"""The fleet: workers, their cards, what they run, and which have gone quiet."""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, case, func, select, true
from sqlalchemy.orm import Session

from vramtune.service.dashboard import schema
from vramtune.service.dashboard.models import (
    CurrentTrial,
    Fleet,
    FleetTotals,
    FleetWorker,
    WorkerState,
)
from vramtune.service.db.tables import LeaseRow, StudyRow, TrialRow, WorkerRow
from vramtune.service.settings import Settings

# Workers per page by default, and at most (the fleet of a large shared cluster on one page;
# 2,139 rows were 750 KB unpaginated).
PAGE_SIZE, MAX_PAGE_SIZE = 100, 500
# Missing this many heartbeats in a row makes a worker stale (it may only be slow).
STALE_HEARTBEATS = 2.5


def thresholds(settings: Settings) -> tuple[float, float]:
    """Seconds without a heartbeat after which a worker is stale, and after which it is lost."""
    lost = settings.worker_stale_s
    return min(STALE_HEARTBEATS * settings.heartbeat_interval_s, lost), lost


def worker_state(stopped: bool, age_s: float, stale_s: float, lost_s: float) -> WorkerState:
    """live, stale (late heartbeats), lost (the server gave up on it) or stopped (said goodbye)."""
    if stopped:
        return "stopped"
    if age_s > lost_s:
        return "lost"
    if age_s > stale_s:
        return "stale"
    return "live"


def fleet(
    session: Session,
    settings: Settings,
    now: datetime,
    allowed: frozenset[str] | None = None,
    page: tuple[int, int] = (0, PAGE_SIZE),
) -> Fleet:
    """A page of the workers, live first (then stale, lost, stopped; newest heartbeat first
    within each), with the trials each holds leases on; the totals count every worker.

    ``page``: (offset, limit). ``allowed``: the studies of a study-limited token, which sees
    only the workers running their trials, and only those trials (as GET /api/v1/workers).
    """
    stale_s, lost_s = thresholds(settings)
    current = _current_trials(session, allowed)
    shown = WorkerRow.id.in_(current) if allowed is not None else true()
    rank = _state_rank(now, stale_s, lost_s)
    offset, limit = page
    query = select(WorkerRow).where(shown)
    query = query.order_by(rank, WorkerRow.last_heartbeat.desc(), WorkerRow.id)
    rows = list(session.scalars(query.offset(offset).limit(limit)))
    runs = _runs(session, [w.id for w in rows])
    workers = [
        _worker(w, current.get(w.id, []), runs.get(w.id, 0), now, stale_s, lost_s) for w in rows
    ]
    totals = _totals(session, shown, rank, sum(len(held) for held in current.values()))
    return Fleet(
        workers=workers,
        totals=totals,
        total=sum(totals.workers.values()),
        offset=offset,
        limit=limit,
        stale_after_s=stale_s,
        lost_after_s=lost_s,
        now=schema.utc(now),
    )


_RANKS: tuple[WorkerState, ...] = ("live", "stale", "lost", "stopped")


def _state_rank(now: datetime, stale_s: float, lost_s: float) -> ColumnElement[int]:
    """The index of a worker's state in _RANKS, in SQL (as worker_state): pages cut in order."""
    heard = WorkerRow.last_heartbeat
    return case(
        (WorkerRow.stopped.is_(True), 3),
        (heard < now - timedelta(seconds=lost_s), 2),
        (heard < now - timedelta(seconds=stale_s), 1),
        else_=0,
    )


def _worker(
    row: WorkerRow,
    current: list[CurrentTrial],
    runs: int,
    now: datetime,
    stale_s: float,
    lost_s: float,
) -> FleetWorker:
    age = max(0.0, (now - row.last_heartbeat).total_seconds())
    return FleetWorker(
        id=row.id,
        name=row.name,
        device=row.device,
        card_model=row.card_model,
        simulated=bool((row.card or {}).get("simulated", False)),
        total_bytes=row.total_bytes,
        free_bytes=row.free_bytes,
        cards=row.cards,
        # A node's trials hold disjoint cards (worker/run/cards.py): their world sizes add up.
        busy_cards=min(row.cards, sum(trial.world_size for trial in current)),
        tasks=list(row.tasks or []),
        state=worker_state(row.stopped, age, stale_s, lost_s),
        last_heartbeat=schema.utc(row.last_heartbeat),
        heartbeat_age_s=age,
        registered_at=schema.utc(row.registered_at),
        current=current,
        trials_run=runs,
        trials_done=row.trials_done,
    )


def _runs(session: Session, worker_ids: list[int]) -> dict[int, int]:
    """Per worker, its leases that did not end in a hand-back (the trial did not fit its card)."""
    ended_by = func.coalesce(LeaseRow.resolution["call"].as_string(), "")  # "" while active
    query = (
        select(LeaseRow.worker_id, func.count())
        .where(LeaseRow.worker_id.in_(worker_ids), ended_by != "handback")
        .group_by(LeaseRow.worker_id)
    )
    return {worker_id: count for worker_id, count in session.execute(query)}


def _current_trials(
    session: Session, allowed: frozenset[str] | None
) -> dict[int, list[CurrentTrial]]:
    """Active leases by worker, with the study, number and world size of each leased trial."""
    query = (
        select(
            LeaseRow.worker_id,
            LeaseRow.trial_id,
            LeaseRow.attempt,
            TrialRow.number,
            StudyRow.name,
            TrialRow.plan,
            LeaseRow.started_at,
        )
        .outerjoin(TrialRow, TrialRow.trial_id == LeaseRow.trial_id)
        .outerjoin(StudyRow, StudyRow.study_id == TrialRow.study_id)
        .where(LeaseRow.active.is_(True))
        .order_by(LeaseRow.id)
    )
    if allowed is not None:
        query = query.where(StudyRow.name.in_(allowed))
    found: dict[int, list[CurrentTrial]] = defaultdict(list)
    for worker_id, trial_id, attempt, number, study, plan, started_at in session.execute(query):
        # The stored plan is this attempt's once its lease started; before, an earlier
        # attempt's (a retry after an OOM) or none: the trial holds one card while planned.
        world_size = _world_size(plan) if started_at is not None else 1
        found[worker_id].append(
            CurrentTrial(
                study=study,
                number=number,
                trial_id=trial_id,
                attempt=attempt,
                world_size=world_size,
            )
        )
    return found


def _world_size(plan: object) -> int:
    """A stored plan's world size; 1 before a plan is started (or on rows from before ranks)."""
    size = plan.get("world_size", 1) if isinstance(plan, dict) else 1
    return size if isinstance(size, int) and size >= 1 else 1


def _totals(
    session: Session, shown: ColumnElement[bool], rank: ColumnElement[int], running: int
) -> FleetTotals:
    """Over every worker shown, not one page: counts by state, live memory and card models."""
    # Grouped over a subquery: PostgreSQL would not match a CASE with bound parameters in
    # GROUP BY to the same CASE in the select list.
    ranked = select(rank.label("rank"), WorkerRow.total_bytes, WorkerRow.free_bytes).where(shown)
    sub = ranked.subquery()
    sums = (func.sum(sub.c.total_bytes), func.sum(sub.c.free_bytes))
    by_rank = select(sub.c.rank, func.count(), *sums)
    counts = {state: 0 for state in _RANKS}
    total_bytes = free_bytes = 0
    for index, count, total, free in session.execute(by_rank.group_by(sub.c.rank)):
        counts[_RANKS[index]] = int(count)
        if index == 0:  # memory of live workers only
            total_bytes, free_bytes = int(total or 0), int(free or 0)
    models = select(WorkerRow.card_model, func.count()).where(shown, rank == 0)
    live_models = session.execute(models.group_by(WorkerRow.card_model))
    return FleetTotals(
        workers=dict(counts),
        total_bytes=total_bytes,
        free_bytes=free_bytes,
        running_trials=running,
        card_models={model: int(n) for model, n in live_models},
    )
