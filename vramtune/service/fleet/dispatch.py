"""Dispatch: which trial a worker that asks for work gets, and its lease; helpers never commit.

A trial that waits for a card of this size is offered first; else the study's sampler is asked
(on an in-memory draft, service.optuna.drafts) and the new trial is written with its lease in
one ``fleet_transaction`` (vramtune.service.fleet.workers).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from weakref import WeakKeyDictionary

from optuna.storages import BaseStorage
from optuna.trial import FrozenTrial
from sqlalchemy import bindparam, case, func, or_, select
from sqlalchemy.orm import Session

from vramtune.service.db.tables import (
    LeaseRow,
    MemoryObservationRow,
    StudyRow,
    TrialRow,
    WorkerRow,
)
from vramtune.service.errors import Invalid
from vramtune.service.fleet import predictions
from vramtune.service.fleet.leases import grant
from vramtune.service.fleet.routing import believed, largest_card, live_cards, plans_on
from vramtune.service.fleet.workers import (
    fleet_transaction,
    free_bytes_error,
    heard_from,
    running_worker,
)
from vramtune.service.metrics import phase
from vramtune.service.optuna import rows as optuna_rows
from vramtune.service.optuna.drafts import draft_trials
from vramtune.service.optuna.glue import asked_trial, spec_of, strategy
from vramtune.service.state import AppState
from vramtune.service.wire import Assignment, NextRequest, PlanOut

# Samplers asked ahead of the workers: one transaction asks several, and the extra ones wait
# as pending trials (RUNNING in Optuna) for the next calls. Random and quasi-Monte Carlo lose
# nothing (they do not read the study's trials): as many as half the live workers of the
# study's task, at most ASK_AHEAD_MAX, a lone worker asking one at a time. (Half the workers
# holding a lease, as before, shrank under load, when most workers were waiting in ``next``.)
# TPE asks for the calls that want a trial now only (the study's _Flight demand), and a
# batch shares one Parzen fit on the history as it began (service.optuna.tpe: its drafts are
# not lied about to each other; trials asked before are, constant liar). The other samplers
# see each result before they propose again: one at a time, side by side.
ASK_AHEAD_SAMPLERS = frozenset({"random", "qmc", "tpe"})
HISTORY_FREE_SAMPLERS = frozenset({"random", "qmc"})
ASK_AHEAD_MAX = 16


@dataclass
class _Call:
    """One ``next`` call: who asks, when, and the live fleet, read once for the call."""

    state: AppState
    worker_id: int
    now: datetime
    free_cards: int | None = None  # NextRequest.free_cards: None, all the worker's cards
    cards: dict[int, dict[int, int]] = field(default_factory=dict)

    def placeable(self, worker: WorkerRow) -> int:
        """How many cards a trial offered now may use: the node's free ones (routing counts
        all its cards, since a trial that waits for them is placed once they are free)."""
        return worker.cards if self.free_cards is None else min(worker.cards, self.free_cards)

    def live_cards(self, session: Session, study: StudyRow) -> dict[int, int]:
        """The live workers that may lease the study's trials and their card sizes
        (routing.live_cards), cached."""
        if study.study_id not in self.cards:
            settings = self.state.settings
            self.cards[study.study_id] = live_cards(
                session, study, self.now, settings.worker_stale_s, settings.max_card_bytes
            )
        return self.cards[study.study_id]


def next_assignment(
    state: AppState,
    worker_id: int,
    body: NextRequest,
    now: datetime,
    allowed: frozenset[str] | None = None,
    token_id: int | None = None,
) -> Assignment | None:
    """Lease the worker a trial: a re-offered one that fits its card, else a new ask; or None.

    ``allowed``: the study names the caller's token is limited to (None: every study);
    ``token_id``: the caller's token, which must be the worker's. The sampler runs between
    two transactions, holding neither a lock nor a connection.
    """
    call = _Call(state, worker_id, now, body.free_cards)
    with fleet_transaction(state, "next") as session, phase("next", "offer"):
        worker = running_worker(session, worker_id, token_id)
        check_free_bytes(worker, body.free_bytes)
        check_free_cards(worker, body.free_cards)
        worker.free_bytes = body.free_bytes
        heard_from(worker, now, state.settings.worker_stale_s)
        if holds_its_share(session, worker):
            return None
        studies = _open_studies(session, worker.tasks, allowed)
        studies = [row for row in studies if not _holds_study_share(session, worker, row, call)]
        offered = _offered(session, worker, studies, state.settings.max_card_bytes, call)
        if offered is not None:
            study = next(row for row in studies if row.study_id == offered.study_id)
            return _lease(session, call, study, offered, worker)
        askable = [
            (row, number, _ask_count(session, call, row, left))
            for row, number, left in _budgets_left(session, studies)
        ]
    for row, number, count in askable:
        assignment = _ask(call, row, number, count)
        if assignment is not None:
            return assignment
    return None


@dataclass
class _Flight:
    """The asks of one study in this process: one thread drafts and inserts at a time.

    Threads that find no pending trial while another is asking wait here, holding no
    connection, and are drafted for: the asker asks one trial for each call of the process
    that wants one of the study now (``demand``: those waiting, and those that woke from the
    last ask and look for its trials; counting only the waiting, a TPE batch stayed at one
    trial, 0.8x raw on the 10k-trial cell, as the woken raced the next asker). Without it they
    all queued on Optuna's study-row lock, and each then leased the trial it found under that
    lock, one after the other (at 16 workers, ~130 ms of a ~220 ms ``next``; the ``study_lock``
    phase of service.metrics.PHASE_SECONDS). Replicas still serialize on the lock, one asker
    per process.
    """

    changed: threading.Condition = field(default_factory=threading.Condition)
    asking: bool = False
    demand: int = 0  # calls of this process in ``_ask`` for the study now, the asker included


_flights: WeakKeyDictionary[BaseStorage, dict[int, _Flight]] = WeakKeyDictionary()
_flights_lock = threading.Lock()
FLIGHT_WAIT_S = 30.0  # as long as a pooled connection is waited for
FLIGHT_ROUNDS = 3  # a waiter that finds the trials asked for it taken waits for the next ask


def _flight(state: AppState, study_id: int) -> _Flight:
    """The study's flight in this process (per storage: tests run several apps in one)."""
    with _flights_lock:
        return _flights.setdefault(state.storage, {}).setdefault(study_id, _Flight())


