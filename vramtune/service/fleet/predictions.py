"""Predictions shared across the fleet: what one worker traced, the next one is given.

A prediction is keyed by the trial's task and shape (the values of the task's shape keys, which
the worker registers per task), the plan, and the card model and torch version of the worker
that made it. A worker's start or hand-back carries the predictions it made; its next
assignment of the same shape on the same kind of card carries them back, so no two workers
trace the same shape under the same plan. Kept raw (before calibration), beside the memory
observations; the first prediction of a key wins (a prediction is deterministic).

Trust (vramtune.service.fleet.trust): the server keys a prediction by the shape of the trial it was
made for, from the trial's own parameters; a body's prediction for any other shape is
dropped. It counts in the maker's scope (the fleet, or its study for a study-limited token),
and a run measured far beyond a shared prediction withdraws it (``withdraw_contradicted``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from typing import Any

from sqlalchemy import bindparam, delete, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from vramtune.common.memory import held_peak, peak_of, raw_peaks
from vramtune.common.plans import plan_key, shape_of
from vramtune.service.db.tables import PredictionRow, StudyRow, WorkerRow
from vramtune.service.db.writes import table_of
from vramtune.service.fleet.trust import visible_to_trial
from vramtune.service.wire import MAX_SHARED_PREDICTIONS, Plan, Prediction, SharedPrediction

CONTRADICTED_FACTOR = 2.0
"""A run measured above this many times a shared prediction's raw peak withdraws it: honest
predictions land within tens of percent (calibration corrects the rest), so twice is a trace
gone wrong or a lie, and keeping it would send the next worker of that shape out of memory."""


@dataclass(frozen=True)
class MadeFor:
    """The trial a worker's predictions or measurement came from, as the server knows it."""

    trial_id: int
    study_id: int
    task: str
    config: Mapping[str, Any]  # the study's task_config overlaid with the trial's parameters
    scope: str  # where the worker's knowledge counts (vramtune.service.fleet.trust.scope_of)
    visible: tuple[str, ...]  # the scopes the trial learns from (trust.visible_to_trial)


