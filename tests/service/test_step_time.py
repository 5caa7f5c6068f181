"""The step-time model: the fixed model before any measurement, then the fleet's own fit."""

from __future__ import annotations

import math
import random

import pytest

from vramtune.common.step_time import (
    DEFAULT_ADAFACTOR_SLOWDOWN,
    DEFAULT_ADAMW_8BIT_SLOWDOWN,
    STEP_TIME_MIN_RUNS,
    default_step_time_fit,
    predicted_step_s,
    step_time_slowdown as slowdown,
)
from vramtune.service.step_time import fit_step_time, relative_error
from vramtune.service.wire import StepTimeFit, StepTimeObservation, Strategy


def run(
    batch: int, micro: int, checkpointing: bool = False, peak: int = 10**8
) -> StepTimeObservation:
    return StepTimeObservation(
        batch_size=batch,
        micro_batch=micro,
        micro_batches=math.ceil(batch / micro),
        checkpointing=checkpointing,
        parameter_bytes=10**6,
        as_asked_peak_bytes=peak,
    )


def measured(
    x: StepTimeObservation, overhead: float, ckpt: float, noise: float, rng: random.Random
) -> StepTimeObservation:
    """A card where a micro-batch costs `overhead` samples, 1 ms a sample, work ~ sqrt(peak)."""
    seconds = (
        1e-3 * x.micro_batches * (x.micro_batch + overhead) * (x.as_asked_peak_bytes / 1e8) ** 0.5
    )
    seconds *= ckpt if x.checkpointing else 1.0
    return x.model_copy(update={"measured_step_s": seconds * math.exp(rng.gauss(0, noise))})


