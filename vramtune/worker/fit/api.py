"""`vramtune.fit`: will this training step fit, on which cards, and how.

One call answers the questions people ask before they tune anything, from the predictor and
the plan ladder the worker itself uses (DESIGN.md: "the predictor is a library first"):

- the predicted peak of the step, with what is live at it (parameters, gradients, optimizer
  state, activations, temporaries), the phase it peaks in and the evaluation's peak when the
  task evaluates;
- for each card (`vramtune.worker.fit.cards`): fits as asked, fits only through a plan (the
  plan in the dashboard's words, with its predicted slowdown), or cannot fit and by how much;
  and the largest micro-batch (with the user's own step: the largest batch) that fits it.

Nothing here predicts: `vramtune.worker.predictor.predict` traces, `choose_plan` climbs the
ladder, `largest_micro_batch` solves for the micro-batch.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from pydantic import ValidationError
from torch import nn

from vramtune.common.plans import plan_in_words
from vramtune.service.wire import CardInfo, MemoryPolicy, Plan, Prediction, Resize
from vramtune.worker.fit import hf_config
from vramtune.worker.fit.adapter import (
    BATCH_SIZE,
    BatchSource,
    LossFunction,
    ModuleTask,
    OptimizerSource,
)
from vramtune.worker.fit.cards import CARDS, CUDA_CONTEXT_BYTES, Card, card_named
from vramtune.worker.plan.policy import HandBack, RunAsPlanned, choose_plan, expected_slowdown
from vramtune.worker.predictor import footprint, largest_micro_batch, phase_peaks, predict
from vramtune.worker.predictor.core import traces_told
from vramtune.worker.predictor.trace import CannotTrace, OwnStep
from vramtune.worker.run.training import TorchTaskRunner
from vramtune.worker.tasks.registry import as_runner
from vramtune.worker.trial.runner import CardSpec, Config, TrialRunner
from vramtune.worker.trial.task import Task, TaskConfigError

Device = Literal["cuda", "cpu"]
StrategyName = Literal["ddp", "fsdp", "fsdp2"]
"""How the ranks hold the model: DDP (a whole copy each) or FSDP2 (sharded; "fsdp" is the
same: FSDP2 is the only FSDP vramtune runs)."""
Progress = Callable[[str], None]
"""Told what `fit` traces next (the CLI's progress line): ``progress("[3/9] T4: ...")``."""

DEFAULT_RESIZES: tuple[Resize, ...] = (
    "micro_batch",
    "checkpointing",
    "chunked_cross_entropy",
    "activation_offload",
    "optimizer_offload",
    "bf16",
)
"""The rungs `fit` may climb: every one that keeps the numerics, then bf16 (tried last: it
changes them). 8-bit AdamW and Adafactor swap the user's optimizer: ask for them by name."""

Verdict = Literal["fits", "fits with a plan", "does not fit"]


@dataclass(frozen=True)
class CardFit:
    """One card's answer.

    Attributes:
        card: the card's name (or the size it was given as).
        usable_bytes: the memory a run may use there (less the margin asked for).
        verdict: "fits" as asked, "fits with a plan", or "does not fit".
        plan: the plan that fits (as a Plan's fields) when only a plan fits; for a card
            nothing fits, the plan of the smallest footprint the ladder reached (or None).
        plan_in_words: that plan as the dashboard says it ("micro-batch 8 × 4, bf16").
        plan_footprint_bytes: what the card holds under that plan.
        slowdown: predicted time per step under that plan relative to as asked (1.0: same).
        short_by_bytes: how much more memory the smallest footprint needs ("does not fit").
        largest_micro_batch: the largest micro-batch of the asked batch that fits as asked
            (with gradient accumulation over the rest); with the user's own step, the largest
            batch; None when not even 1 fits.
    """

    card: str
    usable_bytes: int
    verdict: Verdict
    plan: dict[str, Any] | None = None
    plan_in_words: str | None = None
    plan_footprint_bytes: int | None = None
    slowdown: float | None = None
    short_by_bytes: int | None = None
    largest_micro_batch: int | None = None


@dataclass(frozen=True)
class FitResult:
    """The answer of `fit`.

    Attributes:
        task: the task's (or model's) name. config: the configuration predicted.
        device: "cuda" (a CUDA card's rules: its kernels and caching allocator) or "cpu".
        peak_bytes: the footprint the card must hold (reserved on CUDA, live bytes on CPU);
            with several ranks, rank 0's.
        allocated_bytes: the peak of live tensor bytes (the allocator model's, on CUDA).
        cuda_context_bytes: the CUDA context beside the allocator's memory (`CUDA_CONTEXT_BYTES`
            on a CUDA card, 0 on the CPU): counted against every card, not in `breakdown`.
        card_bytes: what each card must have: `peak_bytes` plus the CUDA context.
        breakdown: bytes live at the peak by kind: parameters, gradients, optimizer_state,
            activations (made in forward), temporaries (the rest).
        peak_phase: where the step peaks: forward, backward, optimizer or evaluation (None when
            the peak was measured by the probe, not traced).
        phase_peaks: each phase's peak of live bytes.
        evaluation_bytes: the evaluation's peak; None without one (a model given alone).
        method: "trace", "probe" (measured: the model cannot be traced) or "none".
        reason: why not traced, or how the evaluation is bounded ("" when all was traced).
        seconds: the whole call's time; prediction_seconds: the first prediction's.
        cards: one `CardFit` per card asked about.
        world_size, strategy: the ranks predicted (1 and None: one card); with several ranks
            every byte above is one rank's, and the global batch is split over them.
    """

    task: str
    config: dict[str, Any]
    device: Device
    own_step: bool
    plan: dict[str, Any]
    peak_bytes: int
    allocated_bytes: int
    cuda_context_bytes: int
    card_bytes: int
    breakdown: dict[str, int]
    peak_phase: str | None
    phase_peaks: dict[str, int]
    evaluation_bytes: int | None
    method: str
    reason: str
    seconds: float
    prediction_seconds: float
    cards: list[CardFit] = field(default_factory=list)
    world_size: int = 1
    strategy: str | None = None

    def card(self, name: str) -> CardFit:
        """The answer for the card called `name` (KeyError if it was not asked about)."""
        for answer in self.cards:
            if answer.card == name:
                return answer
        raise KeyError(name)

    def fits(self, card: str) -> bool:
        """Whether the step fits `card` as asked."""
        return self.card(card).verdict == "fits"

    def to_dict(self) -> dict[str, Any]:
        """The result as plain JSON-able values (`vramtune fit --json`)."""
        return dataclasses.asdict(self)


def fit(
    model: object,
    batch: BatchSource | None = None,
    *,
    optimizer: OptimizerSource = "adamw",
    step: OwnStep | None = None,
    loss: LossFunction | None = None,
    batch_size: int | None = None,
    config: Config | None = None,
    cards: Sequence[str | Card] | None = None,
    plan: Plan | None = None,
    device: Device = "cuda",
    resizes: Sequence[Resize] = DEFAULT_RESIZES,
    margin: float = 0.0,
    world_size: int = 1,
    strategy: StrategyName | None = None,
    lora: Mapping[str, Any] | None = None,
    progress: Progress | None = None,
) -> FitResult:
    """Predict a training step's peak memory and whether it fits each card.

    Args:
        model: an ``nn.Module``, a builder ``() -> nn.Module``, a vramtune task with
            ``config``, or a Hugging Face config: ``"hf:PATH"`` (a local config.json) or a
            ``PretrainedConfig``, with ``config={"batch_size": B, "seq_len": T}``.
        batch: an example batch (a tensor or tuple of tensors, first dimension = examples) or a
            builder ``(n) -> batch`` made with tensor factories; not with a task.
        optimizer: a name ("adamw", "adam", "sgd", "sgd-momentum", "rmsprop", "adagrad",
            "adafactor") or ``(parameters) -> Optimizer``; not with a task (it has its own).
        step: your own ``step(model, batch, optimizer)``, traced as written in the loop
            ``for batch in batches: out = step(model, batch, optimizer)``; None: vramtune's step
            (``loss(model, batch).backward(); optimizer.step()``), which plans can resize.
        loss: ``loss(model, batch)`` for vramtune's step (default: the output's ``.loss``
            or mean).
        batch_size: the batch to predict; default the example batch's (required with a builder).
            With several ranks, the global batch: each rank runs batch_size / world_size.
        config: a task's configuration (its batch size and shape parameters).
        cards: card names (`vramtune.CARDS`, case-insensitive), sizes such as
            "8GiB", or `Card`s; None: every built-in card.
        plan: run the step under this plan (micro-batches, checkpointing, bf16...) rather than
            as asked; not with ``step``.
        device: "cuda" predicts a CUDA card (its kernels and caching allocator, emulated on
            a CPU-only torch; its CUDA context counted); "cpu" the CPU's run, to the byte.
        resizes: the plan rungs a card that does not fit may climb (one card only).
        margin: the fraction of each card's usable memory to keep free.
        world_size: ranks; above 1, rank 0 is traced (the ladder's per-rank trace) and
            compared with each card as asked.
        strategy: with ``world_size`` above 1: "ddp" or "fsdp2" (alias "fsdp").
        lora: LoRA on a Hugging Face causal LM: ``{"r": 16}``, QLoRA ``"quantized_base"``.
        progress: called with a line before each slow step (the CLI's ``--progress``).

    Raises:
        ValueError: bad arguments, each naming the argument (an unknown card or optimizer, a
            configuration without the task's batch size, a missing Hugging Face config).
        TaskConfigError: the task refuses the configuration.
    """
    started = time.perf_counter()
    runner, task, config = _resolve(
        model,
        batch,
        optimizer=optimizer,
        step=step,
        loss=loss,
        batch_size=batch_size,
        config=config,
        lora=lora,
    )
    own_step = getattr(task, "own_step", None) is not None
    plan = _with_ranks(plan or Plan(), world_size, strategy, runner, task, config)
    if own_step and plan != Plan():
        raise ValueError("plan: your own step runs as written; plans resize vramtune's step")
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin: a fraction in [0, 1), got {margin}")
    chosen = [c if isinstance(c, Card) else card_named(c) for c in _cards_or_all(cards)]
    say = _Steps(progress, 1 + len(chosen))
    with traces_told(say.tracing):
        return _fit(runner, task, config, plan, chosen, device, resizes, margin, say, started)


def _fit(
    runner: TrialRunner,
    task: Task | None,
    config: Config,
    plan: Plan,
    chosen: list[Card],
    device: Device,
    resizes: Sequence[Resize],
    margin: float,
    say: _Steps,
    started: float,
) -> FitResult:
    """`fit` on checked arguments: the step's prediction, its phases, then card by card."""
    own_step = getattr(task, "own_step", None) is not None
    reference = _spec(Card("reference", 10**18, 10**18), device)  # no limit: the step alone
    say("the step" + (f", rank 0 of {plan.world_size}" if plan.world_size > 1 else ""))
    prediction = _predict(runner, task, config, plan, reference)
    phases = (
        phase_peaks(task, config, plan, reference)
        if task is not None and plan.world_size == 1
        else {}
    )
    context = CUDA_CONTEXT_BYTES if device == "cuda" else 0
    answers = []
    for card in chosen:
        say(card.name)
        answers.append(
            _card_fit(runner, task, config, plan, prediction, card, device, resizes, margin)
        )
    return FitResult(
        task=task.name if task is not None else runner.task_name,
        config=dict(config),
        device=device,
        own_step=own_step,
        plan=plan.model_dump(),
        peak_bytes=footprint(prediction),
        allocated_bytes=prediction.peak_allocated_bytes,
        cuda_context_bytes=context,
        card_bytes=footprint(prediction) + context,
        breakdown=dict(prediction.breakdown),
        peak_phase=max(phases, key=phases.__getitem__) if phases else None,
        phase_peaks=dict(phases),
        evaluation_bytes=_evaluation_bytes(task, plan, prediction),
        method=prediction.method,
        reason=prediction.reason,
        seconds=time.perf_counter() - started,
        prediction_seconds=prediction.seconds,
        cards=answers,
        world_size=plan.world_size,
        strategy=plan.strategy,
    )


class _Steps:
    """Numbers each progress line ("[3/9] T4..."), and within a step names each trace it
    starts ("[3/9] T4: tracing micro-batch 16 of 64..."); silent without a `progress`."""

    def __init__(self, progress: Progress | None, total: int) -> None:
        self.progress = progress
        self.total = total
        self.done = 0
        self.step = ""

    def __call__(self, what: str) -> None:
        self.done += 1
        self.step = what
        self._tell(what)

    def tracing(self, task: Task, config: Config, plan: Plan) -> None:
        """The predictor's listener: a trace of this micro-batch and plan starts now."""
        batch = int(config.get(getattr(task, "batch_size_param", ""), 0))
        micro = plan.micro_batch or batch
        size = f"micro-batch {micro} of {batch}" if micro != batch else f"batch {batch}"
        rungs = plan_in_words(plan.model_copy(update={"micro_batch": None, "accumulation": 1}))
        flags = "" if rungs == "as asked" else f", {rungs}"
        self._tell(f"{self.step}: tracing {size}{flags}")

    def _tell(self, what: str) -> None:
        if self.progress is not None:
            self.progress(f"[{self.done}/{self.total}] {what}...")


def _with_ranks(
    plan: Plan,
    world_size: int,
    strategy: StrategyName | None,
    runner: TrialRunner,
    task: Task | None,
    config: Config,
) -> Plan:
    """`plan` at `world_size` ranks under `strategy`, each argument checked by name."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: a whole number of ranks >= 1, got {world_size!r}")
    if strategy is not None and strategy not in get_args(StrategyName):
        raise ValueError(f"strategy: 'ddp' or 'fsdp2', got {strategy!r}")
    if (world_size > 1) != (strategy is not None):
        raise ValueError("strategy: give one ('ddp' or 'fsdp2') with world_size above 1, only then")
    if world_size == 1:
        return plan
    if task is None:
        raise ValueError("world_size: this task's own loop cannot be traced per rank")
    if getattr(task, "own_step", None) is not None:
        raise ValueError("world_size: your own step runs on one card; ranks run vramtune's")
    batch = runner.batch_size(config)
    if batch % world_size:
        raise ValueError(f"world_size: the batch of {batch} does not split over {world_size}")
    fields = {**plan.model_dump(), "world_size": world_size}
    fields["strategy"] = "ddp" if strategy == "ddp" else "fsdp"
    try:
        return Plan.model_validate(fields)
    except ValueError as error:
        raise ValueError(f"plan: with world_size {world_size}: {error}") from error


def _predict(
    runner: TrialRunner, task: Task | None, config: Config, plan: Plan, card: CardSpec
) -> Prediction:
    """One card's prediction, or rank 0's (the plan ladder's own per-rank trace)."""
    if plan.world_size == 1 or task is None:  # task None: refused with ranks (_with_ranks)
        return runner.predict(config, plan, card)
    from vramtune.worker.plan.distributed import rank_prediction

    try:
        return rank_prediction(task, config, plan, card)
    except CannotTrace as error:
        return Prediction(
            peak_allocated_bytes=0, peak_reserved_bytes=0, method="none", reason=error.reason
        )


def _evaluation_bytes(task: Task | None, plan: Plan, prediction: Prediction) -> int | None:
    """The evaluation's peak; none for a model given alone, nor per rank (not traced)."""
    if isinstance(task, ModuleTask) or plan.world_size > 1:
        return None
    return prediction.evaluation_peak_bytes


def _resolve(
    model: object,
    batch: BatchSource | None,
    *,
    optimizer: OptimizerSource,
    step: OwnStep | None,
    loss: LossFunction | None,
    batch_size: int | None,
    config: Config | None,
    lora: Mapping[str, Any] | None = None,
) -> tuple[TrialRunner, Task | None, Config]:
    """(the runner, its Task when it has one, the configuration) for what `fit` was given."""
    if hf_config.is_hf_source(model):
        if batch is not None or step is not None or loss is not None:
            raise ValueError("batch, step and loss: a Hugging Face config brings its own")
        return _resolve_hf(model, optimizer, batch_size, config, _lora_settings(lora))
    if lora is not None:
        raise ValueError("lora: adapters go on a Hugging Face config (hf:PATH) here")
    if _is_model(model):
        if batch is None:
            raise ValueError("batch: give an example batch or a builder (n) -> batch")
        task = ModuleTask(model, batch, optimizer, step=step, loss=loss)  # type: ignore[arg-type]
        size = batch_size or task.example_size()
        if size is None:
            raise ValueError("batch_size: required when batch is a builder")
        if size < 1:
            raise ValueError(f"batch_size: must be at least 1, got {size}")
        return TorchTaskRunner(task), task, {**(config or {}), BATCH_SIZE: size}
    runner = as_runner(model)
    if batch is not None or step is not None or loss is not None or optimizer != "adamw":
        raise ValueError("batch, optimizer, step and loss go with a model; a task has its own")
    wrapped: Task | None = getattr(runner, "task", None)
    given = dict(config or {})
    if batch_size is not None and wrapped is not None:
        given[wrapped.batch_size_param] = batch_size
    if wrapped is not None and wrapped.batch_size_param not in given:
        raise ValueError(f"config: the task's batch size {wrapped.batch_size_param!r} is missing")
    return runner, wrapped, given


def _resolve_hf(
    model: object,
    optimizer: OptimizerSource,
    batch_size: int | None,
    config: Config | None,
    lora: Any,
) -> tuple[TrialRunner, Task, Config]:
    """A Hugging Face config's model as a task: batch_size examples of seq_len tokens."""
    given = dict(config or {})
    unknown = sorted(set(given) - hf_config.KEYS)
    if unknown:
        raise ValueError(f"config: a Hugging Face model reads batch_size and seq_len: {unknown}")
    size = batch_size if batch_size is not None else given.get(BATCH_SIZE)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"batch_size: a whole number >= 1 is required, got {size!r}")
    seq_len = given.get(hf_config.SEQ_LEN)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"config: seq_len, the tokens per example (>= 1), got {seq_len!r}")
    try:
        task = hf_config.hf_task(model, seq_len, optimizer, lora)
    except hf_config.HFConfigError as error:
        raise ValueError(f"model: {error}") from error
    return TorchTaskRunner(task), task, {BATCH_SIZE: size, hf_config.SEQ_LEN: seq_len}


