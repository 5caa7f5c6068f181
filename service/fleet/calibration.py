"""The calibration a worker fetches: fitted from the stored predicted-vs-measured peaks."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.calibration import Pair, fit_calibration
from service.db.tables import MemoryObservationRow
from service.wire import Calibration

MAX_OBSERVATIONS = 5000  # the newest ones: a fit follows the current torch and driver


def observed_pairs(session: Session, card_model: str, torch_version: str, task: str) -> list[Pair]:
    """(raw predicted, measured) peak bytes of finished runs, newest first."""
    o = MemoryObservationRow
    query = (
        select(
            o.predicted_allocated, o.predicted_reserved, o.measured_allocated, o.measured_reserved
        )
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
        (max(p_alloc or 0, p_reserved or 0), max(m_alloc, m_reserved or 0))
        for p_alloc, p_reserved, m_alloc, m_reserved in session.execute(query)
    ]


def calibration_for(
    session: Session, card_model: str, torch_version: str, task: str
) -> Calibration:
    """The correction fitted to this card model's, torch version's and task's history."""
    pairs = observed_pairs(session, card_model, torch_version, task)
    return fit_calibration(card_model, torch_version, task, pairs)
