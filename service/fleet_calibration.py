"""The calibration a worker fetches: fitted from the stored predicted-vs-measured peaks."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.tables import MemoryObservationRow
from service.wire import Calibration

MAX_OBSERVATIONS = 5000  # the newest ones: a fit follows the current torch and driver


def observed_pairs(
    session: Session, card_model: str, torch_version: str, task: str
) -> list[tuple[int, int]]:
    """(predicted, measured) peak bytes of completed runs, newest first."""
    o = MemoryObservationRow
    query = (
        select(o.predicted_reserved, o.measured_reserved, o.measured_allocated)
        .where(
            o.card_model == card_model,
            o.torch_version == torch_version,
            o.task == task,
            o.predicted_reserved.is_not(None),
        )
        .order_by(o.id.desc())
        .limit(MAX_OBSERVATIONS)
    )
    return [
        (predicted, max(reserved or 0, allocated))
        for predicted, reserved, allocated in session.execute(query)
        if predicted is not None
    ]


def calibration_for(
    session: Session, card_model: str, torch_version: str, task: str
) -> Calibration:
    """The fitted correction, or the identity while service.calibration is not installed."""
    pairs = observed_pairs(session, card_model, torch_version, task)
    try:
        from service.calibration import fit_calibration
    except ImportError:
        return Calibration(card_model=card_model, torch_version=torch_version, task=task)
    return fit_calibration(card_model, torch_version, task, pairs)  # type: ignore[no-any-return]
