"""The worker-owned training loop on CPU: accumulation, memory plans, stops, the simulated card."""

from __future__ import annotations

import functools
import io
import logging

import pytest
import torch
from task_contract import RecordingReporter, cpu_threads, run_trial, simulated_card

from vramtune.service.wire import Plan, TrainBudget
from vramtune.worker.run.training import TorchTaskRunner, TrainingDiverged, trial_config
from vramtune.worker.tasks.charlm import CharTransformerTask
from vramtune.worker.tasks.contract import gradients_after_one_step
from vramtune.worker.tasks.digits import DigitsCNNTask, DigitsMLPTask
from vramtune.worker.trial.runner import OutOfMemory, Stopped
from vramtune.worker.trial.task import Config, TaskConfigError

MIB = 1024**2
GPT = {
    "n_layers": 2,
    "d_model": 64,
    "n_heads": 4,
    "seq_len": 64,
    "batch_size": 16,
    "eval_windows": 16,
}
SMALL_GPT = {"n_layers": 1, "d_model": 16, "n_heads": 2, "seq_len": 16, "batch_size": 8}
CNN = {"width": 8, "depth": 3, "resolution": 16, "batch_size": 16}


def test_uneven_micro_batches_give_the_full_batch_gradients() -> None:
    task, config = CharTransformerTask(), {**SMALL_GPT, "batch_size": 10}
    batch = next(task.batches(config, 10, torch.device("cpu"), seed=0))
    whole = gradients_after_one_step(task, config, batch, Plan(), torch.device("cpu"))
    split = gradients_after_one_step(
        task, config, batch, Plan(micro_batch=4, accumulation=3), torch.device("cpu")
    )
    assert whole.keys() == split.keys() and len(whole) > 10
    for name, gradient in whole.items():
        torch.testing.assert_close(split[name], gradient, rtol=1e-4, atol=1e-6, msg=name)


def test_a_resized_run_trains_the_same_model_as_the_run_as_asked() -> None:
    # Micro-batches come from the same example stream, so only rounding can differ.
    asked = run_trial(CharTransformerTask(), SMALL_GPT, steps=6)
    resized = run_trial(
        CharTransformerTask(), SMALL_GPT, steps=6, plan=Plan(micro_batch=2, accumulation=4)
    )
    assert resized.values[0] == pytest.approx(asked.values[0], abs=1e-4)


TASKS = {"gpt": (CharTransformerTask(), GPT), "cnn": (DigitsCNNTask(), CNN)}


def two_step_peak(model: str, plan: Plan | None = None) -> int:
    """The tracked peak of two training steps of TASKS[model] under `plan`."""
    return _two_step_peak(model, (plan or Plan()).model_dump_json())


@functools.cache
def _two_step_peak(model: str, plan: str) -> int:
    task, config = TASKS[model]
    return run_trial(
        task, config, steps=2, plan=Plan.model_validate_json(plan)
    ).measured.peak_allocated_bytes


@pytest.mark.parametrize(
    ("model", "plan", "at_most"),
    [
        ("gpt", Plan(checkpointing=True), 0.7),  # measured 11.60 -> 7.16 MiB
        ("gpt", Plan(bf16=True), 0.8),  # 11.60 -> 8.18 MiB
        ("cnn", Plan(checkpointing=True), 0.9),  # 0.835 -> 0.716 MiB
        ("cnn", Plan(bf16=True), 0.8),  # 0.835 -> 0.581 MiB
    ],
    ids=["gpt-checkpointing", "gpt-bf16", "cnn-checkpointing", "cnn-bf16"],
)
def test_a_memory_plan_lowers_the_tracked_peak(model: str, plan: Plan, at_most: float) -> None:
    assert two_step_peak(model, plan) <= at_most * two_step_peak(model)


def test_the_tracked_peak_holds_at_least_weights_gradients_and_adam_state() -> None:
    model = CharTransformerTask().build_model(GPT)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    measured = run_trial(CharTransformerTask(), GPT, steps=2).measured
    assert measured.peak_allocated_bytes > 4 * weights  # weights + grads + two Adam moments
    assert measured.peak_reserved_bytes is None and measured.nvml_peak_bytes is None


def test_a_pruned_trial_stops_at_the_report_that_pruned_it() -> None:
    reporter = RecordingReporter(prune_at=4)
    with pytest.raises(Stopped) as stopped:
        run_trial(DigitsMLPTask(), {"batch_size": 8}, steps=100, eval_every=2, reporter=reporter)
    assert stopped.value.reason == "pruned"
    assert [step for step, _ in reporter.reports] == [2, 4]
    assert stopped.value.measured is not None and stopped.value.measured.peak_allocated_bytes > 0


