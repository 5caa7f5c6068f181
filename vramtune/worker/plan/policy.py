"""The fit policy: from a prediction and the study's memory policy, how to run a trial here.

Plans are tried in the order DESIGN.md section 2 step 4 gives: as asked → a smaller micro-batch
with gradient accumulation (the effective batch, a hyperparameter, never changes) → + a rung that
keeps the numerics → + bf16 autocast, then 8-bit AdamW, then Adafactor, then bf16 with each (only
when the study lists them: they change the numerics). The study's `memory_policy.resizes` names
the rungs allowed, in any order: micro_batch, checkpointing (every block), selective_checkpointing
(the fewest of the model's blocks that fit, at the largest micro-batch that fits with all of them
checkpointed; it may choose every block, so it stands for checkpointing where both are allowed),
chunked_cross_entropy (the loss over the vocabulary in chunks), activation_offload and
optimizer_offload (the saved activations, or the optimizer's state and step, in host memory:
offered on CUDA cards only, worker/trial/offload.py), bf16, adamw_8bit (torchao's AdamW8bit),
adafactor (torch.optim.Adafactor; both for the task's optimizer). Each rung is tried alone with
micro-batches first; the rungs that keep the numerics are combined (each pair, then all of them)
only when none fits alone (`_ladder`: a combination costs more predictions). Among the plans that
keep the numerics the one with the least predicted time per step wins (service.step_time: the
fleet's own fit for this card model and task, the fixed model before any measurement); bf16 and
the swapped optimizers are used only when nothing else fits. A plan that already ran out of
memory on this card model (`plans_tried`) is never chosen again, nor any plan predicted to need
as much; after an OOM, plans whose micro-batch is smaller than the smallest that ran out are
searched first (a run can die above a micro-batch the prediction missed: a faster plan at the
same micro-batch, say with checkpointing, would likely die the same way).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from vramtune.common.memory import apply_calibration, peak_of
from vramtune.common.plans import PlanKey, plan_in_words, plan_key, rungs_of
from vramtune.common.step_time import default_step_time_fit, predicted_step_s, step_time_slowdown
from vramtune.common.units import human_bytes, human_pair
from vramtune.service.wire import (
    Calibration,
    MemoryPolicy,
    Plan,
    PlanOptimizer,
    PlanOut,
    Prediction,
    StepTimeFit,
    StepTimeObservation,
)
from vramtune.worker.trial.rungs import supported_rungs
from vramtune.worker.trial.runner import (
    OPTIM8BIT_EXTRA,
    CardSpec,
    Config,
    PlanRungs,
    RunResult,
    TrialRunner,
    adamw_8bit_available,
    plan_for_micro_batch,
)

GIB = 1024**3


@runtime_checkable
class MicroBatchSearch(Protocol):
    """A runner that can solve for the largest micro-batch that fits (vramtune/worker/predictor).

    Contract:
        largest_micro_batch(config, plan, budget_bytes, card): the largest micro-batch whose
            predicted peak under `plan`'s flags is at most `budget_bytes`, with that prediction;
            None when not even a micro-batch of 1 fits. It may answer the largest of an even
            split instead (ceil(batch / k) for k micro-batches: the plan the policy evens any
            answer to), which the predictor's solver does to spare a trace.
        predictions_solved(config, plan, card), optional: the predictions a solve made for
            `plan`'s flags, by micro-batch, which the fleet then keeps (else it keeps the
            whole batch's and micro-batch 1's, predicting them if need be).
        costly_micro_batch_of_one, optional (False): a micro-batch of 1 is the runner's
            slowest prediction; whether the ladder's smallest plan fits is then asked of the
            search, which predicts it only when nothing larger fits.
    """

    def largest_micro_batch(
        self, config: Config, plan: Plan, budget_bytes: int, card: CardSpec
    ) -> tuple[int, Prediction] | None: ...


@dataclass(frozen=True)
class RunAsPlanned:
    """Run the trial here with this plan (its reason says why).

    `seconds`: how long choosing it took, every prediction included (the worker records it).
    """

    plan: Plan
    prediction: Prediction
    step_time: StepTimeObservation | None = None
    seconds: float = 0.0


@dataclass(frozen=True)
class HandBack:
    """Nothing allowed fits this card: give the trial back with the smallest footprint seen."""

    min_footprint_bytes: int
    plan: Plan | None
    reason: str
    seconds: float = 0.0


Decision = RunAsPlanned | HandBack


@dataclass(frozen=True)
class _Stage:
    """One rung of the ladder: which resizes are on (`selective`: checkpointing the fewest
    blocks that fit rather than all of them)."""

    micro_batch: bool
    checkpointing: bool
    bf16: bool
    selective: bool = False
    chunked_loss: bool = False
    optimizer: PlanOptimizer | None = None
    activation_offload: bool = False
    optimizer_offload: bool = False

    @property
    def changes_numerics(self) -> bool:
        """bf16 and a swapped optimizer change the numerics: tried only after every other
        stage."""
        return self.bf16 or self.optimizer is not None

    def flags(self) -> dict[str, Any]:
        """The plan flags of the stage's smallest footprint (every block checkpointed)."""
        return {
            "checkpointing": self.checkpointing,
            "bf16": self.bf16,
            "chunked_loss": self.chunked_loss,
            "optimizer": self.optimizer,
            "activation_offload": self.activation_offload,
            "optimizer_offload": self.optimizer_offload,
        }

    def best_slowdown(self, batch: int, fit: StepTimeFit | None, blocks: int | None) -> float:
        """The least slowdown any plan of this stage can have (a micro-batch of the full batch,
        one block checkpointed when selective)."""
        fewest = 1 if self.selective else None
        plan = Plan(**self.flags(), checkpoint_blocks=fewest)
        return expected_slowdown(plan, batch, fit, blocks)


