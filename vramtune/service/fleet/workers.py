"""Workers: they register and leave, and are listed; helpers never commit.

Their heartbeats are vramtune.service.fleet.heartbeats.

What a worker that asks for work gets is vramtune.service.fleet.dispatch.

Each use case runs in one ``fleet_transaction``, which writes Optuna's rows of a trial and
vramtune's together (vramtune.service.optuna.rows): a call either happened whole or not at all. On
PostgreSQL, replicas serialize on row locks (``FOR UPDATE``, ``SKIP LOCKED`` for the offer of a
pending trial); on SQLite those are no-ops, and a process lock serializes the fleet's
transactions instead (SQLite has one writer anyway, and one server process).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal

from sqlalchemy import ColumnElement, bindparam, case, func, select, update
from sqlalchemy.orm import Session

from vramtune.service.db.engine import is_sqlite
from vramtune.service.db.tables import LeaseRow, StudyRow, TokenRow, TrialRow, WorkerRow
from vramtune.service.db.writes import table_of
from vramtune.service.errors import Conflict, Forbidden, Invalid, NotFound, TooMany
from vramtune.service.fleet.leases import active_leases, end, resolution
from vramtune.service.fleet.retirement import make_room, owned_by
from vramtune.service.fleet.routing import reoffer
from vramtune.service.metrics import phase
from vramtune.service.settings import Settings
from vramtune.service.state import AppState
from vramtune.service.wire import CardInfo, WorkerList, WorkerOut, WorkerRegister, WorkerRegistered

log = logging.getLogger("vramtune.fleet")

WorkerState = Literal["live", "stale", "stopped"]

_sqlite_writes = threading.Lock()


@contextmanager
def fleet_transaction(state: AppState, call: str = "other") -> Iterator[Session]:
    """One use case, one transaction; serialized in-process on SQLite (see the module doc).

    The wait for a pooled connection (and its pre-ping) is observed as the call's ``connect``
    phase (vramtune.service.metrics.phase): a pool too small for the fleet shows there.
    """
    lock = _sqlite_writes if is_sqlite(state.settings.database_url) else nullcontext()
    with lock, state.sessions() as session, session.begin():
        with phase(call, "connect"):
            session.connection()
        yield session


# ---------------------------------------------------------------- workers


def register(
    session: Session,
    settings: Settings,
    body: WorkerRegister,
    now: datetime,
    token_id: int | None = None,
) -> WorkerRegistered:
    """Record a worker and its card, bound to the token registering it (None: auth off).

    A token may hold ``settings.max_workers_per_token`` workers: past it, its oldest stopped
    or stale ones are retired (vramtune.service.fleet.retirement), and a token whose workers are all
    live gets a 429, so one leaked or looping token cannot fill the fleet tables. The live
    count reads one index (token_id, stopped).
    """
    if token_id is not None:  # one token's registrations in turn (PostgreSQL): an exact count
        session.execute(select(TokenRow.id).where(TokenRow.id == token_id).with_for_update())
    live = _live_workers_of(session, token_id, now - timedelta(seconds=settings.worker_stale_s))
    if live >= settings.max_workers_per_token:
        raise TooMany(
            f"this token has {live} live workers, the limit (VRAMTUNE_MAX_WORKERS_PER_TOKEN) "
            f"is {settings.max_workers_per_token}: stop some (POST /workers/ID/stop) or wait "
            f"{settings.worker_stale_s:g} s for silent ones to go stale"
        )
    worker = WorkerRow(
        name=body.name,
        device=body.device,
        card_model=body.card.model,
        # A node counts as its smallest card: a rank must fit whichever card it lands on.
        total_bytes=min([body.card.total_bytes, *(c.total_bytes for c in body.cards or [])]),
        free_bytes=body.card.free_bytes,
        card=body.card.model_dump(mode="json"),
        constants=body.constants.model_dump(mode="json"),
        tasks=sorted(set(body.tasks)),
        registered_at=now,
        last_heartbeat=now,
        stopped=False,
        trials_done=0,
        shape_params={task: sorted(set(keys)) for task, keys in body.shape_params.items()},
        batch_params=dict(body.batch_params),
        token_id=token_id,
        slots=body.slots,
        cards=max(1, len(body.cards or [])),
        rungs=None if body.rungs is None else {t: list(r) for t, r in body.rungs.items()},
    )
    session.add(worker)
    session.flush()
    make_room(session, settings, token_id, now, newest=worker.id)
    return WorkerRegistered(
        worker_id=worker.id,
        heartbeat_interval_s=settings.heartbeat_interval_s,
        lease_ttl_s=settings.lease_ttl_s,
    )


def unknown_error(worker_id: int) -> NotFound:
    """What a call of a worker that never registered gets."""
    return NotFound(f"worker {worker_id} not found: register first (POST /workers)")


def stopped_error(worker_id: int) -> Conflict:
    """What a call of a worker that has stopped gets."""
    return Conflict(f"worker {worker_id} has stopped: register again to rejoin")


def foreign_error(worker_id: int) -> Forbidden:
    """What a call with another token than the one that registered the worker gets."""
    return Forbidden(
        f"worker {worker_id} was registered with another token: only that token may act "
        "as this worker or on its trials"
    )


def free_bytes_error(free_bytes: int, total_bytes: int) -> Invalid | None:
    """The 422 for free bytes beyond the card the worker registered (None when within): they
    would lease it trials no card of its size can hold."""
    if free_bytes <= total_bytes:
        return None
    return Invalid(
        "free_bytes",
        f"{free_bytes} is more than the {total_bytes} bytes of the card this worker registered",
    )


def owns(owner: int | None, token_id: int | None) -> bool:
    """Whether the calling token (None: auth off, anyone) may act as a worker it registered."""
    return token_id is None or owner == token_id


def _live_workers_of(session: Session, token_id: int | None, heard_since: datetime) -> int:
    query = select(func.count()).where(
        owned_by(token_id), WorkerRow.stopped.is_(False), WorkerRow.last_heartbeat >= heard_since
    )
    return int(session.scalar(query) or 0)


def check_owner(worker: WorkerRow, token_id: int | None) -> None:
    """Forbidden unless the calling token (None: auth off, anyone) registered the worker."""
    if not owns(worker.token_id, token_id):
        raise foreign_error(worker.id)


def get_worker(session: Session, worker_id: int, token_id: int | None = None) -> WorkerRow:
    """The worker row, if the calling token registered it; NotFound if there is none."""
    worker = session.get(WorkerRow, worker_id)
    if worker is None:
        raise unknown_error(worker_id)
    check_owner(worker, token_id)
    return worker


def running_worker(session: Session, worker_id: int, token_id: int | None = None) -> WorkerRow:
    """The worker row of a worker that has not stopped; Conflict if it has."""
    worker = get_worker(session, worker_id, token_id)
    if worker.stopped:
        raise stopped_error(worker_id)
    return worker


def heard_from(worker: WorkerRow, now: datetime, stale_s: float) -> None:
    """A worker's ``next`` or trial call counts as hearing from it, as a heartbeat does.

    Stamped only once half the stale window has passed since it was last heard from: a worker
    that heartbeats is never stamped here (so the stop orders of a worker that lists no trials,
    which count from its previous heartbeat, are unchanged), and one that only calls costs one
    ``UPDATE`` per half window, written with the call's other changes at commit.
    """
    if (now - worker.last_heartbeat).total_seconds() >= stale_s / 2:
        worker.last_heartbeat = now


# Built once (see service.db.writes); in SQL, so that concurrent completes of a worker all count.
_WORKERS = table_of(WorkerRow)
_COUNT_DONE = (
    update(_WORKERS)
    .where(_WORKERS.c.id == bindparam("worker_id"))
    .values(trials_done=_WORKERS.c.trials_done + 1)
)


def count_done(session: Session, worker: WorkerRow) -> None:
    """One more trial completed by the worker (its loaded count is left as it was read)."""
    session.execute(_COUNT_DONE, {"worker_id": worker.id})


def worker_state(worker: WorkerRow, now: datetime, stale_s: float) -> WorkerState:
    """live, stale (no heartbeat for ``stale_s``) or stopped."""
    if worker.stopped:
        return "stopped"
    return "stale" if (now - worker.last_heartbeat).total_seconds() > stale_s else "live"


def _trials_by_id(session: Session, trial_ids: Sequence[int]) -> dict[int, TrialRow]:
    query = select(TrialRow).where(TrialRow.trial_id.in_(trial_ids))
    return {trial.trial_id: trial for trial in session.scalars(query)}


def stop_worker(
    session: Session, worker_id: int, now: datetime, token_id: int | None = None
) -> None:
    """The worker leaves: its leases end now and their trials are offered again."""
    leases = active_leases(session, worker_id)
    worker = get_worker(session, worker_id, token_id)
    trials = _trials_by_id(session, [lease.trial_id for lease in leases])
    for lease in leases:
        end(session, lease, now, resolution("stop"))
        trial = trials.get(lease.trial_id)
        if trial is not None and trial.status == "leased":
            reoffer(trial, now, next_attempt=False)  # the worker left, the trial did not fail
    worker.stopped = True


def stop_token_workers(session: Session, token_id: int, now: datetime) -> int:
    """Stop every worker a (revoked) token registered; how many were running."""
    query = select(WorkerRow.id).where(WorkerRow.token_id == token_id, WorkerRow.stopped.is_(False))
    worker_ids = list(session.scalars(query.order_by(WorkerRow.id)))
    for worker_id in worker_ids:
        stop_worker(session, worker_id, now)
    return len(worker_ids)


def _done_in(session: Session, studies: frozenset[str], worker_ids: list[int]) -> dict[int, int]:
    """Per worker, the trials of ``studies`` it completed (the last worker of each):
    what a study-limited token is told instead of the worker's count over every study."""
    query = (
        select(TrialRow.worker_id, func.count())
        .join(StudyRow, StudyRow.study_id == TrialRow.study_id)
        .where(
            StudyRow.name.in_(sorted(studies)),
            TrialRow.worker_id.in_(worker_ids),
            TrialRow.status == "done",
            TrialRow.outcome.in_(
                ("as_asked", "resized", "routed")
            ),  # completed (vramtune.common.plans)
        )
        .group_by(TrialRow.worker_id)
    )
    return {int(wid): int(count) for wid, count in session.execute(query) if wid is not None}


