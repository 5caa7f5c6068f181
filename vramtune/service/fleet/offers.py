"""What the fleet's registrations say about a study's task before any trial runs.

A worker registers the tasks it runs and, per task, the configuration key holding the batch
size. A study whose search space and task_config both lack that key could only fail every
trial (the worker reads the batch size from it), so its creation is refused with a 422; a
task no live worker offers is accepted (a worker may come later) with a visible warning.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from vramtune.service.db.tables import WorkerRow
from vramtune.service.errors import Invalid

RECENT_REGISTRATIONS = 1000
"""The newest registrations read for a task's batch parameter (the newest names it)."""


def known_batch_param(session: Session, task: str) -> str | None:
    """The batch parameter the newest registration advertising `task` names, if any does."""
    query = (
        select(WorkerRow.batch_params)
        .where(WorkerRow.batch_params.is_not(None))
        .order_by(WorkerRow.id.desc())
        .limit(RECENT_REGISTRATIONS)
    )
    for batch_params in session.scalars(query):
        if isinstance(batch_params, dict) and isinstance(batch_params.get(task), str):
            return str(batch_params[task])
    return None


def check_batch_param(
    session: Session, task: str, search_space: Mapping[str, Any], task_config: Mapping[str, Any]
) -> None:
    """422 naming the batch parameter when a worker says `task` needs it and the study lacks it."""
    param = known_batch_param(session, task)
    if param is None or param in search_space or param in task_config:
        return
    raise Invalid(
        f"search_space.{param}",
        f"task {task!r} reads its batch size from {param!r} (as its workers registered it): "
        f"add {param!r} to the search space, or fix it in task_config",
    )


def live_tasks(session: Session, now: datetime, stale_s: float) -> set[str]:
    """The tasks advertised by workers heard from within `stale_s` and not stopped."""
    query = select(WorkerRow.tasks).where(
        WorkerRow.stopped.is_(False), WorkerRow.last_heartbeat >= now - timedelta(seconds=stale_s)
    )
    return {task for tasks in session.scalars(query) for task in tasks}


def task_warnings(task: str, offered: set[str]) -> list[str]:
    """What may keep a study of `task` from running, given the tasks live workers offer; with
    "did you mean" when a live worker offers a close name (a misspelt task would otherwise
    wait forever). A warning, not a refusal: a worker with the very task may come later, and
    a 422 would refuse a right name that merely resembles another's."""
    if task in offered:
        return []
    close = difflib.get_close_matches(task, sorted(offered), n=3, cutoff=0.75)
    guess = f"; did you mean {' or '.join(repr(name) for name in close)}?" if close else ""
    return [
        f"no live worker offers task {task!r}: its trials wait until a worker advertising it "
        f"registers (vramtune worker --tasks ...){guess}"
    ]


def usable_rungs(session: Session, task: str, now: datetime, stale_s: float) -> set[str] | None:
    """The rungs some worker can use for `task`, as the workers registered them (their tasks'
    and cards': worker/trial/rungs.py): the live ones', else the newest registrations' (a
    study's advice outlives its workers). None when no such worker said (older workers):
    unknown, not none."""
    query = (
        select(WorkerRow.rungs, WorkerRow.stopped, WorkerRow.last_heartbeat)
        .where(WorkerRow.rungs.is_not(None))
        .order_by(WorkerRow.id.desc())
        .limit(RECENT_REGISTRATIONS)
    )
    live: set[str] | None = None
    recent: set[str] | None = None
    for rungs, stopped, heard in session.execute(query):
        offered = rungs.get(task) if isinstance(rungs, dict) else None
        if not isinstance(offered, list):
            continue
        if not stopped and heard >= now - timedelta(seconds=stale_s):
            live = (live or set()) | set(offered)
        recent = (recent or set()) | set(offered)
    return live if live is not None else recent
