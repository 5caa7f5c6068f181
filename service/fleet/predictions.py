"""Predictions shared across the fleet: what one worker traced, the next one is given.

A prediction is keyed by the trial's task and shape (the values of the task's shape keys, which
the worker registers per task), the plan, and the card model and torch version of the worker
that made it. A worker's start or hand-back carries the predictions it made; its next
assignment of the same shape on the same kind of card carries them back, so no two workers
trace the same shape under the same plan. Kept raw (before calibration), beside the memory
observations; the first prediction of a key wins (a prediction is deterministic).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cache
from typing import Any

from sqlalchemy import bindparam, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from service.db.tables import PredictionRow, WorkerRow
from service.db.writes import table_of
from service.wire import (
    MAX_SHARED_PREDICTIONS,
    Plan,
    Prediction,
    SharedPrediction,
    plan_key,
    shape_of,
)


def shape_hash(shape: Mapping[str, Any]) -> str:
    """The SHA-256 of the shape's canonical JSON: a fixed-width key for the index."""
    canonical = json.dumps(dict(shape), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def plan_column(plan: Plan) -> str:
    """The plan's key (service.wire.plan_key) as the index's string, e.g. '16x4:ckpt=1:bf16=0'."""
    micro, accumulation, checkpointing, bf16 = plan_key(plan)
    return f"{micro or 'all'}x{accumulation}:ckpt={int(checkpointing)}:bf16={int(bf16)}"


def torch_version_of(worker: WorkerRow) -> str:
    """The worker's torch version as observations and predictions key it."""
    return str(worker.card.get("torch_version") or "none")


def shape_keys(worker: WorkerRow, task: str) -> list[str] | None:
    """The configuration keys the worker shares `task`'s predictions by (None: all of them)."""
    keys = (worker.shape_params or {}).get(task)
    return None if keys is None else list(keys)


# Read by every lease: built once (see service.fleet.leases._FENCE).
_SHARED = (
    select(PredictionRow)
    .where(
        PredictionRow.task == bindparam("task"),
        PredictionRow.card_model == bindparam("card_model"),
        PredictionRow.torch_version == bindparam("torch_version"),
        PredictionRow.shape_hash == bindparam("shape_hash"),
    )
    .order_by(PredictionRow.id)
    .limit(MAX_SHARED_PREDICTIONS)
)


def shared_for(
    session: Session, worker: WorkerRow, task: str, config: Mapping[str, Any]
) -> list[SharedPrediction]:
    """The fleet's predictions for a trial of `task` with `config` on this worker's card."""
    if worker.shape_params is None:  # registered before migration 0004, or an older worker
        return []
    shape = shape_of(config, shape_keys(worker, task))
    params = {
        "task": task,
        "card_model": worker.card_model,
        "torch_version": torch_version_of(worker),
        "shape_hash": shape_hash(shape),
    }
    rows = session.scalars(_SHARED, params)
    return [
        SharedPrediction(
            shape=row.shape,
            plan=Plan.model_validate(row.plan),
            prediction=Prediction.model_validate(row.prediction),
        )
        for row in rows
    ]


def keep(
    session: Session,
    worker: WorkerRow,
    task: str,
    trial_id: int,
    shared: Sequence[SharedPrediction],
    now: datetime,
) -> None:
    """Store the predictions a worker made; a key already known keeps its first prediction."""
    rows = {
        (shape_hash(one.shape), plan_column(one.plan)): {
            "task": task,
            "card_model": worker.card_model,
            "torch_version": torch_version_of(worker),
            "shape_hash": shape_hash(one.shape),
            "plan_key": plan_column(one.plan),
            "shape": dict(one.shape),
            "plan": one.plan.model_dump(mode="json", exclude={"reason"}),
            "prediction": one.prediction.model_dump(mode="json"),
            "peak_bytes": one.prediction.peak_bytes,
            "worker_id": worker.id,
            "trial_id": trial_id,
            "created_at": now,
        }
        for one in shared
        if one.prediction.method != "none"  # nothing was predicted: nothing to share
    }
    if not rows:
        return
    session.execute(_keep_statement(session.get_bind().dialect.name), list(rows.values()))


@cache  # per dialect: built once (service.db.writes)
def _keep_statement(dialect: str) -> Any:
    """``INSERT ... ON CONFLICT DO NOTHING`` on the prediction's key, for an executemany."""
    insert = (postgresql if dialect == "postgresql" else sqlite).insert(table_of(PredictionRow))
    keys = ["task", "card_model", "torch_version", "shape_hash", "plan_key"]
    return insert.on_conflict_do_nothing(index_elements=keys)
