"""A Hugging Face `Trainer` as a vramtune task: the user's `model_init`, datasets, collator and
`TrainingArguments` kept as they are.

As with `Trainer.hyperparameter_search`, the user's code gives a fresh model per trial through
`model_init` (called with the trial's parameters as a dict when it takes one argument, as
transformers does for Ray Tune), and each sampled parameter that names a `TrainingArguments`
field is set on the arguments, cast to that field's type. The worker then:

- predicts `Trainer.train()`'s own training step, then its own evaluation
  (`Trainer.evaluate` over the eval data set), by tracing them under fake tensors
  (vramtune/worker/integrations/hf_trainer_trace.py), and measures the two peaks apart (`_metered`);
- resizes through the Trainer's own settings: `per_device_train_batch_size` with
  `gradient_accumulation_steps` keeping their product (the effective batch) unchanged,
  `gradient_checkpointing`, `bf16`. The Trainer's micro-batches are all equal, so a plan's
  micro-batch is always a divisor of the effective batch;
- reports each evaluation's metric and obeys the pruner through a `TrainerCallback`; the study's
  budget sets `max_steps` and `eval_steps`.

A subclass such as TRL's `SFTTrainer` (with its `SFTConfig`) takes the same path:
``TrainerTask(name, factory, trainer_class=SFTTrainer)``. Needs ``pip install 'vramtune[hf]'``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import inspect
import logging
import math
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from vramtune.common.plans import plan_flags
from vramtune.service.wire import Plan, Prediction, TrainBudget
from vramtune.worker.device.memory import Excess
from vramtune.worker.integrations.hf_trainer_trace import TrainerTrace, trace_trainer
from vramtune.worker.predictor import CannotTrace, from_trace, target_for
from vramtune.worker.predictor.core import (
    allocator_capacity,
    card_constants,
    divisors,
    largest_divisor_on_lines,
)
from vramtune.worker.run.training import TrainingDiverged, meter_for, release_device_memory
from vramtune.worker.trial.runner import (
    CardSpec,
    Config,
    OutOfMemory,
    Reporter,
    RunResult,
    Stopped,
    plan_for_micro_batch,
)
from vramtune.worker.trial.task import Metric, TaskConfigError

_MISSING = [
    name for name in ("transformers", "accelerate") if importlib.util.find_spec(name) is None
]
if _MISSING:
    # Raised at import: a worker without the extra lists the task as failed to load, with this
    # message, and does not advertise it.
    raise ImportError(f"TrainerTask needs {', '.join(_MISSING)}: pip install 'vramtune[hf]'")

log = logging.getLogger(__name__)

REQUIRED = ("model_init", "args", "train_dataset", "eval_dataset")
"""The Trainer keyword arguments a factory must give (evaluation gives the metric)."""

PREDICTIONS_KEPT = 512

RESERVED = frozenset({"model", "args", "callbacks", "model_init"})
"""Trainer keyword arguments vramtune sets itself for each trial."""

TRAINING_ONLY = frozenset({"per_device_train_batch_size", "gradient_accumulation_steps"})
"""The arguments a plan's micro-batch sets that the evaluation does not read."""


@dataclass
class TraceCounts:
    """What a TrainerTask's predictions traced: Trainer traces, the evaluations among them
    (the others counted a known evaluation's excess instead), the training and evaluation
    steps run and replayed (vramtune/worker/predictor/repeats.py) and the held-out batches
    the evaluation loops jumped over (integrations/hf_trainer_evaluation.py)."""

    traces: int = 0
    evaluations: int = 0
    steps_run: int = 0
    steps_replayed: int = 0
    batches_skipped: int = 0


def _transformers() -> Any:
    """transformers, imported outside any torch dispatch mode (a first import inside the
    trace would count the tensors the library makes at import as the model's)."""
    with _disable_current_modes():
        return importlib.import_module("transformers")


