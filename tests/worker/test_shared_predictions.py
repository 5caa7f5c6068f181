"""Predictions shared across the fleet, worker side: a plan choice from the fleet's
predictions makes none of its own, and chooses the plan a choice from scratch chooses."""

from __future__ import annotations

from typing import Any

import pytest

from vramtune.service.wire import CardInfo, MemoryPolicy, Plan, Prediction, SharedPrediction
from vramtune.worker.plan.policy import RunAsPlanned, choose_plan
from vramtune.worker.plan.shared_predictions import (
    SharedPredictionsWithSolver,
    largest_fitting,
    shape_keys,
    shared,
)
from vramtune.worker.tasks.quadratic import MIB, QuadraticConfig, QuadraticTask, footprint_bytes
from vramtune.worker.trial.runner import CardSpec, Config, plan_for_micro_batch

# 16 MiB fixed + 4 MiB of weights, then 256 KiB of activations per sample.
CONFIG: dict[str, Any] = {"width": 64, "batch_size": 256, "x": 0.5}
CARD = CardSpec(info=CardInfo(model="simulated-cpu-1GiB", total_bytes=2**30, free_bytes=2**30))
POLICY = MemoryPolicy(margin=0.0)
SMALL = 20 * MIB + 100 * 256 * 1024  # room for a micro-batch of 100: the trial is resized


class CountingQuadratic(QuadraticTask):
    """The quadratic with a bisecting solver, counting what it had to compute ("traces")."""

    def __init__(self) -> None:
        self.traced = 0

    def predict(self, config: Config, plan: Plan, card: CardSpec) -> Prediction:
        self.traced += 1
        return super().predict(config, plan, card)

    def largest_micro_batch(
        self, config: Config, plan: Plan, budget_bytes: int, card: CardSpec
    ) -> tuple[int, Prediction] | None:
        batch = self.batch_size(config)
        flags = {"checkpointing": plan.checkpointing, "bf16": plan.bf16}
        fitting = [
            micro
            for micro in range(1, batch + 1)
            if footprint_bytes(
                QuadraticConfig.of(config), plan_for_micro_batch(batch, micro, **flags)
            )
            <= budget_bytes
        ]
        if not fitting:
            return None
        plan_at = plan_for_micro_batch(batch, max(fitting), **flags)
        return max(fitting), self.predict(config, plan_at, card)


def choice(runner: CountingQuadratic, fleet: list[SharedPrediction], free: int = SMALL) -> Any:
    wrapped = shared(runner, CONFIG, fleet)
    decision = choose_plan(wrapped, CONFIG, POLICY, CARD, free)
    return wrapped, decision


def test_a_second_worker_chooses_the_same_plan_from_the_fleets_predictions_alone() -> None:
    first, second = CountingQuadratic(), CountingQuadratic()
    made, chosen = choice(first, [])
    assert isinstance(made, SharedPredictionsWithSolver)
    assert isinstance(chosen, RunAsPlanned) and chosen.plan.micro_batch is not None
    assert made.source == "worker" and first.traced == len(made.made) > 0
    again, chosen_again = choice(second, made.made)
    assert second.traced == 0, "nothing traced twice"
    assert again.source == "fleet" and again.made == [] and again.fleet_used > 0
    assert (chosen_again.plan, chosen_again.prediction) == (chosen.plan, chosen.prediction)


def test_a_choice_the_fleet_does_not_settle_makes_the_rest_itself() -> None:
    first, second = CountingQuadratic(), CountingQuadratic()
    made, _ = choice(first, [])
    other, decision = choice(second, made.made, free=SMALL // 2)
    assert isinstance(decision, RunAsPlanned)
    assert other.source == "mixed" and 0 < second.traced == len(other.made)


def test_another_shape_ignores_the_fleets_predictions() -> None:
    made, _ = choice(CountingQuadratic(), [])
    runner = CountingQuadratic()
    wider = {**CONFIG, "width": 32}
    wrapped = shared(runner, wider, made.made)
    choose_plan(wrapped, wider, POLICY, CARD, SMALL)
    assert wrapped.source == "worker" and runner.traced > 0


def test_a_prediction_for_other_ranks_or_another_strategy_is_not_this_plans() -> None:
    """A 2-rank FSDP plan's per-rank peak is not a 4-rank one's, nor DDP's (issue 31)."""
    two_ranks = Plan(world_size=2, strategy="fsdp")
    runner = CountingQuadratic()
    given = Prediction(peak_allocated_bytes=123, peak_reserved_bytes=123)
    shape = shared(runner, CONFIG, []).shape
    fleet = [SharedPrediction(shape=shape, plan=two_ranks, prediction=given)]
    wrapped = shared(runner, CONFIG, fleet)
    assert wrapped.predict(CONFIG, two_ranks, CARD).peak_allocated_bytes == 123
    assert runner.traced == 0
    for other in (Plan(world_size=4, strategy="fsdp"), Plan(world_size=2, strategy="ddp")):
        assert wrapped.predict(CONFIG, other, CARD).peak_allocated_bytes != 123
    assert runner.traced == 2 and wrapped.source == "mixed"


def test_a_torch_task_is_keyed_by_its_shape_parameters_and_batch_size() -> None:
    class Task:
        shape_params = frozenset({"d_model", "n_layers"})
        batch_size_param = "batch_size"

    class Runner:
        task = Task()

    assert shape_keys(Runner()) == ["batch_size", "d_model", "n_layers"]  # type: ignore[arg-type]
    assert shape_keys(QuadraticTask()) is None  # keyed by its whole configuration


def piecewise_peak(micro: int) -> int:
    """A peak as the predictor finds it: the larger of an optimizer-step line and an
    activation line, so small micro-batches are set by the optimizer step."""
    return max(5_000 + 10 * micro, 1_000 + 90 * micro)


@pytest.mark.parametrize("known", [(), (64,), (1, 64), (7, 8, 64), (30, 31), (50,)])
def test_the_search_from_known_peaks_is_exact_and_predicts_nothing_known_twice(
    known: tuple[int, ...],
) -> None:
    batch = 64
    asked: list[int] = []

    def at(micro: int) -> Prediction:
        asked.append(micro)
        peak = piecewise_peak(micro)
        return Prediction(peak_allocated_bytes=peak, peak_reserved_bytes=peak)

    for budget in range(4_000, 8_000, 37):
        asked.clear()
        found = largest_fitting(at, batch, {m: piecewise_peak(m) for m in known}, budget)
        fitting = [m for m in range(1, batch + 1) if piecewise_peak(m) <= budget]
        assert (found[0] if found else None) == (max(fitting) if fitting else None)
        assert len(asked) == len(set(asked)), "no micro-batch predicted twice"
        assert len(asked) <= 12