def _lora_settings(lora: Mapping[str, Any] | None) -> Any:
    """hf-causal-lm's LoRASettings for `lora`, or None; what is missing or wrong, named."""
    if lora is None:
        return None
    if importlib.util.find_spec("peft") is None:
        raise ValueError("lora: LoRA needs peft: pip install 'vramtune[peft]'")
    from vramtune.worker.tasks.hf import LoRASettings

    try:
        settings = LoRASettings.model_validate(dict(lora))
    except ValidationError as error:
        said = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
        raise ValueError(f"lora: {said}") from error
    if settings.quantized_base != "none" and importlib.util.find_spec("torchao") is None:
        raise ValueError("lora: a quantized base needs torchao: pip install 'vramtune[qlora]'")
    return settings


def _is_model(model: object) -> bool:
    """A module, a module class, or a builder function (rather than a task or a runner)."""
    if isinstance(model, nn.Module):
        return True
    if inspect.isclass(model):
        return issubclass(model, nn.Module)
    return callable(model) and not hasattr(model, "build_model") and not hasattr(model, "run")


def _cards_or_all(cards: Sequence[str | Card] | None) -> Sequence[str | Card]:
    if cards is None:
        return list(CARDS.values())
    if isinstance(cards, str):  # one name, not its letters
        return [cards]
    return cards


