"""The micro-batch search of loops that trace slowly (a Hugging Face Trainer's): the largest
fitting divisor, found with fewer predictions than a bisection."""

from __future__ import annotations

import pytest

from vramtune.service.wire import Plan, Prediction
from vramtune.worker.predictor.core import divisors, largest_divisor_on_lines

MIB = 2**20


def _predictor(
    batch: int, per_sample: int, fixed: int, evaluation: int = 0
) -> tuple[dict[int, Prediction], object]:
    """Predictions of a step whose peak is affine in the micro-batch (with the gradients held
    once it accumulates), beside an evaluation of fixed peak; each prediction made recorded."""
    made: dict[int, Prediction] = {}
    gradients = 3 * MIB

    def predict(plan: Plan) -> Prediction:
        micro = plan.micro_batch or batch
        training = fixed + per_sample * micro + (gradients if micro < batch else 0)
        peak = max(training, evaluation)
        made[micro] = Prediction(
            peak_allocated_bytes=peak,
            peak_reserved_bytes=peak,
            training_peak_bytes=training,
            evaluation_peak_bytes=evaluation,
        )
        return made[micro]

    return made, predict


@pytest.mark.parametrize("batch", [512, 96, 12, 7])
@pytest.mark.parametrize("budget_mib", [5, 9, 20, 60, 300, 2000])
def test_the_answer_is_the_largest_fitting_divisor(batch: int, budget_mib: int) -> None:
    made, predict = _predictor(batch, per_sample=MIB, fixed=4 * MIB, evaluation=6 * MIB)
    budget = budget_mib * MIB
    found = largest_divisor_on_lines(batch, Plan(), budget, predict)  # type: ignore[arg-type]
    expected = [
        m
        for m in divisors(batch)
        if max(4 * MIB + MIB * m + (3 * MIB if m < batch else 0), 6 * MIB) <= budget
    ]
    if not expected:
        assert found is None
        return
    assert found is not None
    assert found[0] == expected[-1]
    assert found[1] is made[found[0]]  # the answer was predicted, never inferred


def test_it_predicts_fewer_than_a_bisection_and_never_1_when_more_fits() -> None:
    # 512 has ten divisors: a bisection predicts 3 or 4 of them; the line from the whole batch
    # guesses 16, and 32 closes the bracket. A micro-batch of 1 (a Trainer's slowest
    # prediction: a window of the whole batch) is not predicted.
    made, predict = _predictor(512, per_sample=MIB, fixed=4 * MIB)
    found = largest_divisor_on_lines(512, Plan(), 30 * MIB, predict)  # type: ignore[arg-type]
    assert found is not None and found[0] == 16
    assert sorted(made) == [16, 32, 512]


def test_known_predictions_are_used_and_not_made_again() -> None:
    # Two known fitting micro-batches (1 and 16): their line puts 32 over, nothing predicted
    # but the whole batch.
    made, predict = _predictor(512, per_sample=MIB, fixed=4 * MIB)
    known = {m: predict(Plan(micro_batch=m, accumulation=512 // m)) for m in (1, 16)}
    made.clear()
    found = largest_divisor_on_lines(
        512,
        Plan(),
        30 * MIB,
        predict,  # type: ignore[arg-type]
        lambda plan: known.get(plan.micro_batch or 512),
    )
    assert found is not None and found[0] == 16
    assert sorted(made) == [512]
