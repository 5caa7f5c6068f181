"""The Hugging Face Trainer integration: the user's Trainer pieces as a TrialRunner, its traced
step against real CPU runs, its knobs, its callback and its refusals of bad input."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from vramtune.service.wire import Plan, TrainBudget
from vramtune.worker.device.gpu import parse_size, simulated_card
from vramtune.worker.integrations.hf_trainer import TrainerTask
from vramtune.worker.tasks.registry import discover
from vramtune.worker.trial.runner import CardSpec, OutOfMemory, Stopped
from vramtune.worker.trial.task import TaskConfigError

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "hf_trainer" / "tasks.py"
SEQ_LEN = 16
CARD = CardSpec(info=simulated_card(parse_size("256MiB")))


def _model_init(trial: dict[str, Any] | None = None) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    params = trial or {}
    config = GPT2Config(
        vocab_size=64,
        n_positions=SEQ_LEN,
        n_layer=int(params.get("n_layer", 1)),
        n_embd=32,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def _windows(count: int, shift: int) -> list[dict[str, list[int]]]:
    rows = [[(i * 7 + j * 3 + shift) % 64 for j in range(SEQ_LEN)] for i in range(count)]
    return [{"input_ids": row, "labels": row} for row in rows]


def _factory(**changes: Any) -> Callable[[], dict[str, Any]]:
    def make() -> dict[str, Any]:
        from transformers import TrainingArguments, default_data_collator

        made: dict[str, Any] = {
            "model_init": _model_init,
            "args": TrainingArguments(
                output_dir="unused", per_device_train_batch_size=8, learning_rate=1e-3, use_cpu=True
            ),
            "train_dataset": _windows(96, 0),
            "eval_dataset": _windows(16, 5),
            "data_collator": default_data_collator,
        }
        made.update(changes)
        return {k: v for k, v in made.items() if v is not None}

    return make


class _Reporter:
    def __init__(self, prune: bool = False) -> None:
        self.prune = prune
        self.reports: list[tuple[int, float]] = []

    def report(self, step: int, value: float) -> bool:
        self.reports.append((step, value))
        return self.prune

    def stop_reason(self) -> str | None:
        return None


@pytest.fixture(scope="module")
def task() -> TrainerTask:
    return TrainerTask("tiny-gpt2", _factory())


@pytest.mark.parametrize(
    ("config", "plan"),
    [
        ({"per_device_train_batch_size": 8}, Plan()),
        ({"per_device_train_batch_size": 8}, Plan(micro_batch=2, accumulation=4)),
        ({"per_device_train_batch_size": 4, "n_layer": 2}, Plan(checkpointing=True)),
    ],
    ids=["as-asked", "micro-batch-2", "checkpointing"],
)
def test_the_traced_trainer_step_matches_the_real_runs_peak(
    task: TrainerTask, config: dict[str, Any], plan: Plan
) -> None:
    predicted = task.predict(config, plan, CARD)
    assert predicted.method == "trace", predicted.reason
    reporter = _Reporter()
    result = task.run(config, plan, TrainBudget(max_steps=3, eval_every=2), CARD, reporter)
    # To the byte: the same Trainer code ran, counted by the same counter.
    assert predicted.peak_allocated_bytes == result.measured.peak_allocated_bytes
    assert result.steps == 3
    # Every eval_every steps, and at the end (the Trainer's own last evaluation, not repeated).
    assert [step for step, _ in reporter.reports] == [2, 3]
    assert result.values == [reporter.reports[-1][1]]


def _bert_init() -> Any:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=SEQ_LEN,
        num_labels=2,
    )
    return BertForSequenceClassification(config)


def _padded_rows(count: int) -> list[dict[str, Any]]:
    """Every other row padded: its attention mask holds zeros, so transformers builds a mask."""
    rows = []
    for i in range(count):
        length = SEQ_LEN if i % 2 else SEQ_LEN // 2
        mask = [1] * length + [0] * (SEQ_LEN - length)
        ids = [(i + j) % 63 + 1 if j < length else 0 for j in range(SEQ_LEN)]
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": i % 2})
    return rows


@pytest.mark.parametrize("plan", [Plan(), Plan(checkpointing=True)], ids=["as-asked", "ckpt"])
def test_a_padded_encoder_matches_the_real_run_too(plan: Plan) -> None:
    # The trace answers transformers' "is the padding all ones?" from the real batches: here
    # it is not, and both runs build the attention mask.
    task = TrainerTask(
        "tiny-bert",
        _factory(
            model_init=_bert_init, train_dataset=_padded_rows(64), eval_dataset=_padded_rows(8)
        ),
    )
    config = {"per_device_train_batch_size": 8}
    predicted = task.predict(config, plan, CARD)
    result = task.run(config, plan, TrainBudget(max_steps=2, eval_every=5), CARD, _Reporter())
    assert predicted.peak_allocated_bytes == result.measured.peak_allocated_bytes


def test_a_trainer_subclass_is_traced_with_its_own_training_step() -> None:
    # The trainer_class path TRL's SFTTrainer takes: the subclass's compute_loss (here a label
    # smoothing loss of its own) is what the trace runs, and it matches the real run.
    from transformers import Trainer

    class SmoothedTrainer(Trainer):
        calls = 0

        def compute_loss(
            self, model: Any, inputs: Any, return_outputs: bool = False, **kwargs: Any
        ) -> Any:
            import torch

            SmoothedTrainer.calls += 1
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            logits = outputs.logits.float()
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]),
                labels[:, 1:].reshape(-1),
                label_smoothing=0.1,
            )
            return (loss, outputs) if return_outputs else loss

    task = TrainerTask("smoothed", _factory(), trainer_class=SmoothedTrainer)
    config = {"per_device_train_batch_size": 8}
    predicted = task.predict(config, Plan(), CARD)
    # One micro-batch in each of the two traced steps, then the evaluation's two batches.
    assert SmoothedTrainer.calls == 4
    result = task.run(config, Plan(), TrainBudget(max_steps=2, eval_every=5), CARD, _Reporter())
    assert predicted.peak_allocated_bytes == result.measured.peak_allocated_bytes


def _accuracy(prediction: Any) -> dict[str, float]:
    import numpy as np

    predicted = np.asarray(prediction.predictions).argmax(-1)
    return {"accuracy": float((predicted == np.asarray(prediction.label_ids)).mean())}


@pytest.mark.parametrize(
    ("name", "changes", "config"),
    [
        ("gpt2", {}, {"per_device_train_batch_size": 8}),
        ("gpt2-micro", {}, {"per_device_train_batch_size": 8, "n_layer": 2}),
        (
            "bert-metrics",
            {
                "model_init": _bert_init,
                "train_dataset": _padded_rows(32),
                "eval_dataset": _padded_rows(24),
                "compute_metrics": _accuracy,
            },
            {"per_device_train_batch_size": 8},
        ),
    ],
    ids=["gpt2", "gpt2-micro-batch", "bert-with-metrics"],
)
def test_the_trainers_evaluation_is_predicted_and_measured_apart(
    name: str, changes: dict[str, Any], config: dict[str, Any]
) -> None:
    # The Trainer's own evaluation loop is traced after the two steps and measured in its own
    # window: with compute_metrics it gathers every batch's logits on the device, which the
    # trace counts as the run does.
    task = TrainerTask(name, _factory(**changes), metric="eval_loss")
    plan = Plan(micro_batch=4, accumulation=2) if "micro" in name else Plan()
    predicted = task.predict(config, plan, CARD)
    assert predicted.method == "trace", predicted.reason
    assert predicted.reason == ""
    result = task.run(config, plan, TrainBudget(max_steps=3, eval_every=2), CARD, _Reporter())
    measured = result.measured
    assert measured.evaluation_peak_bytes is not None
    assert predicted.evaluation_peak_bytes == measured.evaluation_peak_bytes
    assert predicted.training_peak_bytes == measured.training_peak_bytes
    assert predicted.peak_allocated_bytes == measured.peak_allocated_bytes


def test_an_evaluation_that_cannot_be_traced_is_bounded_and_says_so() -> None:
    from transformers import Trainer

    class ValueReadingTrainer(Trainer):
        def prediction_step(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            inputs["input_ids"].nonzero()  # a data-dependent shape: fake tensors cannot run it
            return super().prediction_step(model, inputs, *args, **kwargs)

    task = TrainerTask("nonzero", _factory(), trainer_class=ValueReadingTrainer)
    predicted = task.predict({"per_device_train_batch_size": 8}, Plan(), CARD)
    assert predicted.method == "trace"
    assert predicted.evaluation_peak_bytes is None
    assert "evaluation not traced" in predicted.reason and "nonzero" in predicted.reason
    assert predicted.peak_allocated_bytes == predicted.training_peak_bytes


def test_trainer_class_must_be_a_trainer() -> None:
    with pytest.raises(ValueError, match=r"trainer_class must be transformers\.Trainer"):
        TrainerTask("odd", _factory(), trainer_class=dict)


def test_the_example_study_file_is_a_valid_study() -> None:
    import yaml

    from vramtune.service.wire import StudyCreate

    body = yaml.safe_load((EXAMPLE.parent / "study.yaml").read_text())
    assert StudyCreate.model_validate(body).task == "hf-trainer-gpt2"


def test_a_plan_resizes_through_the_trainers_own_knobs(task: TrainerTask) -> None:
    setup = task.setup()
    config = {"per_device_train_batch_size": 12, "learning_rate": 0.01}
    args = task.arguments(setup, config, Plan(micro_batch=5, accumulation=3), CARD)
    # 5 does not divide 12: the Trainer's equal micro-batches take the divisor below, 4 x 3.
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (4, 3)
    assert args.learning_rate == 0.01
    assert task.batch_size(config) == 12
    resized = task.arguments(setup, config, Plan(checkpointing=True, bf16=True), CARD)
    assert resized.gradient_checkpointing and resized.bf16
    assert resized.per_device_train_batch_size == 12


def test_the_users_evaluation_batch_is_kept_unless_the_plan_splits_below_it(
    task: TrainerTask, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="vramtune.worker.integrations.hf_trainer")
    setup = task.setup()
    config = {"per_device_train_batch_size": 12, "per_device_eval_batch_size": 6}
    assert task.arguments(setup, config, Plan(), CARD).per_device_eval_batch_size == 6
    split_above = task.arguments(setup, config, Plan(micro_batch=6, accumulation=2), CARD)
    assert split_above.per_device_eval_batch_size == 6
    assert not caplog.records
    split_below = task.arguments(setup, config, Plan(micro_batch=4, accumulation=3), CARD)
    assert split_below.per_device_eval_batch_size == 4
    assert "evaluating in batches of 4, the plan's micro-batch" in caplog.text
    default = setup.args.per_device_eval_batch_size
    as_asked = task.arguments(setup, {"per_device_train_batch_size": 2}, Plan(), CARD)
    assert as_asked.per_device_eval_batch_size == default


def test_the_largest_micro_batch_is_a_divisor_that_fits(task: TrainerTask) -> None:
    config = {"per_device_train_batch_size": 8}
    whole = task.predict(config, Plan(), CARD).peak_allocated_bytes
    found = task.largest_micro_batch(config, Plan(), whole - 1, CARD)
    assert found is not None
    micro, prediction = found
    assert micro in (1, 2, 4)
    assert prediction.peak_allocated_bytes < whole


def test_the_pruner_stops_the_trainer(task: TrainerTask) -> None:
    reporter = _Reporter(prune=True)
    with pytest.raises(Stopped) as stopped:
        task.run({}, Plan(), TrainBudget(max_steps=10, eval_every=1), CARD, reporter)
    assert stopped.value.reason == "pruned"
    assert [step for step, _ in reporter.reports] == [1]


def test_a_run_past_the_simulated_card_is_out_of_memory(task: TrainerTask) -> None:
    small = CardSpec(info=simulated_card(parse_size("256KiB")))  # the model takes more
    with pytest.raises(OutOfMemory):
        task.run({}, Plan(), TrainBudget(max_steps=2, eval_every=1), small, _Reporter())


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"model_init": None}, "gives no model_init"),
        ({"eval_dataset": None}, "gives no eval_dataset"),
        ({"model": object()}, "give model_init, not model"),
        ({"args": {"learning_rate": 1e-3}}, "args must be a transformers.TrainingArguments"),
        ({"callbacks": []}, "callbacks is vramtune's"),
        ({"model_init": lambda a, b: None}, "model_init must take 0 or 1 argument"),
    ],
)
def test_a_bad_factory_is_refused_naming_the_member(changes: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        TrainerTask("bad", _factory(**changes))


def test_a_key_neither_argument_nor_model_parameter_fails_the_trial_naming_it() -> None:
    task = TrainerTask("no-trial", _factory(model_init=lambda: _model_init()))
    with pytest.raises(TaskConfigError, match="n_layers: not a TrainingArguments field"):
        task.model_parameters(task.setup(), {"n_layers": 2, "learning_rate": 0.1})


def test_a_value_a_training_argument_refuses_fails_the_trial_naming_it(
    task: TrainerTask,
) -> None:
    with pytest.raises(TaskConfigError, match="lr_scheduler_type: sideways is not a valid"):
        task.arguments(task.setup(), {"lr_scheduler_type": "sideways"}, Plan(), CARD)


def test_a_missing_metric_fails_naming_the_ones_there() -> None:
    task = TrainerTask("acc", _factory(), metric="accuracy", direction="maximize")
    with pytest.raises(TaskConfigError, match=r"'accuracy' is not among .*eval_loss"):
        task.run({}, Plan(), TrainBudget(max_steps=1, eval_every=1), CARD, _Reporter())


def test_the_example_is_discovered_as_a_task() -> None:
    found = discover([str(EXAMPLE)], entry_points=False)
    assert found.errors == {}
    runner = found.runners["hf-trainer-gpt2"]
    assert runner.batch_size({"per_device_train_batch_size": 32}) == 32


def test_a_worker_without_accelerate_does_not_advertise_the_example() -> None:
    script = (
        "import sys; sys.modules['accelerate'] = None\n"  # find_spec then answers None
        "from vramtune.worker.tasks.registry import discover\n"
        f"found = discover([{str(EXAMPLE)!r}], entry_points=False)\n"
        "print(sorted(found.runners)); print(found.errors)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    assert out.splitlines()[0] == "[]"
    assert "TrainerTask needs accelerate: pip install 'vramtune[hf]'" in out


# ----------------------------------------------------------------- planning cost (issue 43)


def _gathering(eval_rows: int = 22) -> Callable[[], dict[str, Any]]:
    """Evaluation with `compute_metrics` (the loop gathers every batch's logits on the device)
    over a held-out set whose last batch is partial."""
    return _factory(compute_metrics=_accuracy, eval_dataset=_windows(eval_rows, 5))


def _same(fast: Any, full: Any) -> None:
    assert fast.model_dump(exclude={"seconds"}) == full.model_dump(exclude={"seconds"})


@pytest.mark.parametrize(
    ("batch", "plans", "evaluations"),
    [
        # The same evaluation batch (8): the second counts the first's evaluation.
        (16, [Plan(), Plan(micro_batch=8, accumulation=2)], 1),
        # Windows of 6, 4 and 12 micro-batches; evaluation batches of 2, 3 (22 rows: the last
        # batch partial) and 1, each traced once.
        (
            12,
            [
                Plan(micro_batch=2, accumulation=6),
                Plan(micro_batch=3, accumulation=4, checkpointing=True),
                Plan(micro_batch=1, accumulation=12),
                Plan(micro_batch=2, accumulation=6, checkpointing=True),
            ],
            4,
        ),
    ],
    ids=["reused-evaluation", "replayed-steps"],
)
def test_replayed_steps_and_a_reused_evaluation_predict_what_the_full_trace_does(
    batch: int, plans: list[Plan], evaluations: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vramtune.worker.predictor import repeats

    config = {"per_device_train_batch_size": batch}
    task = TrainerTask("fast", _gathering())
    fast = [task.predict(config, plan, CARD) for plan in plans]
    assert (task.counts.traces, task.counts.evaluations) == (len(plans), evaluations)
    long_enough = batch == 12  # windows to replay; 11 and 22 held-out batches to jump over
    assert (task.counts.steps_replayed > 0, task.counts.batches_skipped > 0) == (long_enough,) * 2
    # The full trace: every step run, every evaluation traced (a fresh task each).
    monkeypatch.setattr(repeats, "REPLAY_AFTER", 10**9)
    for plan, prediction in zip(plans, fast, strict=True):
        full = TrainerTask("full", _gathering())
        _same(prediction, full.predict(config, plan, CARD))
        assert (full.counts.steps_replayed, full.counts.batches_skipped) == (0, 0)


def test_a_replayed_prediction_matches_the_real_runs_peak() -> None:
    # Both loops replayed (windows of 6 micro-batches; 11 evaluation batches of 2, gathering
    # logits): the real run measures the predicted peaks to the byte.
    task = TrainerTask("replayed", _gathering())
    config = {"per_device_train_batch_size": 12}
    plan = Plan(micro_batch=2, accumulation=6)
    predicted = task.predict(config, plan, CARD)
    assert task.counts.steps_replayed >= 12
    result = task.run(config, plan, TrainBudget(max_steps=2, eval_every=2), CARD, _Reporter())
    measured = result.measured
    assert predicted.training_peak_bytes == measured.training_peak_bytes
    assert predicted.evaluation_peak_bytes == measured.evaluation_peak_bytes
    assert predicted.peak_allocated_bytes == measured.peak_allocated_bytes


def test_a_plan_choice_traces_each_evaluation_once_and_few_steps() -> None:
    # Counted, not timed: what a plan choice costs is how many evaluations and model steps
    # its traces run.
    from vramtune.service.wire import MemoryPolicy
    from vramtune.worker.plan.policy import RunAsPlanned, choose_plan
    from vramtune.worker.plan.shared_predictions import shared

    config = {"per_device_train_batch_size": 32}
    whole = TrainerTask("probe", _gathering(40)).predict(config, Plan(), CARD)
    card = CardSpec(info=simulated_card(whole.peak_allocated_bytes // 2))
    task = TrainerTask("planned", _gathering(40))
    predicted: list[Plan] = []
    predict = task.predict

    def recording(config: Any, plan: Plan, card: CardSpec) -> Any:
        predicted.append(plan)
        return predict(config, plan, card)

    task.predict = recording  # type: ignore[method-assign]
    policy = MemoryPolicy(resizes=["micro_batch", "checkpointing"])
    decision = choose_plan(shared(task, config, []), config, policy, card, card.info.free_bytes)
    assert isinstance(decision, RunAsPlanned)
    assert decision.plan.micro_batch is not None and decision.plan.micro_batch < 32
    # One evaluation traced per evaluation batch and checkpointing the choice predicted.
    default = task.defaults.per_device_eval_batch_size
    evaluations = {(min(p.micro_batch or 32, default), p.checkpointing) for p in predicted}
    assert task.counts.evaluations == len(evaluations) < task.counts.traces
    # No micro-batch of 1 (a window of all 32 micro-batches): the search, not a prediction of
    # the smallest plan, says whether the ladder fits.
    assert min(p.micro_batch or 32 for p in predicted) > 1
    # At most 4 steps a window run in step 1, 2 in step 2, 4 evaluation batches: the rest
    # replayed, however many micro-batches and held-out rows.
    assert task.counts.steps_run <= 6 * task.counts.traces + 4 * task.counts.evaluations


def _padded_to_longest(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Dynamic padding (as `DataCollatorWithPadding`): each batch as long as its longest row."""
    import torch

    longest = max(len(row["input_ids"]) for row in rows)
    ids = [row["input_ids"] + [0] * (longest - len(row["input_ids"])) for row in rows]
    return {"input_ids": torch.tensor(ids), "labels": torch.tensor(ids)}


def test_a_jump_over_a_batch_of_another_shape_is_undone(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Held-out batches of 2 rows of 16 tokens, but the 9th batch has 12: the evaluation's jump
    # would skip it, so the trace runs again without one, and predicts what the full trace does.
    from vramtune.worker.predictor import repeats

    caplog.set_level("INFO", logger="vramtune.worker.integrations.hf_trainer_trace")
    held_out = _windows(28, 5)
    for row in held_out[16:18]:
        row["input_ids"] = row["labels"] = row["input_ids"][:12]
    factory = _factory(data_collator=_padded_to_longest, eval_dataset=held_out)
    config = {"per_device_train_batch_size": 8, "per_device_eval_batch_size": 2}
    task = TrainerTask("undone", factory)
    fast = task.predict(config, Plan(), CARD)
    assert "a skipped batch had another shape" in caplog.text
    assert (task.counts.traces, task.counts.evaluations) == (2, 2)
    monkeypatch.setattr(repeats, "REPLAY_AFTER", 10**9)
    _same(fast, TrainerTask("full", factory).predict(config, Plan(), CARD))