def _spec(card: Card, device: Device) -> CardSpec:
    """The predictor's card: no measured constants (the usable memory allows for them)."""
    info = CardInfo(
        model=card.name[:256],
        total_bytes=card.usable_bytes,
        free_bytes=card.usable_bytes,
        simulated=device == "cpu",
    )
    return CardSpec(info=info, device="cuda:0" if device == "cuda" else "cpu")


def _card_fit(
    runner: TrialRunner,
    task: Task | None,
    config: Config,
    plan: Plan,
    prediction: Prediction,
    card: Card,
    device: Device,
    resizes: Sequence[Resize],
    margin: float,
) -> CardFit:
    """Fits as asked, through a plan (the ladder's), or not; and the largest micro-batch.

    On a CUDA card the CUDA context is counted against the card: the allocator's footprint
    (every prediction, plan and micro-batch search) must fit what the context leaves."""
    spec = _spec(card, device)
    budget = int(card.usable_bytes * (1.0 - margin))
    context = CUDA_CONTEXT_BYTES if device == "cuda" else 0
    tensors = budget - context  # what the caching allocator may reserve
    ranks = plan.world_size > 1
    largest = None if ranks else _largest(runner, task, config, plan, tensors, spec)
    base = CardFit(card.name, budget, "does not fit", largest_micro_batch=largest)
    if prediction.method != "none" and footprint(prediction) <= tensors:
        return dataclasses.replace(base, verdict="fits")
    if ranks or getattr(task, "own_step", None) is not None or plan != Plan():
        # Your own step, a plan you chose or ranks you chose are not resized: the gap is the
        # whole answer.
        return dataclasses.replace(base, short_by_bytes=max(footprint(prediction) - tensors, 0))
    # The margin is already out of `tensors`: the ladder gets what is left, margin-free.
    decision = _climb(runner, config, spec, tensors, resizes, 0.0)
    if isinstance(decision, HandBack):
        smallest = decision.plan.model_copy(update={"reason": ""}) if decision.plan else None
        return dataclasses.replace(
            base,
            plan=smallest.model_dump() if smallest is not None else None,
            plan_in_words=plan_in_words(smallest),
            plan_footprint_bytes=decision.min_footprint_bytes + context,
            short_by_bytes=max(decision.min_footprint_bytes - tensors, 0),
        )
    chosen = decision.plan.model_copy(update={"reason": ""})
    return dataclasses.replace(
        base,
        verdict="fits with a plan",
        plan=chosen.model_dump(),
        plan_in_words=plan_in_words(chosen),
        plan_footprint_bytes=footprint(decision.prediction) + context,
        slowdown=round(expected_slowdown(chosen, runner.batch_size(config)), 3),
    )


