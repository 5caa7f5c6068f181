"""The quadratic test task as a TrialRunner: footprint, OOM, stop, prune and values."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from vramtune.service.wire import CardInfo, Plan, TrainBudget
from vramtune.worker.tasks.quadratic import (
    MIB,
    QuadraticConfig,
    QuadraticConfigError,
    QuadraticTask,
    footprint_bytes,
    quadratic_value,
)
from vramtune.worker.trial.runner import CardSpec, OutOfMemory, Stopped, TrialRunner

BUDGET = TrainBudget(max_steps=6, eval_every=2)


@dataclass
class Recorder:
    """A Reporter that keeps what it was told and can prune or stop."""

    prune_at: int | None = None
    stop_after: int | None = None
    reports: list[tuple[int, float]] = field(default_factory=list)
    checks: int = 0

    def report(self, step: int, value: float) -> bool:
        self.reports.append((step, value))
        return step == self.prune_at

    def stop_reason(self) -> str | None:
        self.checks += 1
        return (
            "interrupted" if self.stop_after is not None and self.checks > self.stop_after else None
        )


def card(free: int) -> CardSpec:
    return CardSpec(info=CardInfo(model="sim", total_bytes=free, free_bytes=free, simulated=True))


def test_it_is_a_trial_runner() -> None:
    assert isinstance(QuadraticTask(), TrialRunner)


def test_prediction_is_the_footprint_the_run_measures() -> None:
    config = {"batch_size": 64, "width": 32, "step_seconds": 0.0}
    plan = Plan(micro_batch=16, accumulation=4, checkpointing=True)
    prediction = QuadraticTask().predict(config, plan, card(2**30))
    result = QuadraticTask().run(config, plan, BUDGET, card(2**30), Recorder())
    assert prediction.peak_allocated_bytes == result.measured.peak_allocated_bytes
    assert sum(prediction.breakdown.values()) == prediction.peak_allocated_bytes
    assert result.steps == 6


def test_resizes_shrink_only_the_activations() -> None:
    cfg = QuadraticConfig.of({"batch_size": 64, "width": 32})
    full = footprint_bytes(cfg, Plan())
    halves = [
        footprint_bytes(cfg, Plan(micro_batch=32, accumulation=2)),
        footprint_bytes(cfg, Plan(checkpointing=True)),
    ]
    activations = 32 * 64 * cfg.activation_bytes
    assert halves[0] == halves[1] == full - activations // 2
    assert footprint_bytes(cfg, Plan(checkpointing=True, bf16=True)) == full - 3 * activations // 4


def test_values_and_reports_converge_to_the_quadratic() -> None:
    recorder = Recorder()
    config = {"x": 1.0, "y": -0.5, "batch_size": 256, "width": 512, "step_seconds": 0.0}
    result = QuadraticTask().run(config, Plan(), BUDGET, card(2**34), recorder)
    assert result.values == [0.0]
    assert [step for step, _ in recorder.reports] == [2, 4, 6]
    values = [value for _, value in recorder.reports]
    assert values == sorted(values, reverse=True) and values[-1] > 0.0


def test_two_objectives_when_asked() -> None:
    config = {"x": 3.0, "y": 4.0, "objectives": 2, "step_seconds": 0.0}
    result = QuadraticTask().run(config, Plan(), BUDGET, card(2**30), Recorder())
    assert result.values[1] == pytest.approx(5.0)
    assert result.values[0] == pytest.approx(quadratic_value(QuadraticConfig.of(config)))


def test_a_plan_bigger_than_the_card_runs_out_of_memory_at_the_oom_step() -> None:
    config = {"batch_size": 64, "step_seconds": 0.0, "oom_step": 3}
    need = footprint_bytes(QuadraticConfig.of(config), Plan())
    recorder = Recorder()
    with pytest.raises(OutOfMemory) as raised:
        QuadraticTask().run(config, Plan(), BUDGET, card(need - 1), recorder)
    assert raised.value.measured.peak_allocated_bytes == need
    assert [step for step, _ in recorder.reports] == [2]  # it trained until step 3


def test_an_injected_oom_hits_only_large_micro_batches() -> None:
    config = {"batch_size": 64, "step_seconds": 0.0, "oom_above_micro_batch": 32}
    with pytest.raises(OutOfMemory, match="micro-batch 64"):
        QuadraticTask().run(config, Plan(), BUDGET, card(2**30), Recorder())
    plan = Plan(micro_batch=32, accumulation=2)
    assert QuadraticTask().run(config, plan, BUDGET, card(2**30), Recorder()).values


def test_pruned_and_stopped_runs_raise_stopped() -> None:
    config = {"step_seconds": 0.0}
    with pytest.raises(Stopped) as pruned:
        QuadraticTask().run(config, Plan(), BUDGET, card(2**30), Recorder(prune_at=4))
    assert pruned.value.reason == "pruned"
    with pytest.raises(Stopped) as stopped:
        QuadraticTask().run(config, Plan(), BUDGET, card(2**30), Recorder(stop_after=1))
    assert stopped.value.reason == "interrupted"
    assert stopped.value.measured is not None


def test_a_seconds_budget_ends_the_run() -> None:
    config = {"step_seconds": 0.001}
    budget = TrainBudget(max_steps=None, max_seconds=0.05, eval_every=1000)
    result = QuadraticTask().run(config, Plan(), budget, card(2**30), Recorder())
    assert 1 <= result.steps < 10**9


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ({"batch_size": 0}, "batch_size must be >= 1"),
        ({"width": "wide"}, "quadratic: invalid literal"),
        ({"x": "far"}, "could not convert"),
    ],
)
def test_bad_configurations_raise_a_value_error_naming_the_key(
    config: dict[str, object], words: str
) -> None:
    with pytest.raises(QuadraticConfigError, match=words):
        QuadraticTask().batch_size(config)


def test_defaults_describe_a_small_card_friendly_configuration() -> None:
    cfg = QuadraticConfig.of({})
    assert footprint_bytes(cfg, Plan()) < 64 * MIB
