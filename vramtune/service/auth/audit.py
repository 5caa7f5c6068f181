"""The audit log: who created or revoked a token, deleted, paused or resumed a study.

Each event is written twice, on purpose: as a row of ``vramtune_audit`` in the transaction that
makes the change (so the record exists exactly when the change does, and ``GET /api/v1/audit``
or SQL can answer "who deleted this study?" long after logs have rotated), and as a structured
log line on the ``vramtune.audit`` logger (``vramtune.common.logs.log_event``), for log shippers and
alerting. The line is written after the row is flushed; a transaction that then fails to
commit leaves a log line without its row, never a change without its row.
"""

from __future__ import annotations

import getpass
import logging
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import select
from sqlalchemy.orm import Session

from vramtune.common.logs import log_event
from vramtune.service.db.tables import AuditRow

log = logging.getLogger("vramtune.audit")

AuditEvent = Literal[
    "token_created", "token_revoked", "study_deleted", "study_paused", "study_resumed"
]


def command_line_actor() -> str:
    """The actor of an admin command run on the database directly (``vramtune token ...``)."""
    try:
        return f"cli:{getpass.getuser()}"
    except (KeyError, OSError):  # no user name for this uid (a bare container)
        return "cli"


def record(
    session: Session,
    event: AuditEvent,
    actor: str,
    token_id: int | None,
    target: str,
    now: datetime,
    **detail: Any,
) -> AuditRow:
    """Add one audit event, at ``now``, to the session's transaction and log it."""
    row = AuditRow(
        at=now,
        event=event,
        token_id=token_id,
        actor=actor[:128],
        target=target[:256],
        detail=detail,
    )
    session.add(row)
    session.flush()
    log_event(log, event, actor=actor, token_id=token_id, target=target, **detail)
    return row


def recent(session: Session, limit: int, before: int | None = None) -> list[AuditRow]:
    """The newest events first, ``before`` an id for the next page."""
    query = select(AuditRow).order_by(AuditRow.id.desc()).limit(limit)
    if before is not None:
        query = query.where(AuditRow.id < before)
    return list(session.scalars(query))