def _climb(
    runner: TrialRunner,
    config: Config,
    spec: CardSpec,
    free_bytes: int,
    resizes: Sequence[Resize],
    margin: float,
) -> RunAsPlanned | HandBack:
    """The ladder's decision for the card. A task that marks no modules to checkpoint says so
    only when a checkpointing plan is built (TaskConfigError; a plain module without a
    ModuleList or Sequential, a PlainTask that keeps the default): the ladder is then climbed
    again without that rung, rather than failing the whole answer."""
    policy = MemoryPolicy(resizes=list(resizes), margin=margin)
    try:
        return choose_plan(runner, config, policy, spec, free_bytes)
    except TaskConfigError as error:
        if "checkpointing" not in resizes or "checkpointing" not in str(error):
            raise
    kept = [rung for rung in resizes if rung not in ("checkpointing", "selective_checkpointing")]
    return choose_plan(
        runner, config, policy.model_copy(update={"resizes": kept}), spec, free_bytes
    )


def _largest(
    runner: TrialRunner,
    task: Task | None,
    config: Config,
    plan: Plan,
    budget: int,
    spec: CardSpec,
) -> int | None:
    """The largest micro-batch that fits `budget` under `plan`'s flags; with the user's own
    step (which takes the whole batch) the largest batch up to the asked one."""
    if task is None:
        search = getattr(runner, "largest_micro_batch", None)
        found = search(config, plan, budget, spec) if search is not None else None
        return None if found is None else int(found[0])
    if getattr(task, "own_step", None) is None:
        solved = largest_micro_batch(task, config, plan, budget, spec)
        return None if solved is None else solved[0]

    def fits(size: int) -> bool:
        sized = {**config, task.batch_size_param: size}
        predicted = predict(task, sized, plan, spec)
        return predicted.method != "none" and footprint(predicted) <= budget

    batch = runner.batch_size(config)
    if fits(batch):
        return batch
    if not fits(1):
        return None
    low, high = 1, batch  # low fits, high does not: the peak grows with the batch
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low
