"""The Optuna glue without a server: distributions, samplers, pruners, loading a study."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.storages import BaseStorage

from vramtune.service.db.tables import StudyRow
from vramtune.service.errors import Invalid
from vramtune.service.optuna.glue import (
    forget_study,
    load_optuna_study,
    make_pruner,
    make_sampler,
    make_storage,
    search_space,
)
from vramtune.service.testing import sqlite_url, upgrade_database
from vramtune.service.wire import PrunerSpec, StudyCreate

optuna.logging.set_verbosity(optuna.logging.WARNING)


def study_spec(**overrides: Any) -> StudyCreate:
    """A valid spec, with overrides."""
    body: dict[str, Any] = {
        "name": f"g-{uuid.uuid4().hex[:8]}",
        "task": "quadratic",
        "search_space": {
            "x": {"type": "float", "low": 0.0, "high": 1.0, "step": 0.25},
            "k": {"type": "int", "low": 2, "high": 8, "step": 2},
            "c": {"type": "categorical", "choices": ["a", "b"]},
        },
    }
    body.update(overrides)
    return StudyCreate.model_validate(body)


def test_grid_sampler_takes_every_point_of_a_discrete_space() -> None:
    sampler = make_sampler(study_spec(sampler={"name": "grid"}))
    assert isinstance(sampler, optuna.samplers.GridSampler)
    study = optuna.create_study(sampler=sampler)
    space = search_space(study_spec())
    # Asked, not told: telling the last point makes the grid sampler call study.stop().
    trials = [study.ask(fixed_distributions=space) for _ in range(5 * 4 * 2)]
    assert len({tuple(t.params.values()) for t in trials}) == 40


def test_patient_pruner_wraps_a_named_pruner() -> None:
    spec = PrunerSpec(name="patient", args={"patience": 3, "wrapped_pruner": {"name": "median"}})
    pruner = make_pruner(spec)
    assert isinstance(pruner, optuna.pruners.PatientPruner)
    assert isinstance(pruner._wrapped_pruner, optuna.pruners.MedianPruner)


@pytest.mark.parametrize(
    ("sampler", "field"),
    [
        ({"name": "cmaes"}, "sampler.name"),  # the cmaes package is not a server dependency
        ({"name": "tpe", "args": {"seed": 1.5}}, "sampler.args.seed"),  # strict: no float as int
        ({"name": "tpe", "args": {"multivariate": 1}}, "sampler.args.multivariate"),
        ({"name": "qmc", "args": {"qmc_type": "nope"}}, "sampler.args.qmc_type"),
    ],
)
def test_sampler_errors_name_the_field(sampler: dict[str, Any], field: str) -> None:
    with pytest.raises(Invalid) as caught:
        make_sampler(study_spec(sampler=sampler))
    assert caught.value.field == field


@pytest.fixture
def storage(tmp_path: Path) -> Iterator[BaseStorage]:
    """Optuna storage on a migrated SQLite file."""
    storage = make_storage(upgrade_database(sqlite_url(tmp_path)))
    yield storage
    storage._backend.engine.dispose()  # type: ignore[attr-defined]


def row_of(storage: BaseStorage, spec: StudyCreate) -> StudyRow:
    """A study created in storage, with the row vramtune would hold (no session needed)."""
    study_id = storage.create_new_study([optuna.study.StudyDirection.MINIMIZE], spec.name)
    return StudyRow(
        study_id=study_id,
        name=spec.name,
        task=spec.task,
        spec=spec.model_dump(mode="json"),
        paused=False,
        created_at=datetime(2026, 1, 1),
    )


def test_loaded_study_keeps_a_seeded_sampler_going(storage: BaseStorage) -> None:
    row = row_of(storage, study_spec(sampler={"name": "random", "args": {"seed": 3}}))
    space = search_space(study_spec())
    params = []
    for _ in range(6):
        # A fresh Study per request, as the fleet does; the sampler's random state persists.
        study = load_optuna_study(storage, row)
        trial = study.ask(fixed_distributions=space)
        params.append(tuple(trial.params.values()))
        study.tell(trial, 1.0)
    assert len(set(params)) > 1
    assert isinstance(load_optuna_study(storage, row).sampler, optuna.samplers.RandomSampler)
    assert isinstance(load_optuna_study(storage, row).pruner, optuna.pruners.MedianPruner)


def test_a_deleted_study_is_not_found(storage: BaseStorage) -> None:
    row = row_of(storage, study_spec())
    storage.delete_study(row.study_id)
    forget_study(storage, row.study_id)
    with pytest.raises(Exception, match="not in the Optuna storage"):
        load_optuna_study(storage, row)


def test_a_study_stored_before_the_bounds_runs_clamped_into_them(storage: BaseStorage) -> None:
    """A spec accepted before issue 30's bounds still loads, at a bounded cost."""
    row = row_of(storage, study_spec())
    row.spec["sampler"] = {"name": "tpe", "args": {"n_ei_candidates": 4_000_000}}
    deep = {"name": "patient", "args": {"patience": 1, "wrapped_pruner": {"name": "median"}}}
    for _ in range(4):  # deeper than MAX_PRUNER_NESTING allows a new study
        deep = {"name": "patient", "args": {"patience": 1, "wrapped_pruner": deep}}
    row.spec["pruner"] = deep
    study = load_optuna_study(storage, row)
    assert study.sampler._n_ei_candidates == 1024  # type: ignore[attr-defined]
    assert isinstance(study.pruner, optuna.pruners.PatientPruner)
