"""Heartbeats, coalesced: the heartbeats that arrive together share one short transaction.

As one locking transaction each (seven statements, the worker's leases read ``FOR UPDATE``),
256 workers heartbeating every 5 s cost ~57 % of a core (bench/results/service_throughput.md).
Here a heartbeat waits, on the event loop and holding no thread, for the next batch; a batch
is one transaction of four statements whatever its size: read the workers, renew the leases of
the trials they list (a plain ``UPDATE`` of the expiry, no lock taken beforehand), read back
what their stop orders need, stamp the workers. The answer is sent once that has committed,
so a heartbeat answered 200 has renewed its leases, as before.

A renewal does not check the expiry: a lease is lost when the reaper ends it, not before
(service.fleet.leases), so a lease that expired unnoticed, e.g. while the database was away, is
renewed by the worker that still runs its trial. One the reaper has ended is not renewed, and
the answer orders its trial stopped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, or_, select, tuple_, update
from sqlalchemy.exc import OperationalError, TimeoutError as PoolTimeout
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import ColumnElement

from vramtune.service.db.tables import MAX_ROW_ID, LeaseRow, StudyRow, TrialRow, WorkerRow
from vramtune.service.errors import DomainError
from vramtune.service.fleet.workers import (
    fleet_transaction,
    foreign_error,
    free_bytes_error,
    owns,
    stopped_error,
    unknown_error,
)
from vramtune.service.state import AppState
from vramtune.service.wire import Heartbeat, HeartbeatReply, StopOrder, StopReason

# How long a batch gathers heartbeats before it is written: a heartbeat is answered that much
# later (workers send one every few seconds; nothing waits on the answer), and 256 workers
# every 5 s share one transaction per ~2.5 heartbeats.
BATCH_WINDOW_S = 0.5


@dataclass(frozen=True)
class _Beat:
    worker_id: int
    body: Heartbeat
    token_id: int | None  # the calling token (None: auth off); it must have registered the worker


@dataclass
class _Worker:
    stopped: bool
    last_heartbeat: datetime
    token_id: int | None
    total_bytes: int


class HeartbeatBatcher:
    """Gathers the heartbeats of a server process and writes them a batch at a time."""

    def __init__(self, state: AppState) -> None:
        self._state = state
        self._pending: list[tuple[_Beat, asyncio.Future[HeartbeatReply]]] = []
        self._writer: asyncio.Task[None] | None = None

    async def beat(self, worker_id: int, body: Heartbeat, token_id: int | None) -> HeartbeatReply:
        """The answer to one heartbeat, once the batch it joined has committed."""
        answer: asyncio.Future[HeartbeatReply] = asyncio.get_running_loop().create_future()
        self._pending.append((_Beat(worker_id, body, token_id), answer))
        if self._writer is None:
            self._writer = asyncio.create_task(self._write_pending(), name="vramtune-heartbeats")
        return await answer

    async def _write_pending(self) -> None:
        """Write batches until none is pending (one writer at a time: batches never overlap)."""
        try:
            while self._pending:
                await asyncio.sleep(BATCH_WINDOW_S)
                batch, self._pending = self._pending, []
                beats = [beat for beat, _ in batch]
                now = self._state.clock()
                answers = await asyncio.to_thread(write_apart, self._state, beats, now)
                for (_, future), answer in zip(batch, answers, strict=True):
                    if future.done():  # its client went away meanwhile
                        continue
                    if isinstance(answer, BaseException):
                        future.set_exception(answer)
                    else:
                        future.set_result(answer)
        finally:
            self._writer = None


def write_apart(
    state: AppState, beats: Sequence[_Beat], now: datetime
) -> list[HeartbeatReply | Exception]:
    """The batch in one transaction; should it fail, each heartbeat in its own, so that one
    that cannot be written fails alone (the database unreachable fails them all at once)."""
    try:
        return [*write_batch(state, beats, now)]
    except Exception as exc:
        if len(beats) == 1 or isinstance(exc, OperationalError | PoolTimeout):
            return [exc] * len(beats)
    return [answer for beat in beats for answer in write_apart(state, [beat], now)]


def write_batch(
    state: AppState, beats: Sequence[_Beat], now: datetime
) -> list[HeartbeatReply | DomainError]:
    """One transaction for a batch of heartbeats; each gets its reply or its 404 / 409."""
    with fleet_transaction(state) as session:
        workers = _workers(session, {b.worker_id for b in beats if b.worker_id <= MAX_ROW_ID})
        running = [b for b in beats if _answer_for(b, workers.get(b.worker_id)) is None]
        _renew(session, running, now + timedelta(seconds=state.settings.lease_ttl_s))
        stops = _stop_orders(session, running, workers)
        _stamp(session, running, now)
    return [
        _answer_for(b, workers.get(b.worker_id)) or HeartbeatReply(stop=stops.get(b.worker_id, []))
        for b in beats
    ]


def _answer_for(beat: _Beat, worker: _Worker | None) -> DomainError | None:
    """The 404, 403 or 409 of a heartbeat that renews nothing; None for one that may."""
    if worker is None:
        return unknown_error(beat.worker_id)
    if not owns(worker.token_id, beat.token_id):
        return foreign_error(beat.worker_id)
    if worker.stopped:
        return stopped_error(beat.worker_id)
    free = beat.body.free_bytes
    return None if free is None else free_bytes_error(free, worker.total_bytes)


def _workers(session: Session, ids: set[int]) -> dict[int, _Worker]:
    query = select(
        WorkerRow.id,
        WorkerRow.stopped,
        WorkerRow.last_heartbeat,
        WorkerRow.token_id,
        WorkerRow.total_bytes,
    )
    rows = session.execute(query.where(WorkerRow.id.in_(ids)))
    return {
        wid: _Worker(stopped, last, token, total)
        for wid, stopped, last, token, total in rows.tuples()
    }


def _listed(beats: Sequence[_Beat]) -> set[tuple[int, int]]:
    """(worker, trial) of every trial the workers list as running (that may exist)."""
    trials = [(b.worker_id, b.body.trials or []) for b in beats]
    return {(w, t) for w, listed in trials for t in listed if t <= MAX_ROW_ID}


def _renew(session: Session, beats: Sequence[_Beat], expires_at: datetime) -> None:
    """Push the expiry of the listed trials' active leases (every lease: a worker lists none)."""
    listed = _listed(beats)
    every = {b.worker_id for b in beats if b.body.trials is None}
    held: list[ColumnElement[bool]] = []
    if listed:
        held.append(tuple_(LeaseRow.worker_id, LeaseRow.trial_id).in_(sorted(listed)))
    if every:
        held.append(LeaseRow.worker_id.in_(sorted(every)))
    if held:
        renewal = update(LeaseRow).where(LeaseRow.active.is_(True), or_(*held))
        session.execute(renewal.values(expires_at=expires_at))


