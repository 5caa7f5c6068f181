"""Migration 0011's ``vramtune_leases.started_at``: a lease granted before it counts as started,
so that a trial running across the upgrade keeps its result (issue 30), on SQLite and
PostgreSQL. The refusal itself is tested over HTTP in tests/service/test_fleet_protocol.py."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
import sqlalchemy as sa
from alembic.command import downgrade
from sqlalchemy.engine import Engine

from vramtune.service.db.engine import make_engine, make_sessions
from vramtune.service.db.migrate import alembic_config, current_revision, head_revision, upgrade
from vramtune.service.db.tables import LeaseRow, WorkerRow
from vramtune.service.db.writes import insert_row
from vramtune.service.state import utcnow


@pytest.fixture
def engine(migrated_url: str) -> Iterator[Engine]:
    made = make_engine(migrated_url)
    yield made
    made.dispose()


def hold_a_lease(engine: Engine) -> None:
    """One worker holding one lease it has not started."""
    now = utcnow()
    card = {"model": "m", "total_bytes": 1, "free_bytes": 1}
    with make_sessions(engine).begin() as session:
        worker = WorkerRow(
            name="w", device="cpu", card_model="m", total_bytes=1, free_bytes=1, card=card,
            constants={}, tasks=["t"], registered_at=now, last_heartbeat=now,
        )  # fmt: skip
        session.add(worker)
        session.flush()
        insert_row(
            session, LeaseRow, token="t" * 43, trial_id=1, worker_id=worker.id, attempt=0,
            active=True, expires_at=now + timedelta(minutes=1), created_at=now,
        )  # fmt: skip


def started_and_granted(engine: Engine) -> list[tuple[object, object]]:
    with engine.connect() as connection:
        query = sa.text("SELECT started_at, created_at FROM vramtune_leases")
        return [tuple(row) for row in connection.execute(query)]


def test_a_lease_granted_before_migration_0011_counts_as_started(engine: Engine) -> None:
    assert current_revision(engine) == head_revision()
    hold_a_lease(engine)
    [(started, granted)] = started_and_granted(engine)
    assert started is None and granted is not None  # granted at head: not started yet
    downgrade(alembic_config(engine), "0010")
    upgrade(engine)
    assert current_revision(engine) == head_revision()
    assert started_and_granted(engine) == [(granted, granted)]
