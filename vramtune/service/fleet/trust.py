"""Who may teach the fleet: the scope a worker's shared predictions and observations count in.

A worker registered with a token valid for every study (or with auth off) is trusted by the
operator with the whole fleet: what it traces and measures is shared fleet-wide (scope
``fleet``). A worker of a study-limited token is trusted with its own studies only: what it
traces and measures counts for the study of the trial it ran (scope ``study:<id>:<created>``), and a
trial sees the fleet's knowledge plus its own study's. So a token handed to one team cannot
poison the predictions, calibration or step times other studies run with
(docs/concepts/security.md, "Security model").
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from vramtune.service.db.tables import (
    MemoryObservationRow,
    PredictionRow,
    StepTimeObservationRow,
    StudyRow,
    TokenRow,
    WorkerRow,
)

FLEET = "fleet"
"""The scope of knowledge every study uses."""


EPOCH = datetime(1970, 1, 1)


def study_scope(study: StudyRow) -> str:
    """The scope of knowledge only one study uses: its id and creation time (µs, in hex).

    The id alone was reused: SQLite hands a deleted study's id to the next one, which then
    learned from the deleted one's predictions (issue 47). Creation time makes the key one no
    later study has; "study:2147483647:" and 14 hex digits fit the 32-character column.
    """
    micros = (study.created_at.replace(tzinfo=None) - EPOCH) // timedelta(microseconds=1)
    return f"study:{study.study_id}:{micros:x}"


def scopes_of_study(study: StudyRow) -> list[str]:
    """Every scope a study's own knowledge was kept in (the id-only key of before issue 47)."""
    return [study_scope(study), f"study:{study.study_id}"]


def forget_study_knowledge(session: Session, study: StudyRow) -> None:
    """Delete the predictions, memory and step-time observations only this study used, in the
    caller's transaction (the study's deletion): no later study may learn from them."""
    scopes = scopes_of_study(study)
    for table in (PredictionRow, MemoryObservationRow, StepTimeObservationRow):
        session.execute(delete(table).where(table.scope.in_(scopes)))


def teaches_fleet(session: Session, worker: WorkerRow) -> bool:
    """Whether the worker's token is valid for every study (auth off: no token, trusted)."""
    if worker.token_id is None:
        return True
    token = session.get(TokenRow, worker.token_id)
    return token is not None and token.studies is None


def scope_of(session: Session, worker: WorkerRow, study: StudyRow) -> str:
    """Where what the worker learned on a trial of ``study`` counts."""
    return FLEET if teaches_fleet(session, worker) else study_scope(study)


def visible_to_trial(study: StudyRow) -> list[str]:
    """The scopes a trial of ``study`` learns from: the fleet's and its own study's."""
    return [FLEET, study_scope(study)]


def fit_denial(
    session: Session,
    studies: Iterable[str] | None,
    token_id: int | None,
    card_model: str,
    task: str,
) -> str | None:
    """Why a caller limited to ``studies`` may not read the calibration or step time of
    (``card_model``, ``task``), or None: the task must be one its studies run, the card one
    its own workers have or one that ran a trial of its studies. Other teams' tasks and cards
    are not its to see."""
    if studies is None:
        return None
    names = sorted(studies)
    tasks = set(session.scalars(select(StudyRow.task).where(StudyRow.name.in_(names))))
    if task not in tasks:
        return f"task: this token's studies do not run the task {task!r}"
    if not _card_known(session, names, token_id, card_model):
        return f"card_model: no worker of this token or of its studies has the card {card_model!r}"
    return None


def _card_known(session: Session, studies: list[str], token_id: int | None, card: str) -> bool:
    """Whether a worker of the token, or one that ran a trial of ``studies``, has ``card``."""
    own = select(WorkerRow.id).where(WorkerRow.token_id == token_id, WorkerRow.card_model == card)
    ran = (
        select(MemoryObservationRow.id)
        .join(StudyRow, StudyRow.study_id == MemoryObservationRow.study_id)
        .where(StudyRow.name.in_(studies), MemoryObservationRow.card_model == card)
    )
    return session.scalar(own.limit(1)) is not None or session.scalar(ran.limit(1)) is not None
