"""The fit policy on the quadratic task, whose footprint is exact: which plan, and why."""

from __future__ import annotations

from typing import Any

import pytest

from vramtune.common.memory import peak_of
from vramtune.service.wire import (
    Calibration,
    CardInfo,
    MemoryPolicy,
    Plan,
    PlanOut,
    Prediction,
    StepTimeFit,
)
from vramtune.worker.plan.policy import (
    HandBack,
    RunAsPlanned,
    choose_plan,
    expected_slowdown,
)
from vramtune.worker.tasks.quadratic import MIB, QuadraticConfig, QuadraticTask, footprint_bytes
from vramtune.worker.trial.runner import CardSpec, Config, TrialRunner

KIB = 1024
# fixed 16 MiB + weights 4 MiB, then 256 KiB of activations per sample (128 with checkpointing,
# 64 with checkpointing and bf16).
CONFIG: dict[str, Any] = {"width": 64, "batch_size": 256, "x": 0.5}
STATIC = 20 * MIB
CARD = CardSpec(info=CardInfo(model="simulated-cpu-1GiB", total_bytes=2**30, free_bytes=2**30))
NO_MARGIN = MemoryPolicy(margin=0.0)
EVERYTHING = MemoryPolicy(margin=0.0, resizes=["micro_batch", "checkpointing", "bf16"])


def choose(
    free: int,
    policy: MemoryPolicy = NO_MARGIN,
    tried: list[PlanOut] | None = None,
    runner: TrialRunner | None = None,
    config: Config = CONFIG,
) -> RunAsPlanned | HandBack:
    return choose_plan(runner or QuadraticTask(), config, policy, CARD, free, tried or [])


def need(plan: Plan, config: Config = CONFIG) -> int:
    return footprint_bytes(QuadraticConfig.of(config), plan)


def effective_batch(plan: Plan) -> int:
    return (plan.micro_batch or CONFIG["batch_size"]) * plan.accumulation


def test_a_configuration_that_fits_runs_as_asked() -> None:
    runner = SolvingQuadratic()
    decision = choose(need(Plan()), runner=runner)
    assert runner.predicted == 1  # nothing but the plan as asked
    assert isinstance(decision, RunAsPlanned)
    assert decision.plan.model_copy(update={"reason": ""}) == Plan()
    assert decision.plan.reason.startswith("as asked")
    assert decision.prediction.peak_allocated_bytes == need(Plan())


def test_the_margin_is_held_back() -> None:
    decision = choose(need(Plan()), MemoryPolicy(margin=0.1))
    assert isinstance(decision, RunAsPlanned)
    assert decision.plan.micro_batch is not None
    assert peak_of(decision.prediction) <= need(Plan()) * 0.9


def test_too_big_runs_as_balanced_micro_batches_with_the_same_effective_batch() -> None:
    decision = choose(STATIC + 150 * 256 * KIB)  # room for 150 samples: two micro-batches of 128
    assert isinstance(decision, RunAsPlanned)
    plan = decision.plan
    assert (plan.micro_batch, plan.accumulation, plan.checkpointing, plan.bf16) == (
        128,
        2,
        False,
        False,
    )
    assert effective_batch(plan) == CONFIG["batch_size"]
    assert "effective batch 256 unchanged" in plan.reason
    assert "micro-batch 128 × 2" in plan.reason


def test_checkpointing_wins_when_it_is_cheaper_than_tiny_micro_batches() -> None:
    # 1 MiB of activations: 4 samples per micro-batch plain (64 of them), 8 with checkpointing.
    decision = choose(STATIC + MIB)
    assert isinstance(decision, RunAsPlanned)
    assert decision.plan.checkpointing and not decision.plan.bf16
    assert decision.plan.micro_batch == 8
    plain = Plan(micro_batch=4, accumulation=64)
    assert expected_slowdown(decision.plan, 256) < expected_slowdown(plain, 256)
    assert "checkpointing" in decision.plan.reason