def test_a_stop_order_ends_the_run_between_steps() -> None:
    reporter = RecordingReporter(stop_after=3)
    with pytest.raises(Stopped) as stopped:
        run_trial(DigitsMLPTask(), {"batch_size": 8}, steps=100, eval_every=1, reporter=reporter)
    assert stopped.value.reason == "paused"
    assert [step for step, _ in reporter.reports] == [1, 2, 3]


def test_the_simulated_card_runs_out_of_memory_past_its_limit() -> None:
    needed = run_trial(CharTransformerTask(), GPT, steps=1).measured.peak_allocated_bytes
    limit = needed // 2
    with pytest.raises(OutOfMemory, match="simulated card out of memory") as oom:
        run_trial(CharTransformerTask(), GPT, steps=1, limit_bytes=limit)
    assert 0 < oom.value.measured.peak_allocated_bytes <= limit
    # Resizing the same trial makes it fit the card that refused it.
    resized = run_trial(
        CharTransformerTask(),
        GPT,
        steps=1,
        limit_bytes=limit,
        plan=Plan(micro_batch=2, accumulation=8),
    )
    assert resized.measured.peak_allocated_bytes <= limit


def test_a_configuration_the_task_cannot_build_fails_with_its_message() -> None:
    with pytest.raises(TaskConfigError, match=r"d_model \(30\) must be divisible by n_heads \(4\)"):
        run_trial(CharTransformerTask(), {**SMALL_GPT, "d_model": 30, "n_heads": 4}, steps=1)


class NaNMetric(DigitsMLPTask):
    """A task whose metric goes NaN, as a diverged run's loss does."""

    def evaluate(self, model: torch.nn.Module, config: Config, device: torch.device) -> float:
        return float("nan")


def test_a_diverged_run_fails_instead_of_reporting_nan() -> None:
    with pytest.raises(TrainingDiverged, match="accuracy is nan after 2 steps") as diverged:
        run_trial(NaNMetric(), {"batch_size": 4}, steps=2)
    # It trained two steps: the peak it measured is an observation like any other run's.
    assert diverged.value.measured is not None
    assert diverged.value.measured.peak_allocated_bytes > 0


def test_a_time_budget_still_trains_one_step() -> None:
    task, config = DigitsMLPTask(), {"batch_size": 4}
    budget = TrainBudget(max_steps=None, max_seconds=1e-9)
    with cpu_threads(1):
        result = TorchTaskRunner(task).run(
            config, Plan(), budget, simulated_card(), RecordingReporter()
        )
    assert result.steps == 1
    assert result.samples_per_s is not None and result.samples_per_s > 0 and result.duration_s > 0


class EvalSpy(DigitsMLPTask):
    """Records the batch size evaluate is handed."""

    seen: list[int] = []

    def evaluate(self, model: torch.nn.Module, config: Config, device: torch.device) -> float:
        self.seen.append(int(config["batch_size"]))
        assert not model.training and not torch.is_grad_enabled()
        return super().evaluate(model, config, device)


def test_evaluation_runs_in_eval_mode_in_chunks_of_the_micro_batch() -> None:
    spy = EvalSpy()
    run_trial(
        spy, {"batch_size": 12}, steps=2, eval_every=1, plan=Plan(micro_batch=5, accumulation=3)
    )
    assert spy.seen == [5, 5]


def test_progress_is_logged_as_lines_without_a_terminal(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="vramtune.worker.run.training"):
        run_trial(DigitsMLPTask(), {"batch_size": 4}, steps=4, eval_every=2)
    lines = [r.getMessage() for r in caplog.records if "step" in r.getMessage()]
    assert len(lines) == 2 and lines[1].startswith("digits-mlp step 4/4 loss ")
    assert "accuracy" in lines[1]


class Terminal(io.StringIO):
    """A stderr that says it is interactive."""

    def isatty(self) -> bool:
        return True


def test_progress_is_a_bar_on_a_terminal(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    with caplog.at_level(logging.INFO, logger="vramtune.worker.run.training"):
        run_trial(DigitsMLPTask(), {"batch_size": 4}, steps=4, eval_every=2)
    assert "digits-mlp" in terminal.getvalue() and "step" in terminal.getvalue()
    assert not [r for r in caplog.records if "step" in r.getMessage()]


def test_a_trial_config_is_the_task_config_overlaid_with_the_sampled_params() -> None:
    assert trial_config({"seq_len": 64, "lr": 0.1}, {"lr": 0.01}) == {"seq_len": 64, "lr": 0.01}
