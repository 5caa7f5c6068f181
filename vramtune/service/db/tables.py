"""vramtune's own tables (prefix ``vramtune_``), beside Optuna's, in one database.

Optuna owns and migrates its tables; these are migrated by Alembic from migrations/ with their
own version table. Trials are referred to by Optuna's ``trial_id`` (no foreign key to Optuna's
tables: Optuna's schema is not ours to constrain). Datetimes are UTC without tz, as Optuna's.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# The largest id an Integer column holds on PostgreSQL (INTEGER, 4 bytes): a larger id names no
# row, and PostgreSQL refuses to compare with it (an error, not a miss). Ids from a request are
# bounded to it (service.api.deps.path_id), Optuna's trial ids included (its columns are alike).
MAX_ROW_ID = 2**31 - 1


class Base(DeclarativeBase):
    """Declarative base of vramtune's tables only."""


class StudyRow(Base):
    """A vramtune study: the spec it was created with and whether it is paused."""

    __tablename__ = "vramtune_studies"

    study_id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    task: Mapped[str] = mapped_column(String(128), index=True)
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    paused: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(DateTime)


class WorkerRow(Base):
    """A registered worker and its card."""

    __tablename__ = "vramtune_workers"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    device: Mapped[str] = mapped_column(String(32))
    card_model: Mapped[str] = mapped_column(String(256), index=True)
    total_bytes: Mapped[int] = mapped_column(BigInteger)
    free_bytes: Mapped[int] = mapped_column(BigInteger)
    card: Mapped[dict[str, Any]] = mapped_column(JSON)
    constants: Mapped[dict[str, Any]] = mapped_column(JSON)
    tasks: Mapped[list[str]] = mapped_column(JSON)
    registered_at: Mapped[datetime] = mapped_column(DateTime)
    last_heartbeat: Mapped[datetime] = mapped_column(DateTime, index=True)
    stopped: Mapped[bool] = mapped_column(Boolean, default=False)
    trials_done: Mapped[int] = mapped_column(Integer, default=0)
    # Per task, the configuration keys predictions are shared by (NULL before migration 0004).
    shape_params: Mapped[dict[str, list[str]] | None] = mapped_column(JSON, nullable=True)
    # Per task, the key holding its batch size (NULL before migration 0008).
    batch_params: Mapped[dict[str, str] | None] = mapped_column(JSON, nullable=True)
    # The token that registered the worker: only it may act as the worker (NULL: auth off).
    token_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # Trials it runs at once: it holds at most this many leases, and one leased ahead.
    slots: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    # A node worker's cards (one per rank of a distributed trial), each of ``total_bytes``.
    cards: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    # Per task, the rungs its plans can use on this card (NULL: unknown, before migration 0012
    # or from an older worker); the advice suggests no other.
    rungs: Mapped[dict[str, list[str]] | None] = mapped_column(JSON, nullable=True)

    __table_args__ = (Index("ix_vramtune_workers_token", "token_id", "stopped"),)


class TrialRow(Base):
    """vramtune's bookkeeping of one Optuna trial while and after it runs.

    ``status``: ``leased`` (a worker holds it), ``pending`` (to be re-offered to any worker
    that fits ``min_bytes``), ``waiting`` (handed back; waits for a card of at least
    ``min_bytes``), ``done`` (told to Optuna).
    """

    __tablename__ = "vramtune_trials"

    trial_id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    study_id: Mapped[int] = mapped_column(
        Integer, ForeignKey("vramtune_studies.study_id", ondelete="CASCADE")
    )
    number: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16))
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    min_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    # Cards a hand-back said it needs, ``min_bytes`` on each (1: one card of min_bytes).
    min_world_size: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    outcome: Mapped[str | None] = mapped_column(String(16), nullable=True)
    worker_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # Optuna's parameters as asked (external values); NULL on rows from before migration 0002.
    params: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    plan: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    plans_tried: Mapped[list[dict[str, Any]]] = mapped_column(JSON, default=list)
    predicted_peak_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    measured_peak_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    message: Mapped[str | None] = mapped_column(Text, nullable=True)
    updated_at: Mapped[datetime] = mapped_column(DateTime)

    __table_args__ = (Index("ix_vramtune_trials_offer", "status", "study_id", "min_bytes"),)


class TrialEventRow(Base):
    """One thing that happened to a trial (leased, planned, handed back, routed, OOM, pruned,
    completed...), written by the call that made it happen: a trial's story, in order.

    Insert-only, one row per call, no foreign key (as leases): the hot path pays one INSERT.
    ``detail`` holds the call's facts (card, plan, footprint...) as JSON.
    """

    __tablename__ = "vramtune_trial_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    trial_id: Mapped[int] = mapped_column(Integer)
    at: Mapped[datetime] = mapped_column(DateTime)
    kind: Mapped[str] = mapped_column(String(32))
    detail: Mapped[dict[str, Any]] = mapped_column(JSON)

    __table_args__ = (Index("ix_vramtune_trial_events_trial", "trial_id", "id"),)