def _stop_orders(
    session: Session, beats: Sequence[_Beat], workers: dict[int, _Worker]
) -> dict[int, list[StopOrder]]:
    """Per worker, the trials it must stop: those the reaper, a prune or a deletion ended,
    and those of paused studies.

    A worker that lists its trials hears of each as long as it lists it; one that lists none
    hears of the leases ended since its previous heartbeat.
    """
    listed = _listed(beats)
    every = {b.worker_id for b in beats if b.body.trials is None}
    since = min((workers[w].last_heartbeat for w in every), default=None)
    held: list[ColumnElement[bool]] = []
    if listed:
        held.append(tuple_(LeaseRow.worker_id, LeaseRow.trial_id).in_(sorted(listed)))
    if every:
        ended = or_(LeaseRow.active.is_(True), LeaseRow.ended_at >= since)
        held.append(and_(LeaseRow.worker_id.in_(sorted(every)), ended))
    if not held:
        return {}
    query = (
        select(
            LeaseRow.worker_id,
            LeaseRow.trial_id,
            LeaseRow.active,
            LeaseRow.ended_at,
            LeaseRow.resolution,
            TrialRow.trial_id.is_not(None),
            StudyRow.paused,
        )
        .outerjoin(TrialRow, TrialRow.trial_id == LeaseRow.trial_id)
        .outerjoin(StudyRow, StudyRow.study_id == TrialRow.study_id)
        .where(or_(*held))
        .order_by(LeaseRow.id)  # a trial leased twice to one worker: the latest lease decides
    )
    latest: dict[tuple[int, int], StopOrder | None] = {}
    for worker_id, trial_id, active, ended_at, how, known, paused in session.execute(query):
        if not active and worker_id in every and ended_at < workers[worker_id].last_heartbeat:
            continue  # heard of at an earlier heartbeat
        reason = _stop_reason(active, known, paused, how)
        latest[(worker_id, trial_id)] = reason and StopOrder(trial_id=trial_id, reason=reason)
    stops: dict[int, list[StopOrder]] = {}
    for (worker_id, _), order in latest.items():
        if order is not None:
            stops.setdefault(worker_id, []).append(order)
    return stops


def _stop_reason(
    active: bool, known: bool, paused: bool | None, how: dict[str, Any] | None
) -> StopReason | None:
    """Why a worker must stop a trial it holds under this lease, if it must."""
    if not active:
        return (how or {}).get("stop")  # None: ended by the worker's own call
    if not known:
        return "deleted"  # its study was deleted underneath
    return "paused" if paused else None


def _stamp(session: Session, beats: Sequence[_Beat], now: datetime) -> None:
    """The workers' last heartbeat, and their free memory where they sent it."""
    rows: dict[int, dict[str, object]] = {}
    for beat in beats:
        row = rows.setdefault(beat.worker_id, {"id": beat.worker_id, "last_heartbeat": now})
        if beat.body.free_bytes is not None:
            row["free_bytes"] = beat.body.free_bytes
    for keys in ({"id", "last_heartbeat"}, {"id", "last_heartbeat", "free_bytes"}):
        same = [row for row in rows.values() if set(row) == keys]
        if same:  # an executemany by primary key, one per set of columns
            session.execute(update(WorkerRow), same)