def list_workers(
    session: Session,
    settings: Settings,
    now: datetime,
    allowed: frozenset[str] | None = None,
    page: WorkerPage | None = None,
) -> WorkerList:
    """A page of the fleet, live workers first: each with its card, state and the trials it
    holds now.

    ``allowed``: the studies of a study-limited token; then only the workers running trials
    of those studies are listed, with those trials only (what others run is not its to see).
    """
    page = page or WorkerPage()
    current = _held_trials(session, allowed)
    query = select(WorkerRow)
    if allowed is not None:
        query = query.where(WorkerRow.id.in_(current))
    if page.states:
        query = query.where(_in_states(page.states, now, settings.worker_stale_s))
    total = int(session.scalar(select(func.count()).select_from(query.subquery())) or 0)
    order = (_state_rank(now, settings.worker_stale_s), WorkerRow.id)
    rows = list(session.scalars(query.order_by(*order).offset(page.offset).limit(page.limit)))
    done = None if allowed is None else _done_in(session, allowed, [w.id for w in rows])
    return WorkerList(
        workers=[_worker_out(w, current.get(w.id, []), done, now, settings) for w in rows],
        total=total,
        offset=page.offset,
        limit=page.limit,
    )


@dataclass(frozen=True)
class WorkerPage:
    """Which workers a listing shows: those in ``states`` (all when empty), a page of them."""

    states: tuple[WorkerState, ...] = ()
    offset: int = 0
    limit: int = 100