def step_features(
    plan: Plan,
    batch_size: int,
    prediction: Prediction | None = None,
    as_asked_bytes: int = 0,
    blocks: int | None = None,
) -> StepTimeObservation:
    """What the step-time model reads of a run: its plan's shape and the model's size
    (`blocks`: how many selective checkpointing chooses among). On several ranks the
    micro-batches are one rank's share of the batch."""
    share = max(batch_size // plan.world_size, 1)
    micro = min(plan.micro_batch or share, share)
    return StepTimeObservation(
        batch_size=batch_size,
        micro_batch=micro,
        micro_batches=math.ceil(share / micro),
        world_size=plan.world_size,
        strategy=plan.strategy,
        reshard_after_forward=plan.reshard_after_forward,
        checkpointing=plan.checkpointing,
        checkpointed_fraction=_checkpointed_fraction(plan, blocks),
        chunked_loss=plan.chunked_loss,
        bf16=plan.bf16,
        activation_offload=plan.activation_offload,
        optimizer_offload=plan.optimizer_offload,
        optimizer=plan.optimizer,
        parameter_bytes=0 if prediction is None else prediction.breakdown.get("parameters", 0),
        as_asked_peak_bytes=as_asked_bytes,
    )


def _checkpointed_fraction(plan: Plan, blocks: int | None) -> float | None:
    """k/L for selective checkpointing of k of L blocks; None when all (or none) are."""
    if not plan.checkpointing or plan.checkpoint_blocks is None or not blocks:
        return None
    return min(plan.checkpoint_blocks / blocks, 1.0)


def measured_step_time(
    features: StepTimeObservation | None, result: RunResult
) -> StepTimeObservation | None:
    """The features with the run's training seconds per step (evaluation excluded)."""
    if features is None or not result.samples_per_s:
        return features
    return features.model_copy(
        update={"measured_step_s": features.batch_size / result.samples_per_s}
    )


def expected_slowdown(
    plan: Plan, batch_size: int, fit: StepTimeFit | None = None, blocks: int | None = None
) -> float:
    """Predicted time per optimizer step under `plan`, relative to running it as asked."""
    features = step_features(plan, batch_size, blocks=blocks)
    return step_time_slowdown(fit or default_step_time_fit(), features)


def choose_plan(
    runner: TrialRunner,
    config: Config,
    policy: MemoryPolicy,
    card: CardSpec,
    free_bytes: int,
    plans_tried: Sequence[PlanOut] = (),
    calibration: Calibration | None = None,
    step_fit: StepTimeFit | None = None,
) -> Decision:
    """The fitting plan of least predicted step time within `free_bytes` less the policy's
    margin, or a hand-back. `step_fit` is the fleet's step-time model for this card and task.

    The decision's `seconds` is the time the choice took, every prediction it needed included.
    """
    started = time.perf_counter()
    decision = _choose(runner, config, policy, card, free_bytes, plans_tried, calibration, step_fit)
    return dataclasses.replace(decision, seconds=time.perf_counter() - started)


def _choose(
    runner: TrialRunner,
    config: Config,
    policy: MemoryPolicy,
    card: CardSpec,
    free_bytes: int,
    plans_tried: Sequence[PlanOut],
    calibration: Calibration | None,
    step_fit: StepTimeFit | None,
) -> Decision:
    chooser = _Chooser(runner, config, card, calibration, runner.batch_size(config), step_fit)
    first = chooser.predict(Plan())
    if first.method == "none":
        return _blind_plan(chooser.batch, policy, plans_tried, first)
    margin_budget = int(free_bytes * (1.0 - policy.margin))
    budget = chooser.below_tried(margin_budget, plans_tried)
    ladder = _ladder(runner, policy, config, card)
    below_oom = _micro_batch_cap(chooser.batch, plans_tried)
    for precise, cap in _search_order(below_oom, chooser.batch):
        tiers = [tier for tier in ladder if tier[0].changes_numerics != precise]
        stages = [stage for tier in tiers for stage in tier]
        if not stages or (peak_of(first) > budget and not chooser.smallest_fits(stages, budget)):
            continue
        found = None
        for tier in tiers:  # combinations only where no rung alone fits
            found = chooser.cheapest(tier, budget, _keys(plans_tried), cap)
            if found is not None:
                break
        if found is not None:
            plan, prediction = found
            reason = _reason(chooser, plan, prediction, first, budget, free_bytes, policy)
            features = chooser.step_time(plan, prediction, peak_of(first))
            return RunAsPlanned(plan.model_copy(update={"reason": reason}), prediction, features)
    return chooser.hand_back(
        [stage for tier in ladder for stage in tier], budget, free_bytes, policy
    )


class _Chooser:
    """Predictions of one configuration on one card, calibrated and compared to a budget."""

    def __init__(
        self,
        runner: TrialRunner,
        config: Config,
        card: CardSpec,
        calibration: Calibration | None,
        batch: int,
        step_fit: StepTimeFit | None = None,
    ) -> None:
        self.runner = runner
        self.config = config
        self.card = card
        self.calibration = calibration
        self.batch = batch
        self.step_fit = step_fit
        self.blocks = _block_count(runner, config)
        self._predictions: dict[PlanKey, Prediction] = {}

    def step_time(
        self, plan: Plan, prediction: Prediction, as_asked_bytes: int
    ) -> StepTimeObservation:
        """The run's step-time features with the model's prediction (None before a fit)."""
        features = step_features(plan, self.batch, prediction, as_asked_bytes, self.blocks)
        fit = self.step_fit or default_step_time_fit()
        return features.model_copy(update={"predicted_step_s": predicted_step_s(fit, features)})

    def predict(self, plan: Plan) -> Prediction:
        """The runner's prediction with the service's calibration applied (once per plan)."""
        key = plan_key(plan)
        if key not in self._predictions:
            raw = self.runner.predict(self.config, plan, self.card)
            calibrated = raw if self.calibration is None else _calibrated(raw, self.calibration)
            self._predictions[key] = calibrated
        return self._predictions[key]

    def below_tried(self, budget: int, plans_tried: Sequence[PlanOut]) -> int:
        """An OOM shows this card cannot hold what the tried plan was predicted to need."""
        for tried in plans_tried:
            budget = min(budget, peak_of(self.predict(_plan_of(tried))) - 1)
        return budget

    def smallest_fits(self, stages: Sequence[_Stage], budget: int) -> bool:
        """Whether the ladder's smallest plan (its last stage at a micro-batch of 1) fits.

        Each resize only lowers the peak (the hand-back reports that plan as the smallest for
        the same reason), so when it does not fit no plan of the ladder does: one trace
        settles what searching every stage would take two each to find. A ladder of one stage
        (no resizes) is left to the search.
        """
        if len(stages) < 2:
            return True
        smallest = stages[-1]
        costly = smallest.micro_batch and getattr(self.runner, "costly_micro_batch_of_one", False)
        if costly and self.largest_micro_batch(smallest, budget) is not None:
            # A micro-batch of 1 is such a runner's slowest prediction (a Trainer's traces a
            # window of the whole batch): its search answers the question, and the stage's own
            # search later finds what it predicted. None: nothing fits, or the stage cannot be
            # traced at all, which only the prediction below tells apart.
            return True
        micro = 1 if smallest.micro_batch else self.batch
        plan = plan_for_micro_batch(self.batch, micro, **smallest.flags())
        prediction = self.predict(plan)
        # A stage that cannot be traced (checkpointing a model without it) settles nothing:
        # the search passes over its plans and finds those of the stages that can.
        return prediction.method == "none" or peak_of(prediction) <= budget

    def cheapest(
        self, stages: Sequence[_Stage], budget: int, tried: set[PlanKey], cap: int
    ) -> tuple[Plan, Prediction] | None:
        """The fitting plan of least predicted step time over `stages` with micro-batches of at
        most `cap` (earlier wins ties)."""
        best: tuple[Plan, Prediction] | None = None
        best_slowdown = math.inf
        for stage in stages:
            if stage.best_slowdown(self.batch, self.step_fit, self.blocks) >= best_slowdown:
                continue
            found = self.fit(stage, budget, cap)
            if found is not None and stage.selective:
                found = self.fewest_blocks(found[0], budget, tried)
            if found is None or plan_key(found[0]) in tried:
                continue
            slowdown = expected_slowdown(found[0], self.batch, self.step_fit, self.blocks)
            if slowdown < best_slowdown:
                best, best_slowdown = found, slowdown
        return best

    def fit(self, stage: _Stage, budget: int, cap: int) -> tuple[Plan, Prediction] | None:
        """The largest-micro-batch plan of `stage`, micro-batch at most `cap`, predicted to fit
        `budget`."""
        if not stage.micro_batch:
            if self.batch > cap:
                return None
            plan = Plan(**stage.flags())
            prediction = self.predict(plan)
            return (plan, prediction) if _fits(prediction, budget) else None
        micro = self.largest_micro_batch(stage, budget)
        if micro is None:
            return None
        micro = min(micro, cap)
        # The same number of micro-batches, evenly split: the smallest peak for that slowdown.
        micro = math.ceil(self.batch / math.ceil(self.batch / micro))
        plan = plan_for_micro_batch(self.batch, micro, **stage.flags())
        prediction = self.predict(plan)
        return (plan, prediction) if _fits(prediction, budget) else None

    def fewest_blocks(
        self, every: Plan, budget: int, tried: set[PlanKey]
    ) -> tuple[Plan, Prediction] | None:
        """The plan `every` (all blocks checkpointed, fitting) with the fewest checkpointed
        blocks that fit instead, bisected as the micro-batch is: checkpointing more blocks
        keeps fewer activations. Plans that ran out of memory here do not count as fitting."""
        blocks = self.blocks or 1  # a selective stage exists only with blocks

        def plan_with(k: int) -> Plan:  # k = all blocks is `every` itself, predicted already
            return every.model_copy(update={"checkpoint_blocks": k if k < blocks else None})

        def fits(k: int) -> bool:
            plan = plan_with(k)
            return plan_key(plan) not in tried and _fits(self.predict(plan), budget)

        fewest = _smallest_true(blocks, fits)
        if fewest is None:
            return None
        plan = plan_with(fewest)
        return plan, self.predict(plan)

    def largest_micro_batch(self, stage: _Stage, budget: int) -> int | None:
        """Ask the predictor's solver when the runner has one, else bisect on predictions."""
        if isinstance(self.runner, MicroBatchSearch):
            raw_budget = _uncalibrated_budget(budget, self.calibration)
            solved = self.runner.largest_micro_batch(
                self.config, Plan(**stage.flags()), raw_budget, self.card
            )
            return None if solved is None else solved[0]
        return _largest_true(
            self.batch,
            lambda micro: _fits(
                self.predict(plan_for_micro_batch(self.batch, micro, **stage.flags())), budget
            ),
        )

    def hand_back(
        self, stages: Sequence[_Stage], budget: int, free_bytes: int, policy: MemoryPolicy
    ) -> HandBack:
        """Give the trial back with the footprint of the smallest allowed plan that can run.

        `stages`: the ladder's, smallest footprint last. A stage whose plans cannot be traced
        (checkpointing a Trainer's model that has no gradient checkpointing) is passed over:
        its prediction's 0 B would send the trial to any card (issue 43)."""
        for smallest in reversed(stages):
            plan, prediction, cannot_run = self._smallest_plan(smallest)
            if prediction.method != "none":
                break
        else:  # nothing resized can be traced: the plan as asked can (choose_plan checked)
            plan, prediction, cannot_run = Plan(), self.predict(Plan()), None
        need = peak_of(prediction)
        # Near the limit the two numbers round alike: say both apart and by how much it is
        # over, and that the budget is what is free less the safety margin (issue 43).
        needs, usable = human_pair(need, budget)
        reason = (
            f"does not fit: the smallest allowed plan ({plan_in_words(plan)}) needs {needs}, "
            f"{human_bytes(need - budget)} over the budget of {usable} ({human_bytes(free_bytes)}"
            f" free less the {policy.margin:.0%} safety margin)"
        )
        if cannot_run is not None:
            reason += f"; smaller micro-batches cannot run: {cannot_run.reason}"
        reason += _missing_packages(self.runner, policy)
        return HandBack(need, plan.model_copy(update={"reason": reason}), reason)

    def _smallest_plan(self, stage: _Stage) -> tuple[Plan, Prediction, Prediction | None]:
        """(the stage's smallest plan, its prediction, the micro-batch of 1's when that could
        not run): micro-batches of 1 where the stage splits, else (or when a micro-batch of 1
        cannot run, e.g. BatchNorm) the whole batch."""
        micro = 1 if stage.micro_batch else self.batch
        plan = plan_for_micro_batch(self.batch, micro, **stage.flags())
        prediction = self.predict(plan)
        if prediction.method != "none" or micro == self.batch:
            return plan, prediction, None
        whole = Plan(**stage.flags())
        return whole, self.predict(whole), prediction


def _ladder(
    runner: TrialRunner, policy: MemoryPolicy, config: Config, card: CardSpec
) -> list[list[_Stage]]:
    """The allowed plans' stages in two tiers: each rung alone (with micro-batches), then the
    rungs combined (each pair, then all of them: the smallest footprint, last). The second is
    searched only when nothing of the first fits: combining costs predictions (a micro-batch
    solve and a bisection over blocks each) that a plan one rung can fit never needs. A rung
    the runner cannot take for this configuration, or this card (the offloads), is left out.
    With bf16 listed, the same two tiers with bf16 follow, then those with each optimizer rung
    listed (8-bit AdamW, Adafactor), then with bf16 and each (`_numerics_changes`; `_choose`
    searches them only when no plan that keeps the numerics fits, each pair only when the one
    before fits nothing)."""
    # Only rungs the runner can take for this configuration on this card (worker/trial/
    # rungs.py): a listed rung it cannot take would fail the trial, not resize it (issue 43).
    can = supported_rungs(runner, card.device, config)
    listed: set[str] = set(policy.resizes) if policy.allow_resize else set()
    allowed = listed.intersection(can)
    base = _Stage(micro_batch="micro_batch" in allowed, checkpointing=False, bf16=False)
    found = (_checkpointing_rung(allowed), _chunked_rung(allowed))
    offloads = [rung for rung in ("activation_offload", "optimizer_offload") if rung in allowed]
    rungs = [rung for rung in found if rung is not None] + offloads
    singles = [_Stage(micro_batch=False, checkpointing=False, bf16=False)]
    singles += [base] if base.micro_batch else []
    singles += [_with(base, rung) for rung in rungs]
    pairs = [_with(_with(base, a), b) for a, b in itertools.combinations(rungs, 2)]
    every = [functools.reduce(_with, rungs, base)] if len(rungs) > 2 else []
    combined = pairs + every
    precise = [singles, combined]
    changes = _numerics_changes(allowed)
    changed = [[dataclasses.replace(s, **c) for s in tier] for c in changes for tier in precise]
    return [tier for tier in precise + changed if tier]


def _numerics_changes(allowed: set[str]) -> list[dict[str, Any]]:
    """The numerics-changing rungs the study lists and the runner can take (`allowed`, already
    filtered by `supported_rungs`), in the order the
    ladder tries them: bf16, 8-bit AdamW, Adafactor, then bf16 with each (the smallest
    footprint, last). 8-bit AdamW comes before Adafactor: it keeps AdamW's update and rounds
    only its state (≈ 2 bytes a parameter), where Adafactor changes the update to keep less.
    A runner swaps the optimizer only when it says so (`can_swap_optimizer`: the worker's own
    loop does; the Trainer and Lightning build theirs); adamw_8bit also needs torchao here
    (`_missing_packages` says so in a hand-back)."""
    bf16 = [{"bf16": True}] if "bf16" in allowed else []
    swaps: list[dict[str, Any]] = [
        {"optimizer": name} for name in _SWAPS_IN_ORDER if name in allowed
    ]
    both = [{**bf16[0], **swap} for swap in swaps] if bf16 else []
    return bf16 + swaps + both


_SWAPS_IN_ORDER: tuple[PlanOptimizer, ...] = ("adamw_8bit", "adafactor")
"""The optimizer rungs from the least change to the numerics to the smallest state."""


def _missing_packages(runner: TrialRunner, policy: MemoryPolicy) -> str:
    """Why a listed rung was not tried on this worker, for a hand-back's reason ('' if none)."""
    listed = policy.allow_resize and "adamw_8bit" in policy.resizes
    if listed and getattr(runner, "can_swap_optimizer", False) and not adamw_8bit_available():
        return f"; the adamw_8bit rung is listed but torchao is not installed: {OPTIM8BIT_EXTRA}"
    return ""


def _checkpointing_rung(allowed: set[str]) -> str | None:
    """Which checkpointing the ladder may use: the fewest blocks that fit (which may be every
    block) where allowed and possible, else every block where allowed."""
    if "selective_checkpointing" in allowed:
        return "selective"
    return "every" if "checkpointing" in allowed else None


def _chunked_rung(allowed: set[str]) -> str | None:
    """The chunked loss where allowed and the task computes its loss in chunks."""
    return "chunked" if "chunked_cross_entropy" in allowed else None


def _with(stage: _Stage, rung: str) -> _Stage:
    """`stage` with one more rung on (see `_ladder`)."""
    if rung == "chunked":
        return dataclasses.replace(stage, chunked_loss=True)
    if rung == "activation_offload":
        return dataclasses.replace(stage, activation_offload=True)
    if rung == "optimizer_offload":
        return dataclasses.replace(stage, optimizer_offload=True)
    return dataclasses.replace(stage, checkpointing=True, selective=rung == "selective")


def _block_count(runner: TrialRunner, config: Config) -> int | None:
    """How many blocks selective checkpointing chooses among for `config` (None: it cannot)."""
    if not runner.can_checkpoint or not isinstance(runner, PlanRungs):
        return None
    return runner.checkpoint_block_count(config)


def _fits(prediction: Prediction, budget: int) -> bool:
    """Whether a prediction says the run fits `budget`: one that predicts nothing (neither
    traced nor probed) never does, though its bytes are 0."""
    return prediction.method != "none" and peak_of(prediction) <= budget


def _micro_batch_cap(batch: int, plans_tried: Sequence[PlanOut]) -> int:
    """One less than the smallest micro-batch that ran out of memory (the batch when none did)."""
    micros = [tried.micro_batch or batch for tried in plans_tried]
    return max(min(micros) - 1, 1) if micros else batch


def _search_order(cap: int, batch: int) -> list[tuple[bool, int]]:
    """(keep precision, micro-batch cap) pairs: precise plans first, each below the OOM first."""
    caps = [cap, batch] if cap < batch else [batch]
    return [(precise, c) for precise in (True, False) for c in caps]


def _largest_true(high: int, fits: Callable[[int], bool]) -> int | None:
    """The largest n in [1, high] with fits(n), for a fits that holds below some n."""
    if not fits(1):
        return None
    low = 1
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low


def _smallest_true(high: int, fits: Callable[[int], bool]) -> int | None:
    """The smallest n in [1, high] with fits(n), for a fits that holds above some n."""
    if not fits(high):
        return None
    low = 1
    while low < high:
        middle = (low + high) // 2
        if fits(middle):
            high = middle
        else:
            low = middle + 1
    return high


def _blind_plan(
    batch: int, policy: MemoryPolicy, plans_tried: Sequence[PlanOut], prediction: Prediction
) -> Decision:
    """Without a prediction: as asked, then halve the micro-batch after each OOM."""
    tried = _keys(plans_tried)
    micro = batch
    while micro >= 1:
        plan = plan_for_micro_batch(batch, micro)
        if plan_key(plan) not in tried:
            reason = f"no prediction ({prediction.reason or 'untraceable'}): {plan_in_words(plan)}"
            return RunAsPlanned(plan.model_copy(update={"reason": reason}), prediction)
        if not (policy.allow_resize and "micro_batch" in policy.resizes):
            break
        micro //= 2
    reason = f"no prediction and every plan down to micro-batch {max(micro, 1)} ran out of memory"
    return HandBack(0, None, reason)


def _calibrated(prediction: Prediction, calibration: Calibration) -> Prediction:
    """The prediction corrected by the service's fit, applied as the contract defines."""
    return apply_calibration(prediction, calibration)


def _uncalibrated_budget(budget: int, calibration: Calibration | None) -> int:
    """The raw-prediction budget whose calibrated value is `budget` (the fit's inverse)."""
    if calibration is None:
        return budget
    line = budget / (1.0 + calibration.margin_fraction)
    return max(math.floor((line - calibration.offset_bytes) / calibration.scale), 0)


def _reason(
    chooser: _Chooser,
    plan: Plan,
    prediction: Prediction,
    as_asked: Prediction,
    budget: int,
    free_bytes: int,
    policy: MemoryPolicy,
) -> str:
    fit = f"predicted {_gib(peak_of(prediction))} <= budget {_gib(budget)}"
    fit += _evaluation_note(prediction)
    if prediction.method == "probe":  # the record and the dashboard say why it was measured
        fit += f" [probed: {prediction.reason}]"
    elif prediction.reason:  # a traced step whose evaluation was bounded, not traced
        fit += f" [{prediction.reason}]"
    room = f"({_gib(free_bytes)} free, margin {policy.margin:.0%})"
    if plan == Plan():
        return f"as asked: {fit} {room}"
    slowdown = expected_slowdown(plan, chooser.batch, chooser.step_fit, chooser.blocks)
    return (
        f"resized to {plan_in_words(plan)} (rungs: {', '.join(rungs_of(plan))}), "
        f"effective batch {chooser.batch} unchanged: as asked needs "
        f"{_gib(peak_of(as_asked))}; fastest plan that fits (predicted slowdown {slowdown:.2f}x),"
        f" {fit} {room}"
    )


def _evaluation_note(prediction: Prediction) -> str:
    """Which peak the plan fits, where the evaluation's is larger than the training step's."""
    training, evaluation = prediction.training_peak_bytes, prediction.evaluation_peak_bytes
    if training is None or evaluation is None or evaluation <= training:
        return ""
    return f" (set by the evaluation: {_mib(evaluation)}, training step {_mib(training)})"


def _plan_of(tried: PlanOut) -> Plan:
    return Plan(**tried.model_dump(exclude={"reason"}))


def _keys(plans: Sequence[PlanOut]) -> set[PlanKey]:
    return {plan_key(plan) for plan in plans}


def _mib(n: int) -> str:
    return f"{n / 2**20:.3f} MiB"


def _gib(n: int) -> str:
    return f"{n / GIB:.3f} GiB"