@dataclass(frozen=True)
class TrainerSetup:
    """A factory's Trainer keyword arguments, checked: what every trial's Trainer is built from."""

    model_init: Callable[..., Any]
    args: Any
    kwargs: dict[str, Any]

    @classmethod
    def from_factory(cls, task: str, made: object) -> TrainerSetup:
        """Check a factory's result; a ValueError names the missing or wrong member."""
        if not isinstance(made, Mapping):
            raise ValueError(
                f"{task}: the factory must return a mapping of Trainer keyword arguments, "
                f"got {type(made).__name__}"
            )
        if "model" in made:
            raise ValueError(
                f"{task}: give model_init, not model: every trial needs a fresh model, as "
                "Trainer.hyperparameter_search does"
            )
        missing = [name for name in REQUIRED if made.get(name) is None]
        if missing:
            raise ValueError(f"{task}: the factory gives no {', '.join(missing)}")
        if not callable(made["model_init"]):
            raise ValueError(f"{task}: model_init must be callable")
        if len(inspect.signature(made["model_init"]).parameters) > 1:
            raise ValueError(f"{task}: model_init must take 0 or 1 argument (the trial)")
        transformers = _transformers()
        if not isinstance(made["args"], transformers.TrainingArguments):
            raise ValueError(
                f"{task}: args must be a transformers.TrainingArguments, "
                f"got {type(made['args']).__name__}"
            )
        if "callbacks" in made:
            raise ValueError(f"{task}: callbacks is vramtune's (it reports and prunes)")
        kwargs = {k: v for k, v in made.items() if k not in RESERVED}
        return cls(made["model_init"], made["args"], kwargs)

    def takes_trial(self) -> bool:
        """Whether model_init takes the trial's parameters."""
        return len(inspect.signature(self.model_init).parameters) == 1