def _held_trials(session: Session, allowed: frozenset[str] | None) -> dict[int, list[int]]:
    """Per worker, the trials it holds an active lease on (of the ``allowed`` studies only)."""
    current: dict[int, list[int]] = {}
    holding = select(LeaseRow.worker_id, LeaseRow.trial_id).where(LeaseRow.active.is_(True))
    if allowed is not None:
        holding = (
            holding.join(TrialRow, TrialRow.trial_id == LeaseRow.trial_id)
            .join(StudyRow, StudyRow.study_id == TrialRow.study_id)
            .where(StudyRow.name.in_(allowed))
        )
    for worker_id, trial_id in session.execute(holding.order_by(LeaseRow.id)):
        current.setdefault(worker_id, []).append(trial_id)
    return current


def _state_rank(now: datetime, stale_s: float) -> ColumnElement[int]:
    """0 live, 1 stale, 2 stopped, in SQL (as worker_state), so a page is cut in that order."""
    silent = WorkerRow.last_heartbeat < now - timedelta(seconds=stale_s)
    return case((WorkerRow.stopped.is_(True), 2), (silent, 1), else_=0)


def _in_states(states: Sequence[WorkerState], now: datetime, stale_s: float) -> ColumnElement[bool]:
    ranks = {"live": 0, "stale": 1, "stopped": 2}
    return _state_rank(now, stale_s).in_(sorted({ranks[state] for state in states}))


def _worker_out(
    w: WorkerRow,
    current: list[int],
    done: dict[int, int] | None,
    now: datetime,
    settings: Settings,
) -> WorkerOut:
    return WorkerOut(
        id=w.id,
        name=w.name,
        device=w.device,
        # Not re-validated: a row written before free_bytes was held to total_bytes must
        # still list (the card was validated when it registered).
        card=CardInfo.model_construct(**{**w.card, "free_bytes": w.free_bytes}),
        tasks=list(w.tasks),
        state=worker_state(w, now, settings.worker_stale_s),
        last_heartbeat=w.last_heartbeat,
        current_trials=current,
        trials_done=w.trials_done if done is None else done.get(w.id, 0),
    )
