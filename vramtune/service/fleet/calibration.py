"""What a worker fetches: the memory calibration fitted from stored predicted-vs-measured
peaks, and the step-time model fitted from stored times per step (vramtune.service.step_time)."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session

from vramtune.common.memory import held_peak
from vramtune.service.calibration import Pair, fit_calibration
from vramtune.service.db.tables import MemoryObservationRow, StepTimeObservationRow
from vramtune.service.fleet.trust import FLEET
from vramtune.service.step_time import MAX_OBSERVATIONS as MAX_STEP_TIMES, fit_step_time
from vramtune.service.wire import Calibration, StepTimeFit, StepTimeObservation

MAX_OBSERVATIONS = 5000  # the newest ones: a fit follows the current torch and driver
MIN_FLEET_WORKERS = 2
"""Distinct workers whose runs the fleet-wide correction needs before it departs from the
identity: one worker, broken or hostile, cannot move every worker's plans alone."""


def observed_pairs(
    session: Session,
    card_model: str,
    torch_version: str,
    task: str,
    scopes: Sequence[str] = (FLEET,),
    own_worker: int | None = None,
) -> list[Pair]:
    """(raw predicted, measured) peak bytes of finished runs in ``scopes``, newest first.

    Like against like: where a run reported its training steps' peak beside a training-step
    prediction, those two are the pair, so an evaluation measured apart never reads as a
    training-step miss; older runs' whole-run peaks are paired as they were reported. The
    fleet's own runs count once they come from `MIN_FLEET_WORKERS` distinct workers; those of
    ``own_worker`` (the asking worker) always count for itself, so a fleet of one is corrected
    by its own runs while the correction it teaches others waits for the quorum.
    """
    o = MemoryObservationRow
    query = (
        select(
            o.predicted_allocated,
            o.predicted_reserved,
            o.measured_allocated,
            o.measured_reserved,
            o.predicted_training,
            o.measured_training,
            o.scope,
            o.worker_id,
        )
        .where(
            o.card_model == card_model,
            o.torch_version == torch_version,
            o.task == task,
            o.scope.in_(scopes),
            o.predicted_reserved.is_not(None),
        )
        .order_by(o.id.desc())
        .limit(MAX_OBSERVATIONS)
    )
    rows = session.execute(query).all()
    counted = counted_rows([(scope, worker) for *_, scope, worker in rows], own_worker)
    return [_pair(*row[:6]) for row, counts in zip(rows, counted, strict=True) if counts]


def counted_rows(reporters: Sequence[tuple[str, int | None]], own_worker: int | None) -> list[bool]:
    """Which of the rows reported by (scope, worker) a fit for ``own_worker`` uses: all of them
    once the fleet's come from `MIN_FLEET_WORKERS` distinct workers; before, a study's own
    rows and the asking worker's own, never another lone worker's fleet-wide ones."""
    fleet_workers = {w for scope, w in reporters if scope == FLEET and w is not None}
    quorum = len(fleet_workers) >= MIN_FLEET_WORKERS
    return [
        quorum or scope != FLEET or (own_worker is not None and worker == own_worker)
        for scope, worker in reporters
    ]


def _pair(
    p_alloc: int | None,
    p_reserved: int | None,
    m_alloc: int,
    m_reserved: int | None,
    p_training: int | None,
    m_training: int | None,
) -> Pair:
    """The training steps' pair when both sides have it, else the whole run's."""
    if p_training is not None and m_training is not None:
        return p_training, m_training
    return held_peak(p_alloc or 0, p_reserved), held_peak(m_alloc, m_reserved)


def calibration_for(
    session: Session,
    card_model: str,
    torch_version: str,
    task: str,
    scopes: Sequence[str] = (FLEET,),
    own_worker: int | None = None,
) -> Calibration:
    """The correction fitted to this card model's, torch version's and task's history, as
    taught in ``scopes`` (vramtune.service.fleet.trust), for ``own_worker`` when a worker asks."""
    pairs = observed_pairs(session, card_model, torch_version, task, scopes, own_worker)
    return fit_calibration(card_model, torch_version, task, pairs)


def step_time_for(
    session: Session,
    card_model: str,
    task: str,
    scopes: Sequence[str] = (FLEET,),
    own_worker: int | None = None,
) -> StepTimeFit:
    """The step-time model fitted to this card model's and task's newest measured runs in
    ``scopes``, for ``own_worker`` when a worker asks: the same quorum as the calibration
    (`counted_rows`), then each worker's runs weigh alike and outliers are dropped
    (vramtune.service.step_time.fit_step_time)."""
    row = StepTimeObservationRow
    query = (
        select(row.features, row.scope, row.worker_id)
        .where(row.card_model == card_model, row.task == task, row.scope.in_(scopes))
        .order_by(row.id.desc())
        .limit(MAX_STEP_TIMES)
    )
    rows = session.execute(query).all()
    counted = counted_rows([(scope, worker) for _, scope, worker in rows], own_worker)
    used = [r for r, counts in zip(rows, counted, strict=True) if counts]
    observations = [StepTimeObservation.model_validate(features) for features, *_ in used]
    # Rows stored before worker ids were (migration 0011) share one reporter: None.
    return fit_step_time(card_model, task, observations, [worker for *_, worker in used])