def test_checkpointing_is_not_used_when_the_policy_leaves_it_out() -> None:
    decision = choose(STATIC + MIB, MemoryPolicy(margin=0.0, resizes=["micro_batch"]))
    assert isinstance(decision, RunAsPlanned)
    assert (decision.plan.micro_batch, decision.plan.checkpointing) == (4, False)


def test_bf16_only_when_the_study_allows_precision_changes() -> None:
    free = STATIC + 100 * KIB  # below one checkpointed sample (128 KiB), above a bf16 one (64 KiB)
    without = choose(free)
    assert isinstance(without, HandBack)
    with_bf16 = choose(free, EVERYTHING)
    assert isinstance(with_bf16, RunAsPlanned)
    assert with_bf16.plan.bf16 and with_bf16.plan.checkpointing
    assert with_bf16.plan.micro_batch == 1 and with_bf16.plan.accumulation == 256


def test_bf16_is_last_even_when_it_would_be_faster() -> None:
    decision = choose(STATIC + 150 * 256 * KIB, EVERYTHING)
    assert isinstance(decision, RunAsPlanned)
    assert not decision.plan.bf16


def test_nothing_fits_hands_back_the_smallest_reachable_footprint() -> None:
    decision = choose(STATIC)
    assert isinstance(decision, HandBack)
    smallest = Plan(micro_batch=1, accumulation=256, checkpointing=True)
    assert decision.min_footprint_bytes == need(smallest) > STATIC
    assert decision.plan is not None and decision.plan.micro_batch == 1
    assert "does not fit" in decision.reason


def test_a_hand_back_predicts_as_asked_and_the_smallest_plan_only() -> None:
    runner = SolvingQuadratic()
    decision = choose(STATIC, runner=runner)
    assert isinstance(decision, HandBack)
    assert runner.solved == 0 and runner.predicted == 2  # no stage searched


class CannotCheckpoint(QuadraticTask):
    """A runner that says it can checkpoint, whose checkpointing plans cannot be traced (a
    Trainer's model without gradient checkpointing)."""

    def predict(self, config: Config, plan: Plan, card: CardSpec) -> Prediction:
        if plan.checkpointing:
            return Prediction(
                peak_allocated_bytes=0, peak_reserved_bytes=0, method="none", reason="no gc"
            )
        return super().predict(config, plan, card)


def test_a_hand_back_passes_over_plans_that_cannot_be_traced() -> None:
    # Before issue 43 the hand-back reported checkpointing's untraceable 0 B as the smallest
    # footprint, and the server waited for a card that would hold it (any card).
    decision = choose(STATIC, EVERYTHING, runner=CannotCheckpoint())
    assert isinstance(decision, HandBack)
    smallest = Plan(micro_batch=1, accumulation=256, bf16=True)
    assert decision.min_footprint_bytes == need(smallest) > STATIC
    assert decision.plan is not None and not decision.plan.checkpointing


def test_no_resizing_allowed_hands_back_the_configuration_as_asked() -> None:
    decision = choose(need(Plan()) - 1, MemoryPolicy(margin=0.0, allow_resize=False))
    assert isinstance(decision, HandBack)
    assert decision.min_footprint_bytes == need(Plan())


def test_a_plan_that_ran_out_of_memory_is_never_chosen_again() -> None:
    tried: list[PlanOut] = []
    footprints = []
    for _ in range(500):
        decision = choose(need(Plan()), EVERYTHING, tried)
        if isinstance(decision, HandBack):
            break
        assert decision.plan.model_dump(exclude={"reason"}) not in [
            t.model_dump(exclude={"reason"}) for t in tried
        ]
        footprints.append(peak_of(decision.prediction))
        tried.append(PlanOut(**decision.plan.model_dump()))
    else:
        pytest.fail("the ladder never ended")
    assert len(tried) > 3
    assert footprints == sorted(footprints, reverse=True)
    assert len(set(footprints)) == len(footprints), "each retry needs strictly less memory"