class TrainerTask:
    """The user's Hugging Face `Trainer` code as a `TrialRunner`.

    Args:
        name: the task name studies ask for.
        factory: a callable with no arguments returning the Trainer's keyword arguments
            (``model_init``, ``args``, ``train_dataset``, ``eval_dataset``, and optionally
            ``data_collator``, ``compute_metrics``, ``processing_class``...). It is called once
            here to check it and once per trial (fresh arguments each time).
        metric: the evaluation metric to report, as `Trainer.evaluate` names it
            (``eval_loss``; ``accuracy`` finds ``eval_accuracy``).
        direction: whether the metric is minimized or maximized.
        trainer_class: `transformers.Trainer` or a subclass (TRL's `SFTTrainer`).
    """

    can_checkpoint = True
    can_bf16 = True
    batch_size_param = "per_device_train_batch_size"
    # Its micro-batch of 1 traces a window of the whole batch: the plan chooser asks the
    # search rather than predicting it (vramtune/worker/plan/policy.py).
    costly_micro_batch_of_one = True

    def __init__(
        self,
        name: str,
        factory: Callable[[], Mapping[str, Any]],
        *,
        metric: str = "eval_loss",
        direction: str = "minimize",
        trainer_class: type | None = None,
    ) -> None:
        if direction not in ("minimize", "maximize"):
            raise ValueError(f"{name}: direction must be minimize or maximize, not {direction!r}")
        self.task_name = self.name = name
        self.factory = factory
        self.metric = Metric(metric, direction)  # type: ignore[arg-type]
        self.trainer_class = trainer_class or _transformers().Trainer
        if not issubclass(self.trainer_class, _transformers().Trainer):
            raise ValueError(f"{name}: trainer_class must be transformers.Trainer or a subclass")
        self.defaults = self.setup().args
        self._predictions: dict[tuple[Any, ...], Prediction] = {}
        self._evaluations: dict[tuple[Any, ...], Excess] = {}
        self.counts = TraceCounts()

    def setup(self) -> TrainerSetup:
        """The factory's arguments, checked."""
        return TrainerSetup.from_factory(self.name, self.factory())

    # ----------------------------------------------------------------- configuration

    def batch_size(self, config: Config) -> int:
        """The effective batch: per-device batch x accumulation, as the trial asks for them."""
        per_device = int(
            config.get(self.batch_size_param, self.defaults.per_device_train_batch_size)
        )
        steps = int(
            config.get("gradient_accumulation_steps", self.defaults.gradient_accumulation_steps)
        )
        return per_device * steps

    def arguments(self, setup: TrainerSetup, config: Config, plan: Plan, card: CardSpec) -> Any:
        """The trial's TrainingArguments: the user's, the trial's fields, then the plan's."""
        fields = {f.name: f for f in dataclasses.fields(setup.args) if f.init}
        updates: dict[str, Any] = {}
        for key, value in config.items():
            if key not in fields:
                continue
            old = getattr(setup.args, key)
            # As Trainer._hp_search_setup: a value takes the type of the field's current one.
            cast = old is not None and not isinstance(old, bool)
            try:
                updates[key] = type(old)(value) if cast else value
            except (ValueError, TypeError) as error:
                raise TaskConfigError(f"{self.name}: {key}: {error}") from error
        micro = self.micro_batch(config, plan)
        updates.update(
            per_device_train_batch_size=micro,
            gradient_accumulation_steps=self.batch_size(config) // micro,
            per_device_eval_batch_size=self.eval_batch(setup, updates, plan, micro),
            use_cpu=torch.device(card.device).type == "cpu",
            report_to=[],
            save_strategy="no",
            disable_tqdm=not sys.stderr.isatty(),
        )
        if plan.checkpointing:
            updates.update(_checkpointing(fields))
        if plan.bf16:
            updates.update(bf16=True, fp16=False)
        try:
            return dataclasses.replace(setup.args, **updates)
        except (ValueError, TypeError) as error:
            raise TaskConfigError(f"{self.name}: TrainingArguments: {error}") from error

    def eval_batch(
        self, setup: TrainerSetup, updates: Mapping[str, Any], plan: Plan, micro: int
    ) -> int:
        """The evaluation's batch: the user's (`per_device_eval_batch_size`, from the trial or
        the arguments) as asked; a plan that splits the training batch evaluates in batches no
        larger than its micro-batch too, so that evaluation stays within the plan's footprint
        (the trace evaluates with the batch the run does, so the prediction holds either way)."""
        asked = int(
            updates.get("per_device_eval_batch_size", setup.args.per_device_eval_batch_size)
        )
        if plan.micro_batch is None or asked <= micro:
            return asked
        log.info(
            "%s: evaluating in batches of %d, the plan's micro-batch (per_device_eval_batch_size "
            "is %d)",
            self.name,
            micro,
            asked,
        )
        return micro

    def model_parameters(self, setup: TrainerSetup, config: Config) -> dict[str, Any]:
        """What model_init gets: the trial's parameters that are not TrainingArguments fields.

        A key that is neither a field nor read by a model_init that takes the trial is refused,
        naming it (transformers would only warn, and the trial would tune nothing)."""
        fields = {f.name for f in dataclasses.fields(setup.args)}
        others = {k: v for k, v in config.items() if k not in fields}
        if others and not setup.takes_trial():
            raise TaskConfigError(
                f"{self.name}: {', '.join(sorted(others))}: not a TrainingArguments field, and "
                "model_init takes no trial argument to read it"
            )
        return others

    def micro_batch(self, config: Config, plan: Plan) -> int:
        """The plan's micro-batch, lowered to a divisor of the effective batch (the Trainer's
        micro-batches are all equal)."""
        batch = self.batch_size(config)
        wanted = min(plan.micro_batch or batch, batch)
        return max(d for d in range(1, wanted + 1) if batch % d == 0)

    def build_trainer(
        self,
        setup: TrainerSetup,
        config: Config,
        args: Any,
        callbacks: list[Any],
        wrap_model_init: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None,
    ) -> Any:
        """The user's Trainer for this trial (its model comes from model_init)."""
        params = self.model_parameters(setup, config)
        model_init = _with_trial(setup.model_init, params, setup.takes_trial())
        if wrap_model_init is not None:
            model_init = wrap_model_init(model_init)
        try:
            return self.trainer_class(
                model_init=model_init, args=args, callbacks=callbacks, **setup.kwargs
            )
        except (ValueError, TypeError) as error:
            raise TaskConfigError(f"{self.name}: {type(error).__name__}: {error}") from error

    # ----------------------------------------------------------------- prediction

    def predict(self, config: Config, plan: Plan, card: CardSpec) -> Prediction:
        """The traced peak of the Trainer's training steps under `plan`, then of its
        evaluation; method "none" with the reason when fake tensors cannot run it (no probe:
        that would run the user's loop).

        On a CPU card the evaluation is traced once for each evaluation batch and set of
        arguments: the predictions of other micro-batches add its excess to what their
        training steps leave live, which is exact to the byte."""
        started = time.perf_counter()
        target = target_for(card)
        key = self._key(config, plan, card)
        cached = self._predictions.get(key)
        if cached is not None:
            return cached
        if target.emulate:
            return _unpredictable(
                "a CUDA card needs a CUDA build of torch to trace a Trainer", started
            )
        setup = self.setup()
        args = self.arguments(setup, config, plan, card)
        evaluation_key = _evaluation_key(config, args, target, card.device)
        known = None if target.cuda else self._evaluations.get(evaluation_key)
        try:
            traced = trace_trainer(
                lambda a, callbacks, wrap: self.build_trainer(setup, config, a, callbacks, wrap),
                args,
                target,
                evaluation=known,
            )
        except CannotTrace as error:
            return _unpredictable(error.reason, started)
        self._note(traced, evaluation_key, evaluated=known is None)
        constants = card_constants(card) if target.cuda else card_constants(None)
        prediction = from_trace(
            traced.trace,
            target,
            constants,
            time.perf_counter() - started,
            capacity=allocator_capacity(card, target),
        )
        if len(self._predictions) >= PREDICTIONS_KEPT:
            self._predictions.clear()  # a bound, not a policy: a study revisits few shapes
        self._predictions[key] = prediction
        return prediction

    def _key(self, config: Config, plan: Plan, card: CardSpec) -> tuple[Any, ...]:
        """What a prediction depends on: the configuration, the micro-batch the Trainer runs,
        the plan's flags it takes, the card (and what its allocator can reserve)."""
        target = target_for(card)
        return (
            tuple(sorted((k, repr(v)) for k, v in config.items())),
            self.micro_batch(config, plan),
            plan.checkpointing,
            plan.bf16,
            target,
            card.device,
            allocator_capacity(card, target),
        )

    def predictions_solved(
        self, config: Config, plan: Plan, card: CardSpec
    ) -> dict[int, Prediction]:
        """The predictions made so far for `plan`'s flags, by micro-batch (each divisor of
        the batch): the fleet keeps what a solve traced, and nothing is traced for it alone
        (vramtune/worker/plan/shared_predictions.py)."""
        batch = self.batch_size(config)
        flags = plan_flags(plan)
        made = {}
        for micro in divisors(batch):
            known = self._predictions.get(
                self._key(config, plan_for_micro_batch(batch, micro, **flags), card)
            )
            if known is not None:
                made[micro] = known
        return made

    def _note(self, traced: TrainerTrace, evaluation_key: tuple[Any, ...], evaluated: bool) -> None:
        """Keep a traced evaluation's excess for the next predictions; count the trace, whether
        it ran the evaluation, and its steps."""
        if traced.evaluation is not None:
            if len(self._evaluations) >= PREDICTIONS_KEPT:
                self._evaluations.clear()  # a bound, as for the predictions
            self._evaluations[evaluation_key] = traced.evaluation
        again = bool(traced.jump_undone)  # traced twice: with the jump, then without
        self.counts.traces += 1 + again
        self.counts.evaluations += evaluated + again
        for run, replayed in traced.calls.values():
            self.counts.steps_run += run
            self.counts.steps_replayed += replayed
        self.counts.batches_skipped += traced.skipped_batches

    def largest_micro_batch(
        self, config: Config, plan: Plan, budget_bytes: int, card: CardSpec
    ) -> tuple[int, Prediction] | None:
        """The largest divisor of the effective batch whose traced peak fits `budget_bytes`
        (each prediction runs the Trainer's loop: searched on the line of the training steps'
        peaks, which takes fewer predictions than a bisection)."""
        return largest_divisor_on_lines(
            self.batch_size(config),
            plan,
            budget_bytes,
            lambda planned: self.predict(config, planned, card),
            lambda planned: self._predictions.get(self._key(config, planned, card)),
        )

    # ----------------------------------------------------------------- running

    def run(
        self, config: Config, plan: Plan, budget: TrainBudget, card: CardSpec, reporter: Reporter
    ) -> RunResult:
        """`Trainer.train()` under `plan` within `budget`, reporting each evaluation; the final
        metric from the last evaluation (or one more at the end)."""
        setup = self.setup()
        args = self.arguments(setup, config, plan, card)
        with tempfile.TemporaryDirectory(prefix="vramtune-trainer-") as output_dir:
            args = dataclasses.replace(
                args,
                output_dir=output_dir,
                max_steps=budget.max_steps or -1,
                eval_strategy="steps",
                eval_steps=budget.eval_every,
            )
            return self._train(setup, config, args, budget, card, reporter)

    def _train(
        self,
        setup: TrainerSetup,
        config: Config,
        args: Any,
        budget: TrainBudget,
        card: CardSpec,
        reporter: Reporter,
    ) -> RunResult:
        device = torch.device(card.device)
        meter = meter_for(card)
        started = time.monotonic()
        try:
            with meter:
                callback = _callback(self.metric.name, reporter, meter, budget, started)
                trainer = self.build_trainer(setup, config, args, [callback])
                trainer.evaluate = _metered(trainer.evaluate, meter)
                trainer.train()
                value = callback.final_value(trainer)
        except meter.out_of_memory as error:
            message = f"out of memory: {error}"
        else:
            duration = time.monotonic() - started
            steps = trainer.state.global_step
            return RunResult(
                values=[value],
                measured=meter.measured(),
                duration_s=duration,
                samples_per_s=steps * self.batch_size(config) / max(duration, 1e-9),
                steps=steps,
            )
        release_device_memory(device)
        raise OutOfMemory(message, meter.measured())