def _ask(call: _Call, row: StudyRow, number: int, count: int) -> Assignment | None:
    """Lease a new trial of the study: ask it, or take one a concurrent ask made for us.

    Samplers that read the history (not ASK_AHEAD_SAMPLERS) ask one trial per call, side by side.
    """
    if spec_of(row).sampler.name not in ASK_AHEAD_SAMPLERS:
        return _draft_and_insert(call, row, number, count)
    flight = _flight(call.state, row.study_id)
    with flight.changed:
        flight.demand += 1
    try:
        return _ask_in_flight(call, row, number, count, flight)
    finally:
        with flight.changed:
            flight.demand -= 1


def _ask_in_flight(
    call: _Call, row: StudyRow, number: int, count: int, flight: _Flight
) -> Assignment | None:
    """``_ask`` for the samplers asked ahead: wait for the study's asker, or be it."""
    for _ in range(FLIGHT_ROUNDS):
        with flight.changed:
            joined = flight.asking
            if joined:
                with phase("next", "wait_ask"):
                    flight.changed.wait_for(lambda: not flight.asking, FLIGHT_WAIT_S)
            else:
                flight.asking = True
        if not joined:
            try:
                return _draft_and_insert(call, row, number, count, flight)
            finally:
                with flight.changed:
                    flight.asking = False
                    flight.changed.notify_all()
        with fleet_transaction(call.state, "next") as session, phase("next", "offer"):
            worker = running_worker(session, call.worker_id)
            if holds_its_share(session, worker) or _holds_study_share(session, worker, row, call):
                return None
            offered = _offered(session, worker, [row], call.state.settings.max_card_bytes, call)
            if offered is not None:
                return _lease(session, call, row, offered, worker)
    return _draft_and_insert(call, row, number, count)