def history(n: int, seed: int = 0) -> list[StepTimeObservation]:
    rng = random.Random(seed)
    runs = []
    for _ in range(n):
        batch = rng.choice([16, 32, 64, 128, 256])
        micro = rng.choice([batch, max(1, batch // 4), max(1, batch // 16)])
        peak = rng.choice([10**7, 10**8, 10**9])
        runs.append(measured(run(batch, micro, rng.random() < 0.3, peak), 32.0, 1.6, 0.03, rng))
    return runs


def test_with_nothing_measured_plans_compare_by_the_fixed_model() -> None:
    fit = default_step_time_fit("card", "task")
    assert slowdown(fit, run(256, 256)) == pytest.approx(1.0)
    assert slowdown(fit, run(256, 1)) == pytest.approx(256 * 9 / 264)  # 8 samples a micro-batch
    assert slowdown(fit, run(256, 256, checkpointing=True)) == pytest.approx(4 / 3)
    assert predicted_step_s(fit, run(256, 256)) is None  # no absolute time without a run


def test_the_fit_learns_the_cards_overhead_and_checkpointing_cost() -> None:
    fit = fit_step_time("card", "task", history(200))
    assert fit.n_observations == 200
    assert fit.overhead_samples == 32.0
    assert slowdown(fit, run(256, 256, checkpointing=True)) == pytest.approx(1.6, rel=0.05)
    assert slowdown(fit, run(256, 16)) == pytest.approx(16 * 48 / 288, rel=0.1)
    fresh = history(100, seed=1)
    errors = sorted(relative_error(fit, x) for x in fresh)
    assert errors[50] < 0.05 and errors[90] < 0.15  # 3 % noise


def test_the_fit_learns_what_each_world_size_and_fsdp_cost() -> None:
    """A rank's step: its share of the batch, 1.15x per doubling of the ranks, FSDP 1.3x."""
    rng = random.Random(5)

    def ranks(batch: int, size: int, strategy: Strategy | None) -> StepTimeObservation:
        share = batch // size
        x = run(batch, share).model_copy(
            update={"micro_batch": share, "micro_batches": 1, "world_size": size}
        )
        return x.model_copy(update={"strategy": strategy})

    def timed(x: StepTimeObservation) -> StepTimeObservation:
        seconds = 1e-3 * (x.micro_batch + 32) * x.world_size ** math.log2(1.15)
        seconds *= 1.3 if x.strategy == "fsdp" else 1.0
        return x.model_copy(update={"measured_step_s": seconds * math.exp(rng.gauss(0, 0.02))})

    shapes = [(1, None), (2, "ddp"), (2, "fsdp"), (4, "ddp"), (4, "fsdp"), (8, "ddp")]
    history_ = [timed(ranks(rng.choice([64, 128, 256]), *rng.choice(shapes))) for _ in range(300)]
    fit = fit_step_time("card", "task", history_)
    fsdp, ddp = ranks(256, 4, "fsdp"), ranks(256, 4, "ddp")
    assert slowdown(fit, fsdp) / slowdown(fit, ddp) == pytest.approx(1.3, rel=0.05)
    for size, strategy in shapes:
        x = timed(ranks(128, size, strategy))
        assert relative_error(fit, x) < 0.1, (size, strategy)


def _on_ranks(batch: int, size: int, strategy: Strategy, reshard: bool) -> StepTimeObservation:
    share = batch // size
    return run(batch, share).model_copy(
        update={
            "world_size": size,
            "strategy": strategy,
            "reshard_after_forward": reshard,
            "micro_batches": 1,
        }
    )


def test_fsdp_keeping_parameters_gathered_is_a_term_of_its_own() -> None:
    """The fixed model: at one world size DDP, then FSDP2 keeping its parameters gathered (one
    all-gather a step fewer), then resharding; the fit learns what keeping them saves."""
    prior = default_step_time_fit()
    ddp, gathered, resharding = (
        slowdown(prior, _on_ranks(256, 4, strategy, reshard))
        for strategy, reshard in (("ddp", True), ("fsdp", False), ("fsdp", True))
    )
    assert ddp < gathered < resharding
    assert resharding / gathered == pytest.approx(1.05)
    rng = random.Random(7)

    def timed(x: StepTimeObservation) -> StepTimeObservation:
        seconds = 1e-3 * (x.micro_batch + 32) * x.world_size ** math.log2(1.1)
        if x.strategy == "fsdp":
            seconds *= 1.3 if x.reshard_after_forward else 1.12
        return x.model_copy(update={"measured_step_s": seconds * math.exp(rng.gauss(0, 0.02))})

    shapes = [("ddp", True), ("fsdp", True), ("fsdp", False)]
    runs = [
        timed(_on_ranks(rng.choice([64, 128]), rng.choice([2, 4]), *rng.choice(shapes)))
        for _ in range(300)
    ]
    fit = fit_step_time("card", "task", runs)
    kept, resharded = _on_ranks(128, 2, "fsdp", False), _on_ranks(128, 2, "fsdp", True)
    assert slowdown(fit, resharded) / slowdown(fit, kept) == pytest.approx(1.3 / 1.12, rel=0.05)


def test_the_fit_learns_what_each_offload_costs_from_the_priors_start() -> None:
    """A card where the activations offloaded cost 3x and the optimizer offloaded 1.2x (the
    priors say 2x and 1.5x): the fleet's runs move each rung's slowdown to the card's."""
    rng = random.Random(7)
    fit = default_step_time_fit("card", "task")
    activations = run(256, 64).model_copy(update={"activation_offload": True})
    optimizer = run(256, 64).model_copy(update={"optimizer_offload": True})
    plain = run(256, 64)
    assert slowdown(fit, activations) / slowdown(fit, plain) == pytest.approx(2.0)
    assert slowdown(fit, optimizer) / slowdown(fit, plain) == pytest.approx(1.5)

    def timed(x: StepTimeObservation) -> StepTimeObservation:
        seconds = 1e-3 * x.micro_batches * (x.micro_batch + 8)
        seconds *= (3.0 if x.activation_offload else 1.0) * (1.2 if x.optimizer_offload else 1.0)
        return x.model_copy(update={"measured_step_s": seconds * math.exp(rng.gauss(0, 0.02))})

    shapes = [
        {"activation_offload": a, "optimizer_offload": o}
        for a in (False, True)
        for o in (False, True)
    ]
    runs = [
        timed(run(batch, batch // 4).model_copy(update=rng.choice(shapes)))
        for batch in rng.choices([64, 128, 256], k=300)
    ]
    fit = fit_step_time("card", "task", runs)
    assert slowdown(fit, activations) / slowdown(fit, plain) == pytest.approx(3.0, rel=0.05)
    assert slowdown(fit, optimizer) / slowdown(fit, plain) == pytest.approx(1.2, rel=0.05)


def test_each_optimizer_rung_has_a_prior_and_the_fit_learns_its_cost() -> None:
    """A card where 8-bit AdamW's step costs 1.4x AdamW's and Adafactor's 0.9x."""
    fixed = default_step_time_fit("card", "task")
    swapped = {name: run(64, 64).model_copy(update={"optimizer": name}) for name in COSTS}
    assert slowdown(fixed, swapped["adamw_8bit"]) == pytest.approx(DEFAULT_ADAMW_8BIT_SLOWDOWN)
    assert slowdown(fixed, swapped["adafactor"]) == pytest.approx(DEFAULT_ADAFACTOR_SLOWDOWN)
    assert "optimizer" not in run(64, 64).model_dump(mode="json")  # old observations read alike

    rng = random.Random(7)
    history_ = []
    for x in history(300, seed=7):
        optimizer = rng.choice([None, *COSTS])
        seconds = (x.measured_step_s or 0.0) * (COSTS[optimizer] if optimizer else 1.0)
        history_.append(x.model_copy(update={"optimizer": optimizer, "measured_step_s": seconds}))
    fit = fit_step_time("card", "task", history_)
    for name, cost in COSTS.items():
        assert slowdown(fit, swapped[name]) == pytest.approx(cost, rel=0.05), name


COSTS = {"adamw_8bit": 1.4, "adafactor": 0.9}


def test_more_runs_predict_better_and_a_few_already_give_seconds() -> None:
    fresh = history(100, seed=2)

    def median_error(n: int) -> float:
        fit = fit_step_time("card", "task", history(n))
        return sorted(relative_error(fit, x) for x in fresh)[50]

    assert (
        predicted_step_s(fit_step_time("c", "t", history(STEP_TIME_MIN_RUNS)), fresh[0]) is not None
    )
    assert median_error(200) < median_error(STEP_TIME_MIN_RUNS)


def test_runs_without_a_measured_time_are_ignored() -> None:
    fit = fit_step_time("card", "task", [run(64, 64), run(64, 32)])
    assert fit == default_step_time_fit("card", "task")


def slower(runs: list[StepTimeObservation], factor: float) -> list[StepTimeObservation]:
    """The same runs measured ``factor`` times slower (another card of the model, or a lie)."""
    return [
        x.model_copy(update={"measured_step_s": factor * (x.measured_step_s or 0)}) for x in runs
    ]


def test_each_workers_runs_weigh_alike_however_many_it_reported() -> None:
    """100 runs of one configuration by a worker and 3 by one 1.5x slower (within the outlier
    bound): the fit sits halfway between them in log time, not at the prolific worker's."""
    rng = random.Random(3)
    config = run(64, 16)
    prolific = [measured(config, 32.0, 1.6, 0.01, rng) for _ in range(100)]
    sparse = slower([measured(config, 32.0, 1.6, 0.01, rng) for _ in range(3)], 1.5)
    base = measured(config, 32.0, 1.6, 0.0, rng).measured_step_s or 0

    def ratio(fit: StepTimeFit) -> float:
        return (predicted_step_s(fit, config) or 0) / base

    weighed = fit_step_time("card", "task", prolific + sparse, ["a"] * 100 + ["b"] * 3)
    assert weighed.n_observations == 103
    assert ratio(weighed) == pytest.approx(1.5**0.5, rel=0.02)
    assert ratio(fit_step_time("card", "task", prolific + sparse)) < 1.03  # counted by runs


def test_a_minority_of_absurd_runs_is_dropped_and_honest_ones_are_kept() -> None:
    """Two honest workers and one reporting every step as 10^4 times slower, with more runs
    than both: its runs are dropped whole, the fit is the honest one."""
    honest = history(20, seed=6) + history(20, seed=7)
    absurd = slower(history(60, seed=8), 1e4)
    fit = fit_step_time("card", "task", honest + absurd, [1] * 20 + [2] * 20 + [3] * 60)
    assert fit.n_observations == 40
    assert fit.overhead_samples == 32.0
    fresh = history(50, seed=9)
    assert sorted(relative_error(fit, x) for x in fresh)[25] < 0.05


def test_one_workers_runs_are_fitted_as_before() -> None:
    """Every run of one reporter weighs 1, nothing honest is dropped: the same fit as unnamed."""
    runs = history(50, seed=10)
    assert fit_step_time("c", "t", runs, [7] * 50) == fit_step_time("c", "t", runs)


def test_two_workers_far_apart_teach_nothing() -> None:
    """One honest worker and one reporting 10^4 times slower, run for run: no majority to
    re-centre on, both halves more than 2x off the middle: the fixed model, not either."""
    honest = history(20, seed=11)
    fit = fit_step_time("c", "t", honest + slower(honest, 1e4), [1] * 20 + [2] * 20)
    assert fit == default_step_time_fit("c", "t")


def test_a_fit_with_fewer_or_more_terms_than_this_version_knows_still_serves() -> None:
    """An older fit reads its missing terms from the prior; a newer server's extra terms, past
    the ones this worker knows, are ignored rather than refused (so workers can lag a server)."""
    prior = default_step_time_fit("Sim", "t")
    fitted = prior.model_copy(update={"n_observations": STEP_TIME_MIN_RUNS})
    plain = run(16, 4)
    known = len(prior.coefficients)
    older = fitted.model_copy(update={"coefficients": prior.coefficients[:6]})
    newer = StepTimeFit.model_validate(
        {**fitted.model_dump(), "coefficients": [*prior.coefficients, 5.0, -3.0]}
    )
    assert len(newer.coefficients) == known + 2
    expected = predicted_step_s(fitted, plain)
    assert predicted_step_s(older, plain) == pytest.approx(expected)
    assert predicted_step_s(newer, plain) == pytest.approx(expected)
    assert slowdown(newer, plain) == pytest.approx(slowdown(fitted, plain))