def _evaluation_key(config: Config, args: Any, target: object, device: str) -> tuple[Any, ...]:
    """What the evaluation's allocations depend on: the configuration (the model's
    parameters), every training argument but those only the training steps read (the
    evaluation batch, bf16 and checkpointing among them), and the card."""
    fields = sorted(
        (f.name, repr(getattr(args, f.name)))
        for f in dataclasses.fields(args)
        if f.init and f.name not in TRAINING_ONLY
    )
    return (tuple(sorted((k, repr(v)) for k, v in config.items())), tuple(fields), target, device)


def _metered(evaluate: Callable[..., Any], meter: Any) -> Callable[..., Any]:
    """The Trainer's `evaluate` inside the meter's evaluation window, so the run's training
    and evaluation peaks are measured apart. A TrainerCallback cannot open the window:
    transformers has no event at an evaluation's start (`on_evaluate` comes after it, with the
    metrics), and `train()` evaluates through `self.evaluate`, as the final evaluation does."""

    @functools.wraps(evaluate)
    def in_window(*args: Any, **kwargs: Any) -> Any:
        with meter.evaluation():
            return evaluate(*args, **kwargs)

    return in_window


def _checkpointing(fields: Mapping[str, Any]) -> dict[str, Any]:
    """The arguments that turn on the model's own (non-reentrant) activation checkpointing:
    `activation_checkpointing` since transformers 5.2x, `gradient_checkpointing` before (an
    alias the new name overrides on a copy)."""
    name = (
        "activation_checkpointing"
        if "activation_checkpointing" in fields
        else "gradient_checkpointing"
    )
    return {name: True, f"{name}_kwargs": {"use_reentrant": False}}


