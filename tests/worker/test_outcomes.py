"""Outcome mapping: how the end of a run becomes the trial's final call."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from vramtune.common.memory import peak_of
from vramtune.service.wire import (
    Assignment,
    CompleteRequest,
    FailRequest,
    Measured,
    MemoryPolicy,
    Plan,
    Prediction,
    TrainBudget,
)
from vramtune.worker.loop import outcomes
from vramtune.worker.trial.runner import RunResult, Stopped

PEAK = Measured(peak_allocated_bytes=3_000, peak_reserved_bytes=4_096)
PREDICTION = Prediction(peak_allocated_bytes=3_000, peak_reserved_bytes=4_000)


def assignment(**changes: object) -> Assignment:
    fields: dict[str, object] = {
        "trial_id": 7,
        "number": 0,
        "attempt": 0,
        "lease": "l" * 32,
        "lease_expires_at": datetime.now(UTC),
        "study": "s",
        "task": "quadratic",
        "params": {"x": 1.0},
        "task_config": {},
        "budget": TrainBudget(),
        "memory_policy": MemoryPolicy(),
        "n_objectives": 1,
    }
    return Assignment.model_validate(fields | changes)


def test_the_one_peak_rule_takes_reserved_bytes_when_measured() -> None:
    assert peak_of(PEAK) == 4_096
    assert peak_of(Measured(peak_allocated_bytes=3_000)) == 3_000
    assert peak_of(PREDICTION) == 4_000


def test_a_study_minimizing_memory_gets_the_measured_peak_as_its_last_value() -> None:
    result = RunResult(values=[0.5], measured=PEAK, duration_s=1.0)
    request = outcomes.completed(
        assignment(n_objectives=2, minimize_peak_memory=True), result, Plan(), PREDICTION
    )
    assert isinstance(request, CompleteRequest) and request.values == [0.5, 4096.0]


def test_a_wrong_number_of_values_is_an_error_that_keeps_the_peak() -> None:
    result = RunResult(values=[0.5, 0.7], measured=PEAK, duration_s=1.0)
    request = outcomes.completed(assignment(), result, Plan(), PREDICTION)
    assert isinstance(request, FailRequest) and request.kind == "error"
    assert request.measured == PEAK


@pytest.mark.parametrize(
    ("reason", "kind"),
    [("pruned", "pruned"), ("paused", "interrupted"), ("sigterm", "interrupted")],
)
def test_a_stopped_run_that_trained_sends_its_peak(reason: str, kind: str) -> None:
    request = outcomes.stopped(assignment(), Stopped(reason, PEAK), Plan(), PREDICTION, True)
    assert request is not None and request.kind == kind and request.measured == PEAK


def test_a_run_stopped_before_its_first_step_sends_no_peak() -> None:
    stop = Stopped("paused", PEAK)
    request = outcomes.stopped(assignment(), stop, Plan(), PREDICTION, trained=False)
    assert request is not None and request.kind == "interrupted" and request.measured is None


@pytest.mark.parametrize("reason", ["deleted", "lease_lost"])
def test_nobody_is_told_of_a_deleted_study_or_a_lost_lease(reason: str) -> None:
    assert outcomes.stopped(assignment(), Stopped(reason, PEAK), Plan(), PREDICTION, True) is None