def shape_hash(shape: Mapping[str, Any]) -> str:
    """The SHA-256 of the shape's canonical JSON: a fixed-width key for the index."""
    canonical = json.dumps(dict(shape), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


OPTIMIZER_COLUMNS = {"adafactor": ":ada", "adamw_8bit": ":a8"}
"""A swapped optimizer's mark in a plan's column (short: the column is String(64))."""


def plan_column(plan: Plan) -> str:
    """The plan's key (vramtune.common.plans.plan_key) as the index's string, e.g.
    '16x4:ckpt=1:bf16=0', with ':blocks=k', ':cce=1', ':ws=W:strategy' (strategy 'fsdpg': FSDP2
    keeping its parameters gathered after forward, one letter so the longest key fits the column),
    ':ada' (Adafactor), ':a8' (8-bit AdamW), ':aoff' and ':ooff' (activation and optimizer offload)
    only for the rungs and the several-card plans that add them (a one-card plan's key stays
    what it was)."""
    key = plan_key(plan)
    micro, accumulation, checkpointing, bf16, blocks, chunked, world_size, strategy = key[:8]
    opt, activation_offload, optimizer_offload, reshard = key[8:]
    column = f"{micro or 'all'}x{accumulation}:ckpt={int(checkpointing)}:bf16={int(bf16)}"
    if blocks is not None:
        column += f":blocks={blocks}"
    column += ":cce=1" if chunked else ""
    wrapper = f"{strategy}{'' if reshard else 'g'}"
    column += f":ws={world_size}:{wrapper}" if world_size > 1 else ""
    column += OPTIMIZER_COLUMNS[opt] if opt is not None else ""
    column += ":aoff" if activation_offload else ""
    return column + (":ooff" if optimizer_offload else "")


def torch_version_of(worker: WorkerRow) -> str:
    """The worker's torch version as observations and predictions key it."""
    return str(worker.card.get("torch_version") or "none")


def shape_keys(worker: WorkerRow, task: str) -> list[str] | None:
    """The configuration keys the worker shares `task`'s predictions by (None: all of them)."""
    keys = (worker.shape_params or {}).get(task)
    return None if keys is None else list(keys)


# Read by every lease: built once (see vramtune.service.fleet.leases._FENCE).
_SHARED = (
    select(PredictionRow)
    .where(
        PredictionRow.task == bindparam("task"),
        PredictionRow.card_model == bindparam("card_model"),
        PredictionRow.torch_version == bindparam("torch_version"),
        PredictionRow.shape_hash == bindparam("shape_hash"),
        PredictionRow.scope.in_(bindparam("scopes", expanding=True)),
    )
    .order_by(PredictionRow.id)
    .limit(MAX_SHARED_PREDICTIONS)
)


def shared_for(
    session: Session, worker: WorkerRow, task: str, config: Mapping[str, Any], study: StudyRow
) -> list[SharedPrediction]:
    """The predictions a trial of `task` with `config` in `study` may use on this worker's
    card: the fleet's and its own study's."""
    if worker.shape_params is None:  # registered before migration 0004, or an older worker
        return []
    shape = shape_of(config, shape_keys(worker, task))
    params = {
        "task": task,
        "card_model": worker.card_model,
        "torch_version": torch_version_of(worker),
        "shape_hash": shape_hash(shape),
        "scopes": visible_to_trial(study),
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
    made_for: MadeFor,
    shared: Sequence[SharedPrediction],
    now: datetime,
) -> None:
    """Store the predictions a worker made for the trial's own shape, in ``made_for.scope``;
    a key already known keeps its first prediction. One for another shape is dropped: the
    body names shapes, but only the trial's parameters say which one the worker was given."""
    own = shape_of(made_for.config, shape_keys(worker, made_for.task))
    rows = {
        (shape_hash(one.shape), plan_column(one.plan)): {
            "scope": made_for.scope,
            "task": made_for.task,
            "card_model": worker.card_model,
            "torch_version": torch_version_of(worker),
            "shape_hash": shape_hash(one.shape),
            "plan_key": plan_column(one.plan),
            "shape": dict(one.shape),
            "plan": one.plan.model_dump(mode="json", exclude={"reason"}),
            "prediction": one.prediction.model_dump(mode="json"),
            "peak_bytes": peak_of(one.prediction),
            "worker_id": worker.id,
            "trial_id": made_for.trial_id,
            "created_at": now,
        }
        for one in shared
        if one.prediction.method != "none"  # nothing was predicted: nothing to share
        and shape_hash(one.shape) == shape_hash(own)
    }
    if not rows:
        return
    session.execute(_keep_statement(session.get_bind().dialect.name), list(rows.values()))


def withdraw_contradicted(
    session: Session, worker: WorkerRow, made_for: MadeFor, plan: Plan, measured_bytes: int
) -> int:
    """Delete the shared predictions this trial could use for the plan it ran whose raw peak
    the run measured far beyond (CONTRADICTED_FACTOR); how many went."""
    row = PredictionRow
    shape = shape_of(made_for.config, shape_keys(worker, made_for.task))
    candidates = session.scalars(
        select(row).where(
            row.task == made_for.task,
            row.card_model == worker.card_model,
            row.torch_version == torch_version_of(worker),
            row.shape_hash == shape_hash(shape),
            row.plan_key == plan_column(plan),
            row.scope.in_(made_for.visible),
        )
    )
    contradicted = [
        one.id
        for one in candidates
        if measured_bytes > CONTRADICTED_FACTOR * _raw_peak(one.prediction)
    ]
    if contradicted:
        session.execute(delete(row).where(row.id.in_(contradicted)))
    return len(contradicted)


def _raw_peak(stored: Mapping[str, Any]) -> int:
    """A stored prediction's peak before calibration (what the worker traced)."""
    return held_peak(*raw_peaks(Prediction.model_validate(stored)))


@cache  # per dialect: built once (vramtune.service.db.writes)
def _keep_statement(dialect: str) -> Any:
    """``INSERT ... ON CONFLICT DO NOTHING`` on the prediction's key, for an executemany."""
    insert = (postgresql if dialect == "postgresql" else sqlite).insert(table_of(PredictionRow))
    keys = ["scope", "task", "card_model", "torch_version", "shape_hash", "plan_key"]
    return insert.on_conflict_do_nothing(index_elements=keys)
