"""vramtune.service.db.writes: rows written by statements built once, loaded objects kept in step.

On SQLite and PostgreSQL, against the migrated schema: what a trial call writes this way is in
the database after commit, the loaded object reads the new values without being dirty, and a
change the ORM still tracks on another column is flushed as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from vramtune.service.db.engine import make_engine, make_sessions
from vramtune.service.db.tables import LeaseRow, WorkerRow
from vramtune.service.db.writes import insert_row, set_columns

NOW = datetime(2026, 12, 5, 6, 0, 0)


@pytest.fixture
def session(migrated_url: str) -> Iterator[Session]:
    engine = make_engine(migrated_url)
    try:
        with make_sessions(engine)() as session:
            yield session
    finally:
        engine.dispose()


def _worker(session: Session) -> WorkerRow:
    worker = WorkerRow(
        name="w",
        device="cpu",
        card_model="sim",
        total_bytes=1 << 30,
        free_bytes=1 << 30,
        card={},
        constants={},
        tasks=["quadratic"],
        registered_at=NOW,
        last_heartbeat=NOW,
        stopped=False,
        trials_done=0,
        shape_params={},
    )
    session.add(worker)
    session.commit()
    return worker


def _lease(session: Session, worker: WorkerRow, token: str) -> LeaseRow:
    insert_row(
        session,
        LeaseRow,
        token=token,
        trial_id=7,
        worker_id=worker.id,
        attempt=0,
        active=True,
        expires_at=NOW,
        created_at=NOW,
    )
    session.commit()
    return session.scalars(select(LeaseRow).where(LeaseRow.token == token)).one()


def test_insert_row_writes_one_row_with_its_json(session: Session) -> None:
    worker = _worker(session)
    lease = _lease(session, worker, "t1")
    assert (lease.trial_id, lease.worker_id, lease.active) == (7, worker.id, True)
    assert lease.resolution is None


def test_set_columns_writes_and_keeps_the_object_in_step_and_clean(session: Session) -> None:
    worker = _worker(session)
    lease = _lease(session, worker, "t2")
    how = {"call": "complete", "ack": {"resolution": "complete"}}
    set_columns(session, lease, active=False, ended_at=NOW, resolution=how)
    assert (lease.active, lease.ended_at, lease.resolution) == (False, NOW, how)
    assert lease not in session.dirty  # nothing left for the flush to write
    session.commit()
    session.expire_all()
    assert (lease.active, lease.ended_at, lease.resolution) == (False, NOW, how)


def test_set_columns_beside_orm_changes(session: Session) -> None:
    """A tracked change on the same column is replaced by the written value; one on another
    column is still flushed at commit."""
    worker = _worker(session)
    worker.free_bytes = 5  # tracked by the ORM: flushed at commit
    worker.name = "changed by the ORM"  # superseded by set_columns
    set_columns(session, worker, name="written", trials_done=3)
    session.commit()
    session.expire_all()
    assert (worker.name, worker.trials_done, worker.free_bytes) == ("written", 3, 5)


def test_set_columns_refuses_an_object_not_loaded(session: Session) -> None:
    worker = WorkerRow(name="never added")
    with pytest.raises(ValueError, match="loaded from the database"):
        set_columns(session, worker, name="x")