def _with_trial(
    model_init: Callable[..., Any], params: dict[str, Any], takes_trial: bool
) -> Callable[[], Any]:
    """model_init with the trial's parameters bound (a dict, as transformers gives Ray's)."""
    if not takes_trial:
        return model_init

    def fresh_model() -> Any:
        return model_init(dict(params))

    return fresh_model


def _unpredictable(reason: str, started: float) -> Prediction:
    return Prediction(
        peak_allocated_bytes=0,
        peak_reserved_bytes=0,
        method="none",
        reason=f"cannot trace the Trainer: {reason}"[:4096],
        seconds=time.perf_counter() - started,
    )


@dataclass
class _Reports:
    """What the callback saw: the last evaluation's step and value."""

    step: int = -1
    value: float | None = None
    final: bool = False


def _callback(
    metric: str, reporter: Reporter, meter: Any, budget: TrainBudget, started: float
) -> Any:
    """A TrainerCallback that reports each evaluation, prunes, and keeps the time budget."""
    transformers = _transformers()

    class VramtuneCallback(transformers.TrainerCallback):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            self.reports = _Reports()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            meter.sample()
            reason = reporter.stop_reason()
            if reason is not None:
                raise Stopped(reason, meter.measured())
            limit = budget.max_seconds
            if limit is not None and time.monotonic() - started >= limit:
                control.should_training_stop = True

        def on_evaluate(
            self, args: Any, state: Any, control: Any, metrics: dict[str, float], **kwargs: Any
        ) -> None:
            value = _metric_value(metric, metrics, meter)
            self.reports.step, self.reports.value = state.global_step, value
            if not self.reports.final and reporter.report(state.global_step, value):
                raise Stopped("pruned", meter.measured())

        def final_value(self, trainer: Any) -> float:
            """The last evaluation's value when it was at the last step, else a new one."""
            if self.reports.step != trainer.state.global_step or self.reports.value is None:
                self.reports.final = True
                trainer.evaluate()
            assert self.reports.value is not None
            return self.reports.value

    return VramtuneCallback()


def _metric_value(metric: str, metrics: Mapping[str, float], meter: Any) -> float:
    """The metric from `Trainer.evaluate`'s dict (``accuracy`` finds ``eval_accuracy``)."""
    for key in (metric, f"eval_{metric}"):
        if key in metrics:
            value = float(metrics[key])
            if not math.isfinite(value):
                raise TrainingDiverged(f"{key} is {value} (training diverged)", meter.measured())
            return value
    raise TaskConfigError(
        f"metric {metric!r} is not among the evaluation's metrics: {', '.join(sorted(metrics))}"
    )
