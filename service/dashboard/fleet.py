"""The fleet: workers, their cards, what they run, and which have gone quiet."""

from __future__ import annotations

from collections import Counter, defaultdict
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.dashboard import schema
from service.dashboard.models import CurrentTrial, Fleet, FleetTotals, FleetWorker, WorkerState
from service.db.tables import LeaseRow, StudyRow, TrialRow, WorkerRow
from service.settings import Settings

MAX_WORKERS = 2000
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
    session: Session, settings: Settings, now: datetime, allowed: frozenset[str] | None = None
) -> Fleet:
    """Every worker, newest heartbeat first, with the trials it holds leases on.

    ``allowed``: the studies of a study-limited token, which sees only the workers running
    their trials, and only those trials (as GET /api/v1/workers).
    """
    stale_s, lost_s = thresholds(settings)
    current = _current_trials(session, allowed)
    query = select(WorkerRow).order_by(WorkerRow.last_heartbeat.desc()).limit(MAX_WORKERS)
    if allowed is not None:
        query = query.where(WorkerRow.id.in_(current))
    rows = list(session.scalars(query))
    runs = _runs(session, [w.id for w in rows])
    workers = [
        _worker(w, current.get(w.id, []), runs.get(w.id, 0), now, stale_s, lost_s) for w in rows
    ]
    return Fleet(
        workers=workers,
        totals=_totals(workers),
        stale_after_s=stale_s,
        lost_after_s=lost_s,
        now=schema.utc(now),
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
    """Active leases by worker, with the study and number of each leased trial."""
    query = (
        select(
            LeaseRow.worker_id, LeaseRow.trial_id, LeaseRow.attempt, TrialRow.number, StudyRow.name
        )
        .outerjoin(TrialRow, TrialRow.trial_id == LeaseRow.trial_id)
        .outerjoin(StudyRow, StudyRow.study_id == TrialRow.study_id)
        .where(LeaseRow.active.is_(True))
        .order_by(LeaseRow.id)
    )
    if allowed is not None:
        query = query.where(StudyRow.name.in_(allowed))
    found: dict[int, list[CurrentTrial]] = defaultdict(list)
    for worker_id, trial_id, attempt, number, study in session.execute(query):
        found[worker_id].append(
            CurrentTrial(study=study, number=number, trial_id=trial_id, attempt=attempt)
        )
    return found


def _totals(workers: list[FleetWorker]) -> FleetTotals:
    live = [w for w in workers if w.state == "live"]
    return FleetTotals(
        workers={
            state: sum(w.state == state for w in workers)
            for state in ("live", "stale", "lost", "stopped")
        },
        total_bytes=sum(w.total_bytes for w in live),
        free_bytes=sum(w.free_bytes for w in live),
        running_trials=sum(len(w.current) for w in workers),
        card_models=dict(Counter(w.card_model for w in live)),
    )