class LeaseRow(Base):
    """One assignment of a trial to a worker, fenced by its token."""

    __tablename__ = "vramtune_leases"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    token: Mapped[str] = mapped_column(String(128), unique=True)
    trial_id: Mapped[int] = mapped_column(Integer, index=True)
    worker_id: Mapped[int] = mapped_column(Integer, ForeignKey("vramtune_workers.id"), index=True)
    attempt: Mapped[int] = mapped_column(Integer)
    active: Mapped[bool] = mapped_column(Boolean, default=True)
    expires_at: Mapped[datetime] = mapped_column(DateTime, index=True)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    ended_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    # Set by the worker's ``start``: results for a lease that never started are refused.
    started_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    # The answer given when the lease ended, so that a repeated call gets the same answer.
    resolution: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)


class MemoryObservationRow(Base):
    """Predicted against measured peak of one run, the calibration's raw material."""

    __tablename__ = "vramtune_memory_observations"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    trial_id: Mapped[int] = mapped_column(Integer, index=True)
    study_id: Mapped[int] = mapped_column(Integer, index=True)
    worker_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    card_model: Mapped[str] = mapped_column(String(256))
    torch_version: Mapped[str] = mapped_column(String(64))
    task: Mapped[str] = mapped_column(String(128))
    plan: Mapped[dict[str, Any]] = mapped_column(JSON)
    outcome: Mapped[str] = mapped_column(String(16))
    predicted_allocated: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    predicted_reserved: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    measured_allocated: Mapped[int] = mapped_column(BigInteger)
    measured_reserved: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    nvml_peak: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # The training steps' and the evaluation's peaks apart (raw predictions): a calibration
    # compares training with training (issue 29). None from workers that report one peak.
    predicted_training: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    predicted_evaluation: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    measured_training: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    measured_evaluation: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    # Where it counts (service.fleet.trust): "fleet", or "study:<id>" for a study-limited token.
    scope: Mapped[str] = mapped_column(String(32), default="fleet", server_default="fleet")

    __table_args__ = (Index("ix_vramtune_obs_key", "card_model", "torch_version", "task"),)


class PredictionRow(Base):
    """A prediction one worker made, shared with the fleet: (task, shape, plan, card model,
    torch version) -> predicted peak, before calibration. One row per key: the first wins.

    ``shape_hash`` is the SHA-256 of the shape's canonical JSON (service.fleet.predictions),
    ``plan_key`` the plan's micro-batch, accumulation and rungs in one string, with the world
    size and strategy of a several-card plan (vramtune.service.fleet.predictions.plan_column).
    """

    __tablename__ = "vramtune_predictions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    task: Mapped[str] = mapped_column(String(128))
    card_model: Mapped[str] = mapped_column(String(256))
    torch_version: Mapped[str] = mapped_column(String(64))
    shape_hash: Mapped[str] = mapped_column(String(64))
    plan_key: Mapped[str] = mapped_column(String(64))
    shape: Mapped[dict[str, Any]] = mapped_column(JSON)
    plan: Mapped[dict[str, Any]] = mapped_column(JSON)
    prediction: Mapped[dict[str, Any]] = mapped_column(JSON)
    peak_bytes: Mapped[int] = mapped_column(BigInteger)
    worker_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    trial_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    # Where it counts (service.fleet.trust): "fleet", or "study:<id>" for a study-limited token.
    scope: Mapped[str] = mapped_column(String(32), default="fleet", server_default="fleet")

    __table_args__ = (
        Index(
            "ux_vramtune_predictions_key",
            "scope",
            "task",
            "card_model",
            "torch_version",
            "shape_hash",
            "plan_key",
            unique=True,
        ),
    )


class StepTimeObservationRow(Base):
    """A run's time per optimizer step and what decides it: the step-time model's material."""

    __tablename__ = "vramtune_step_times"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    trial_id: Mapped[int] = mapped_column(Integer, index=True)
    card_model: Mapped[str] = mapped_column(String(256))
    task: Mapped[str] = mapped_column(String(128))
    features: Mapped[dict[str, Any]] = mapped_column(JSON)  # a wire StepTimeObservation
    predicted_step_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    measured_step_s: Mapped[float] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    # The reporting worker: the fit weighs workers equally and waits for a quorum of them.
    worker_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # Where it counts (service.fleet.trust): "fleet", or "study:<id>" for a study-limited token.
    scope: Mapped[str] = mapped_column(String(32), default="fleet", server_default="fleet")

    __table_args__ = (Index("ix_vramtune_step_times_key", "card_model", "task"),)


class TokenRow(Base):
    """An API token: only its hash is stored."""

    __tablename__ = "vramtune_tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    token_hash: Mapped[str] = mapped_column(String(128), unique=True)
    scopes: Mapped[list[str]] = mapped_column(JSON)
    studies: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    last_used_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    expires_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)


class AuditRow(Base):
    """Who did what to tokens and studies: one row per event, never updated or deleted."""

    __tablename__ = "vramtune_audit"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    at: Mapped[datetime] = mapped_column(DateTime, index=True)
    event: Mapped[str] = mapped_column(String(64))
    # The acting token (NULL and actor "cli" for the command line, "local" with auth off).
    token_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    actor: Mapped[str] = mapped_column(String(128))
    target: Mapped[str] = mapped_column(String(256))
    detail: Mapped[dict[str, Any]] = mapped_column(JSON)