def test_after_an_oom_as_asked_the_next_plan_is_smaller() -> None:
    decision = choose(2**30, NO_MARGIN, [PlanOut()])
    assert isinstance(decision, RunAsPlanned)
    assert decision.plan.micro_batch is not None
    assert peak_of(decision.prediction) < need(Plan())
    assert effective_batch(decision.plan) == CONFIG["batch_size"]


class SolvingQuadratic(QuadraticTask):
    """A runner with the predictor's solver: the policy must use it instead of bisecting."""

    def __init__(self) -> None:
        self.solved = 0
        self.predicted = 0

    def predict(self, config: Config, plan: Plan, card: CardSpec) -> Prediction:
        self.predicted += 1
        return super().predict(config, plan, card)

    def largest_micro_batch(
        self, config: Config, plan: Plan, budget_bytes: int, card: CardSpec
    ) -> tuple[int, Prediction] | None:
        self.solved += 1
        per_sample = need(Plan(micro_batch=2, **_flags(plan)), config) - need(
            Plan(micro_batch=1, **_flags(plan)), config
        )
        micro = (budget_bytes - need(Plan(micro_batch=1, **_flags(plan)), config)) // per_sample + 1
        if micro < 1:
            return None
        return micro, super().predict(config, Plan(micro_batch=micro, **_flags(plan)), card)


def _flags(plan: Plan) -> dict[str, bool]:
    return {"checkpointing": plan.checkpointing, "bf16": plan.bf16}


def test_the_predictors_solver_is_used_when_the_runner_has_one() -> None:
    runner = SolvingQuadratic()
    decision = choose(STATIC + 150 * 256 * KIB, runner=runner)
    assert isinstance(decision, RunAsPlanned)
    assert decision.plan.micro_batch == 128
    assert runner.solved == 1
    assert runner.predicted <= 3  # as asked, the balanced plan; no bisection


class BlindQuadratic(QuadraticTask):
    """A runner that cannot trace."""

    def predict(self, config: Config, plan: Plan, card: CardSpec) -> Prediction:
        return Prediction(
            peak_allocated_bytes=0, peak_reserved_bytes=0, method="none", reason="uses .item()"
        )


def test_without_a_prediction_it_runs_as_asked_then_halves_after_each_oom() -> None:
    first = choose(STATIC, runner=BlindQuadratic())
    assert isinstance(first, RunAsPlanned)
    assert first.plan.micro_batch is None and "uses .item()" in first.plan.reason
    second = choose(STATIC, tried=[PlanOut()], runner=BlindQuadratic())
    assert isinstance(second, RunAsPlanned)
    assert (second.plan.micro_batch, second.plan.accumulation) == (128, 2)