def _draft_and_insert(
    call: _Call, row: StudyRow, number: int, count: int, flight: _Flight | None = None
) -> Assignment | None:
    """Draft ``count`` trials (with a flight: one per call of its demand, if more), insert
    them, lease the first."""
    if flight is not None:  # one for each call of this process that wants a trial now
        with flight.changed:
            count = min(max(count, flight.demand), ASK_AHEAD_MAX)
    storage = call.state.storage
    how = strategy(storage, row)
    try:
        with phase("next", "draft"):
            drafts = draft_trials(
                storage, row.study_id, row.name, how.sampler, how.space, number, count
            )
    except KeyError:  # deleted from Optuna underneath; the other studies may have work
        return None
    with fleet_transaction(call.state, "next") as session, phase("next", "insert"):
        worker = running_worker(session, call.worker_id)
        if holds_its_share(session, worker) or _holds_study_share(session, worker, row, call):
            return None  # a concurrent next of this worker leased meanwhile: drafts dropped
        bound = call.state.settings.max_card_bytes
        asked = _record_asked(session, worker, row, drafts, call, bound)
        if asked:
            return _lease(session, call, row, asked[0], worker)
    return None


LEASES_AHEAD = 1
"""Leases a worker may hold beyond its slots: the trial it plans ahead (--plan-ahead)."""


def holds_its_share(session: Session, worker: WorkerRow) -> bool:
    """Whether the worker holds as many leases as it may (its slots and one ahead): it gets no
    more, so that one worker cannot lease a study's every trial and keep them by heartbeats.

    The worker's row is locked first (PostgreSQL): two ``next`` calls of one worker count and
    lease in turn, never both under the cap at once.
    """
    session.execute(_LOCK_WORKER, {"worker_id": worker.id})
    held = session.scalar(_ACTIVE_LEASES, {"worker_id": worker.id}) or 0
    return held >= worker.slots + LEASES_AHEAD


