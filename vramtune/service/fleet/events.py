"""A trial's story: one event row per call that changed it; helpers never commit.

The calls that move a trial (a lease granted, a plan chosen, a hand-back, an OOM, a pruning
report, a complete or fail, a lease reaped) each add one row, in their own transaction, with
the facts a person reading the trial later needs (which card, which plan, how many bytes).
One INSERT, built once (vramtune.service.db.writes.insert_row): the worker protocol's hot path is
benchmarked, and the story must cost it no more than that.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from sqlalchemy.orm import Session

from vramtune.service.db.tables import TrialEventRow
from vramtune.service.db.writes import insert_row

EventKind = Literal[
    "leased",
    "routed",
    "planned",
    "resized",
    "handed_back",
    "infeasible",
    "oom",
    "interrupted",
    "lease_lost",
    "pruned",
    "completed",
    "failed",
]


def record(session: Session, trial_id: int, kind: EventKind, now: datetime, **detail: Any) -> None:
    """Add one event to the trial's story (``detail``: JSON-ready facts; None values dropped)."""
    facts = {key: value for key, value in detail.items() if value is not None}
    insert_row(session, TrialEventRow, trial_id=trial_id, at=now, kind=kind, detail=facts)
