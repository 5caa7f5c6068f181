"""Training-step and evaluation peaks stored apart (migration 0008) and calibrated like against
like (issue 29 item 4), on SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.command import downgrade
from sqlalchemy.engine import Engine

from vramtune.service.db.engine import make_engine, make_sessions
from vramtune.service.db.migrate import alembic_config, current_revision, head_revision, upgrade
from vramtune.service.db.tables import MemoryObservationRow
from vramtune.service.db.writes import insert_row
from vramtune.service.fleet.calibration import calibration_for
from vramtune.service.state import utcnow

NEW_COLUMNS = {
    "predicted_training",
    "predicted_evaluation",
    "measured_training",
    "measured_evaluation",
}
TABLE = "vramtune_memory_observations"
KiB = 1024


@pytest.fixture
def engine(migrated_url: str) -> Iterator[Engine]:
    made = make_engine(migrated_url)
    yield made
    made.dispose()


def columns(engine: Engine) -> set[str]:
    return {c["name"] for c in sa.inspect(engine).get_columns(TABLE)}


def observe(
    engine: Engine, predicted: int, measured: int, worker: int = 1, **apart: int | None
) -> None:
    """One run of wine-mlp on the simulated card: whole-run peaks, and the parts if given."""
    row: dict[str, Any] = {
        "trial_id": 1,
        "study_id": 1,
        "worker_id": worker,
        "card_model": "simulated-cpu-64MiB",
        "torch_version": "2.13.0+cpu",
        "task": "wine-mlp",
        "plan": {},
        "outcome": "as_asked",
        "predicted_allocated": predicted,
        "predicted_reserved": predicted,
        "measured_allocated": measured,
        "created_at": utcnow(),
    }
    with make_sessions(engine).begin() as session:
        insert_row(session, MemoryObservationRow, **row, **apart)


def test_migration_0008_adds_the_peaks_apart_and_goes_down_and_up(engine: Engine) -> None:
    assert current_revision(engine) == head_revision()
    assert columns(engine) >= NEW_COLUMNS
    observe(engine, 100, 300, predicted_training=100, measured_training=100)
    downgrade(alembic_config(engine), "0007")
    assert current_revision(engine) == "0007"
    assert not NEW_COLUMNS & columns(engine)
    with engine.connect() as connection:  # the run itself is kept
        assert connection.execute(sa.text(f"SELECT measured_allocated FROM {TABLE}")).all() == [
            (300,)
        ]
    upgrade(engine)
    assert columns(engine) >= NEW_COLUMNS


def test_calibration_pairs_training_with_training_not_with_the_evaluation(engine: Engine) -> None:
    """Runs whose evaluation (unpredicted before issue 29) tripled the whole-run peak, and whose
    training steps were predicted exactly: the served correction is the identity."""
    for worker, predicted in enumerate((14 * KiB, 22 * KiB, 37 * KiB)):
        observe(
            engine,
            predicted,
            3 * predicted,
            worker,
            predicted_training=predicted,
            measured_training=predicted + 512,
            measured_evaluation=3 * predicted,
        )
    calibration = calibration_for_wine(engine)
    assert (calibration.scale, calibration.offset_bytes) == (1.0, 512)


def test_runs_without_the_parts_are_paired_as_reported(engine: Engine) -> None:
    for worker, predicted in enumerate((14 * KiB, 22 * KiB, 37 * KiB)):
        observe(engine, predicted, predicted + 70 * KiB, worker)  # older workers: one peak
    calibration = calibration_for_wine(engine)
    # Few runs: the miss is an offset of its bytes, never a scale on larger predictions.
    assert (calibration.scale, calibration.offset_bytes) == (1.0, 70 * KiB)


def test_one_worker_alone_cannot_move_the_fleets_calibration(engine: Engine) -> None:
    for predicted in (14 * KiB, 22 * KiB, 37 * KiB) * 5:
        observe(engine, predicted, 4 * predicted, worker=7)
    alone = calibration_for_wine(engine)
    assert (alone.scale, alone.offset_bytes, alone.n_observations) == (1.0, 0, 0)
    observe(engine, 14 * KiB, 4 * 14 * KiB, worker=8)  # a second worker sees the same
    assert calibration_for_wine(engine).scale == 4.0


def test_a_workers_own_runs_correct_its_own_predictions_before_the_quorum(engine: Engine) -> None:
    """A fleet of one is still calibrated, by its own runs, for itself only."""
    for predicted in (14 * KiB, 22 * KiB, 37 * KiB) * 5:
        observe(engine, predicted, 4 * predicted, worker=7)
    assert calibration_for_wine(engine, own_worker=7).scale == 4.0
    assert calibration_for_wine(engine, own_worker=8).scale == 1.0  # another worker: identity


def calibration_for_wine(engine: Engine, own_worker: int | None = None) -> Any:
    with make_sessions(engine)() as session:
        return calibration_for(
            session, "simulated-cpu-64MiB", "2.13.0+cpu", "wine-mlp", own_worker=own_worker
        )