def study_share(session: Session, worker: WorkerRow, study: StudyRow, bound: int) -> int:
    """Leases of one study the worker may hold at once, one leased ahead included.

    Slots are the worker's word: one that registered 64 leased 29 of a study's 30 trials
    (issue 47). So a study gets one trial a card; a study that allows packing, more only as
    far as the server's own record says the card holds them: the card as routing believes it
    (``believed``) over the largest peak measured on the study's own trials, at most the
    slots. Before its first measured run a study packs nothing.
    """
    per_card = 1
    if worker.slots > 1 and spec_of(study).memory_policy.allow_packing:
        peak = session.scalar(_STUDY_PEAK, {"study_id": study.study_id}) or 0
        card = believed(session, {worker.id: worker.total_bytes}, bound)[worker.id]
        per_card = max(1, min(worker.slots, card // peak)) if peak > 0 else 1
    return min(worker.slots, worker.cards * per_card) + LEASES_AHEAD


def _holds_study_share(session: Session, worker: WorkerRow, study: StudyRow, call: _Call) -> bool:
    """Whether the worker holds as many of the study's leases as ``study_share`` allows."""
    held = session.scalar(_STUDY_LEASES, {"worker_id": worker.id, "study_id": study.study_id})
    return (held or 0) >= study_share(session, worker, study, call.state.settings.max_card_bytes)


def check_free_cards(worker: WorkerRow, free_cards: int | None) -> None:
    """422 for more free cards than the worker registered."""
    if free_cards is not None and free_cards > worker.cards:
        message = f"{free_cards} is more than the {worker.cards} cards this worker registered"
        raise Invalid("free_cards", message)


def check_free_bytes(worker: WorkerRow, free_bytes: int) -> None:
    """422 for free bytes beyond the worker's registered card: they would lease it trials
    that no card of its size can hold."""
    refused = free_bytes_error(free_bytes, worker.total_bytes)
    if refused is not None:
        raise refused


def _lease(
    session: Session, call: _Call, row: StudyRow, trial: TrialRow, worker: WorkerRow
) -> Assignment:
    """Grant the worker a lease on the trial of the study ``row``; the assignment it gets."""
    with phase("next", "lease"):
        return _assignment(session, call, row, trial, worker)


def _assignment(
    session: Session, call: _Call, row: StudyRow, trial: TrialRow, worker: WorkerRow
) -> Assignment:
    lease = grant(session, trial, worker, call.now, call.state.settings.lease_ttl_s)
    session.flush()  # the trials asked in this transaction, inserted (the first one leased)
    spec = spec_of(row)
    params = asked_trial(call.state.storage, row, trial).params
    config = {**spec.task_config, **params}
    return Assignment(
        trial_id=trial.trial_id,
        number=trial.number,
        attempt=trial.attempt,
        lease=lease.token,
        lease_expires_at=lease.expires_at,
        study=row.name,
        task=row.task,
        params=params,
        task_config=spec.task_config,
        budget=spec.budget,
        memory_policy=spec.memory_policy,
        n_objectives=len(spec.objective_directions),
        minimize_peak_memory=spec.minimize_peak_memory,
        plans_tried=[
            PlanOut.model_validate(plan) for plan in plans_on(trial.plans_tried, worker.card_model)
        ],
        predictions=predictions.shared_for(session, worker, row.task, config, row),
        larger_card_bytes=_larger_card(session, call, worker, row),
        distributed=spec.distributed,
        min_world_size=trial.min_world_size,
    )


def _larger_card(session: Session, call: _Call, worker: WorkerRow, study: StudyRow) -> int | None:
    """The largest live card of another worker that may lease the study's trials, when larger
    than this worker's (vramtune/worker/plan/time_routing.py hands a slow resize back to it)."""
    largest = largest_card(call.live_cards(session, study), exclude=worker.id)
    return largest if largest > worker.total_bytes else None


# The statements of a ``next``, built once with bound parameters: built per call, their
# construction and cache keys were ~19 % of the server's CPU at 4 workers (py-spy,
# bench/results/service_profile.md); SQLAlchemy memoizes both on a statement object.
_OPEN_STUDIES = (
    select(StudyRow)
    .where(StudyRow.paused.is_(False), StudyRow.task.in_(bindparam("tasks", expanding=True)))
    .order_by(StudyRow.created_at, StudyRow.study_id)
)
_OPEN_ALLOWED_STUDIES = _OPEN_STUDIES.where(StudyRow.name.in_(bindparam("allowed", expanding=True)))
_OFFERED = (
    select(TrialRow)
    .where(
        TrialRow.study_id.in_(bindparam("study_ids", expanding=True)),
        TrialRow.status.in_(("pending", "waiting")),
        TrialRow.min_bytes <= bindparam("card_bytes"),
        TrialRow.min_world_size <= bindparam("cards"),
        # a waiting trial is not offered back to the card that handed it back
        or_(TrialRow.status == "pending", TrialRow.worker_id != bindparam("worker_id")),
    )
    .order_by(
        case((TrialRow.status == "waiting", 0), else_=1), TrialRow.updated_at, TrialRow.trial_id
    )
    .limit(1)
    .with_for_update(skip_locked=True)  # replicas take different trials, never the same
)
_LOCK_WORKER = select(WorkerRow.id).where(WorkerRow.id == bindparam("worker_id")).with_for_update()
_ACTIVE_LEASES = select(func.count()).where(
    LeaseRow.worker_id == bindparam("worker_id"), LeaseRow.active.is_(True)
)
_STUDY_LEASES = (
    select(func.count())
    .select_from(LeaseRow)
    .join(TrialRow, TrialRow.trial_id == LeaseRow.trial_id)
    .where(
        LeaseRow.worker_id == bindparam("worker_id"),
        LeaseRow.active.is_(True),
        TrialRow.study_id == bindparam("study_id"),
    )
)
# Through the study's own trial rows: SQLite reuses a deleted study's id, and the fleet's
# observations outlive their study.
_STUDY_PEAK = select(
    func.max(
        func.coalesce(
            MemoryObservationRow.measured_reserved, MemoryObservationRow.measured_allocated
        )
    ),
).where(
    MemoryObservationRow.trial_id.in_(
        select(TrialRow.trial_id).where(TrialRow.study_id == bindparam("study_id"))
    ),
    MemoryObservationRow.outcome == "complete",
)
_COUNTS = select(
    optuna_rows.count_trials_query(bindparam("study_id")),
    select(func.count())
    .select_from(TrialRow)
    .where(TrialRow.study_id == bindparam("study_id"))
    .scalar_subquery(),
)
_LOCK_UNPAUSED = (
    optuna_rows.lock_study_query(bindparam("study_id"))
    .join(StudyRow, StudyRow.study_id == bindparam("study_id"))
    .where(StudyRow.paused.is_(False))
)


def _open_studies(
    session: Session, tasks: Sequence[str], allowed: frozenset[str] | None
) -> list[StudyRow]:
    """Unpaused studies of the tasks a worker runs, oldest first (a queue of studies)."""
    if allowed is None:
        return list(session.scalars(_OPEN_STUDIES, {"tasks": list(tasks)}))
    params = {"tasks": list(tasks), "allowed": sorted(allowed)}
    return list(session.scalars(_OPEN_ALLOWED_STUDIES, params))


def _offered(
    session: Session,
    worker: WorkerRow,
    studies: Sequence[StudyRow],
    believe_up_to: int,
    call: _Call,
) -> TrialRow | None:
    """A pending or waiting trial this card (or the free cards of this node) can hold, as
    routing believes its size (routing.believed); waiting ones (for a larger card) first."""
    if not studies:
        return None
    card_bytes = believed(session, {worker.id: worker.total_bytes}, believe_up_to)[worker.id]
    params = {
        "study_ids": [row.study_id for row in studies],
        "card_bytes": card_bytes,
        "cards": call.placeable(worker),
        "worker_id": worker.id,
    }
    return session.scalar(_OFFERED, params)


def _budgets_left(session: Session, studies: Sequence[StudyRow]) -> list[tuple[StudyRow, int, int]]:
    """The studies that have trials of their budget left to ask: (row, the number Optuna
    gives its next trial, how many are left)."""
    counted = [(row, *_counts(session, row)) for row in studies]
    return [(row, number, left) for row, number, left in counted if left > 0]


def _counts(session: Session, row: StudyRow) -> tuple[int, int]:
    """The study's trials in Optuna (the number of the next one) and those of its budget not
    asked yet (vramtune asks every trial of its studies), in one statement."""
    numbered, asked = session.execute(_COUNTS, {"study_id": row.study_id}).one()
    return int(numbered or 0), spec_of(row).n_trials - int(asked or 0)


def _ask_count(session: Session, call: _Call, row: StudyRow, left: int) -> int:
    """How many trials to ask in one go (see ASK_AHEAD_SAMPLERS), within the budget left."""
    if spec_of(row).sampler.name not in HISTORY_FREE_SAMPLERS:
        return 1  # TPE: one, and one per waiter (_draft_and_insert)
    workers = len(call.live_cards(session, row))
    return max(1, min(left, ASK_AHEAD_MAX, workers // 2))


def _lock_unpaused(session: Session, study_id: int) -> bool:
    """Optuna's study row locked (optuna_rows.lock_study) if the study is not paused: one
    statement for both."""
    return session.execute(_LOCK_UNPAUSED, {"study_id": study_id}).first() is not None


def _record_asked(
    session: Session,
    worker: WorkerRow,
    study: StudyRow,
    drafts: Sequence[FrozenTrial],
    call: _Call,
    believe_up_to: int,
) -> list[TrialRow]:
    """Insert drafted trials, Optuna's rows and vramtune's, as far as the budget still allows.

    Optuna's study row is locked until commit: replicas number and count one ask at a time,
    for the few statements of the insert only (the sampler ran before). The trials are
    pending: the caller leases the first, the next calls are offered the others.

    An ask that finds, once it holds the lock, a trial another ask inserted meanwhile leases
    that one (it waited longer) and still inserts its drafts: they wait as pending trials for
    the next calls. Dropping them kept the pool of pending trials empty under load, so that
    every ``next`` queued on the lock (vramtune.service.fleet.dispatch._Flight).
    """
    study_id = study.study_id
    with phase("next", "study_lock"):
        if not _lock_unpaused(session, study_id):
            return []  # paused or deleted meanwhile
    inserted_meanwhile = _offered(session, worker, [study], believe_up_to, call)
    now = call.now
    first, left = _counts(session, study)
    asked = optuna_rows.insert_trials(session, study_id, drafts[: max(left, 0)], now, first)
    trials = [
        TrialRow(
            trial_id=trial._trial_id,
            study_id=study_id,
            number=trial.number,
            status="pending",
            attempt=0,
            min_bytes=0,
            params=trial.params,
            plans_tried=[],
            updated_at=now,
        )
        for trial in asked
    ]
    session.add_all(trials)
    return trials if inserted_meanwhile is None else [inserted_meanwhile, *trials]