def test_expected_slowdown_grows_with_the_number_of_micro_batches() -> None:
    slowdowns = [
        expected_slowdown(Plan(micro_batch=m, accumulation=256 // m), 256) for m in (128, 32, 8, 1)
    ]
    assert expected_slowdown(Plan(), 256) == 1.0
    assert slowdowns == sorted(slowdowns)
    assert slowdowns[0] > 1.0
    assert expected_slowdown(Plan(checkpointing=True), 256) == pytest.approx(4 / 3)


def test_the_services_calibration_is_applied_before_comparing_with_the_budget() -> None:
    doubled = Calibration(
        card_model="sim", torch_version="x", task="quadratic", scale=2.0, margin_fraction=0.0
    )
    exact = need(Plan())
    assert isinstance(choose(exact), RunAsPlanned)
    decision = choose_plan(QuadraticTask(), CONFIG, NO_MARGIN, CARD, exact, [], doubled)
    assert isinstance(decision, RunAsPlanned)
    assert decision.plan.micro_batch is not None, "twice the prediction no longer fits as asked"
    assert peak_of(decision.prediction) <= exact
    assert peak_of(decision.prediction) == 2 * need(decision.plan)


def test_the_solver_gets_the_budget_in_uncalibrated_bytes() -> None:
    calibration = Calibration(
        card_model="sim", torch_version="x", task="quadratic", scale=1.5, margin_fraction=0.1
    )
    free = 2 * (STATIC + 150 * 256 * KIB)
    solving = choose_plan(SolvingQuadratic(), CONFIG, NO_MARGIN, CARD, free, [], calibration)
    bisecting = choose_plan(QuadraticTask(), CONFIG, NO_MARGIN, CARD, free, [], calibration)
    assert isinstance(solving, RunAsPlanned) and isinstance(bisecting, RunAsPlanned)
    assert solving.plan == bisecting.plan
    assert peak_of(solving.prediction) <= free


def _fit(overhead: float, checkpoint_slowdown: float) -> StepTimeFit:
    """A fleet fit that says what a micro-batch and checkpointing cost on this card."""
    import math

    return StepTimeFit(
        card_model=CARD.info.model,
        task="quadratic",
        overhead_samples=overhead,
        coefficients=[0.0, 1.0, math.log(checkpoint_slowdown), 0.0, 0.0, 0.0],
        n_observations=50,
    )


def test_the_fleets_step_time_fit_decides_between_micro_batches_and_checkpointing() -> None:
    # Room for 4 samples plain or 8 with checkpointing (as in the test above): with the fixed
    # model checkpointing wins; a card where checkpointing is measured 3x slower and a
    # micro-batch costs nothing extra runs 64 plain micro-batches instead.
    free = STATIC + MIB
    fixed = choose_plan(QuadraticTask(), CONFIG, NO_MARGIN, CARD, free)
    fitted = choose_plan(QuadraticTask(), CONFIG, NO_MARGIN, CARD, free, step_fit=_fit(0.0, 3.0))
    assert isinstance(fixed, RunAsPlanned) and isinstance(fitted, RunAsPlanned)
    assert fixed.plan.checkpointing
    assert not fitted.plan.checkpointing and fitted.plan.micro_batch == 4
    assert "predicted slowdown 1.00x" in fitted.plan.reason


def test_a_planned_run_carries_its_step_time_features_and_prediction() -> None:
    decision = choose_plan(
        QuadraticTask(), CONFIG, NO_MARGIN, CARD, STATIC + MIB, step_fit=_fit(8.0, 4 / 3)
    )
    assert isinstance(decision, RunAsPlanned) and decision.step_time is not None
    features = decision.step_time
    assert (features.batch_size, features.micro_batch) == (256, decision.plan.micro_batch)
    assert features.micro_batches == decision.plan.accumulation
    assert features.as_asked_peak_bytes == need(Plan())
    assert features.predicted_step_s is not None and features.predicted_step_s > 0
    unfitted = choose(STATIC + MIB)
    assert isinstance(unfitted, RunAsPlanned) and unfitted.step_time is not None
    assert unfitted.step_time.predicted_step_s is None  # nothing measured: no absolute time


class _Clock:
    """A clock that moves one second per prediction."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_decision_says_how_long_choosing_it_took(monkeypatch: pytest.MonkeyPatch) -> None:
    clock, predictions = _Clock(), []

    class Slow(QuadraticTask):
        def predict(self, config: Config, plan: Plan, card: CardSpec) -> Prediction:
            clock.now += 1.0
            predictions.append(plan)
            return super().predict(config, plan, card)

    monkeypatch.setattr("vramtune.worker.plan.policy.time.perf_counter", clock)
    resized = choose(free=need(Plan(micro_batch=4, accumulation=4)), runner=Slow())
    assert resized.seconds == len(predictions) > 1
    predictions.clear()
    clock.now = 0.0
    handed_back = choose(free=1, runner=Slow())
    assert isinstance(handed_back, HandBack) and handed_back.seconds == len(predictions) > 1


def test_after_an_oom_plans_below_the_micro_batch_that_died_come_first() -> None:
    # Checkpointing measured nearly free and micro-batches costly: just under the as-asked
    # peak, checkpointing at the whole batch is the fastest plan that fits. After the as-asked
    # run died (say above a micro-batch the prediction missed), the same micro-batch with
    # checkpointing would likely die too: a smaller micro-batch is tried first.
    fit = _fit(64.0, 1.01)
    unfailed = choose_plan(QuadraticTask(), CONFIG, NO_MARGIN, CARD, need(Plan()) - 1, step_fit=fit)
    assert isinstance(unfailed, RunAsPlanned)
    assert unfailed.plan.checkpointing and unfailed.plan.micro_batch is None
    after_oom = choose_plan(
        QuadraticTask(), CONFIG, NO_MARGIN, CARD, 2**30, [PlanOut()], step_fit=fit
    )
    assert isinstance(after_oom, RunAsPlanned)
    assert after_oom.plan.micro_batch is not None and after_oom.plan.micro_batch < 256
    assert effective_batch(after_oom.plan) == CONFIG["batch_size"]


CUDA = CardSpec(
    info=CardInfo(model="simulated-cuda-1GiB", total_bytes=2**30, free_bytes=2**30), device="cuda"
)
OFFLOAD_RUNGS: list[Any] = ["checkpointing", "activation_offload", "optimizer_offload"]


class OffloadingQuadratic(QuadraticTask):
    """The quadratic task as a CUDA card's loop would offload it: activation_offload keeps
    1 MiB of its activations (what backward unpacks at once), optimizer_offload takes 8 MiB of
    its fixed part (the optimizer state) off the card. As asked 84 MiB; checkpointing 52 MiB;
    activations offloaded 21 MiB; optimizer offloaded 76 MiB; checkpointing and the optimizer
    offloaded 44 MiB."""

    can_offload = True

    def predict(self, config: Config, plan: Plan, card: CardSpec) -> Prediction:
        kept = plan.model_copy(update={"activation_offload": False, "optimizer_offload": False})
        peak = need(kept, config)
        if plan.activation_offload:
            peak = STATIC + MIB
        if plan.optimizer_offload:
            peak -= 8 * MIB
        return Prediction(peak_allocated_bytes=peak, peak_reserved_bytes=peak, method="trace")


def choose_offloading(
    free: int, resizes: list[Any], card: CardSpec = CUDA
) -> RunAsPlanned | HandBack:
    return choose_plan(
        OffloadingQuadratic(), CONFIG, MemoryPolicy(margin=0.0, resizes=resizes), card, free
    )


def test_checkpointing_wins_over_the_slower_offloads_where_both_fit() -> None:
    decision = choose_offloading(60 * MIB, OFFLOAD_RUNGS)
    assert isinstance(decision, RunAsPlanned)
    assert decision.plan.checkpointing and not decision.plan.activation_offload


def test_an_offload_is_taken_where_it_alone_fits_and_only_on_a_cuda_card() -> None:
    decision = choose_offloading(40 * MIB, OFFLOAD_RUNGS)
    assert isinstance(decision, RunAsPlanned)
    assert decision.plan.activation_offload and not decision.plan.checkpointing
    assert "activations offloaded to host memory" in decision.plan.reason
    assert isinstance(choose_offloading(40 * MIB, OFFLOAD_RUNGS, CARD), HandBack)


def test_a_pair_of_precise_rungs_is_tried_when_no_rung_alone_fits() -> None:
    decision = choose_offloading(45 * MIB, ["checkpointing", "optimizer_offload"])
    assert isinstance(decision, RunAsPlanned)
    assert (decision.plan.checkpointing, decision.plan.optimizer_offload) == (True, True)
    back = choose_offloading(43 * MIB, ["checkpointing", "optimizer_offload"])
    assert isinstance(back, HandBack) and back.min_footprint_bytes == 44 * MIB
