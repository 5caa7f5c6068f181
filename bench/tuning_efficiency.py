"""Tuning efficiency on real training: plain Optuna, retry-halving and vramtune, one fleet.

Every arm tunes the same task with the same search space and the same TPE seed (the product's
own sampler, service.optuna_glue.make_sampler) for the same wall budget on the same simulated
fleet: CPU "cards" with simulated memory limits (vramtune.worker.device.memory's tracker stops a run
past its card, as a CUDA OOM would). Every trial is a real torch training (worker.run.training),
measured.

- naive: plain Optuna; a trial runs as asked on the card that is free; one that does not fit
  dies out of memory and is told FAIL.
- retry-halving: on OOM the batch is halved and the trial re-run on the same card until it
  fits (accelerate's ``find_executable_batch_size``): the hyperparameter changes, and Optuna is
  told the metric of a configuration it did not suggest.
- vramtune: the worker's real policy (worker.plan.policy.choose_plan, with the real predictor)
  plans each trial on the card that asks: as asked, or resized keeping the effective batch, or
  handed back; a handed-back trial waits for a larger card (service/fleet.py's offer order),
  and one no card holds is told COMPLETE with a violated memory constraint
  (service.routing's headroom and placeholder values). This arm is the worker with
  --plan-ahead (worker/loop/lookahead.py): each card leases and plans its next trial while its
  current one trains, and hands back in the background a trial it would hand back, planning
  the next (PlanAhead's `settle`). vramtune-lease-late is the candidate that leases the next
  trial, once the fleet's step-time model predicts the current run, only when the planning
  just fits before the run's predicted end (worker.loop.lookahead.lease_delay; the agent does not
  call it yet), and vramtune-plan-on-clock is the worker without --plan-ahead.

The clock is simulated, the work is not: a discrete-event scheduler gives each card a clock
that advances by the CPU-seconds the real run measured (planning included for vramtune), so
neither the machine's two cores nor its load distort one arm against another. Real runs are
made one at a time on one torch thread and cached by (configuration, plan): CPU training is
deterministic (same seed, same thread count), so a completed run's metric, peak and CPU time
serve every card at least as large as its peak; a run that died is cached per card size.
Cached CPU times are the first measurement's.

    .venv/bin/python bench/tuning_efficiency.py --tasks digits-cnn   # one task, seeds 0-4
    .venv/bin/python bench/tuning_efficiency.py --quick    # smoke test: one task, seed 4
"""

from __future__ import annotations

import argparse
import functools
import heapq
import itertools
import json
import logging
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import optuna
import torch

from vramtune.common.plans import plan_in_words
from vramtune.service.fleet.routing import MEMORY_CONSTRAINT, headroom, placeholder_values
from vramtune.service.optuna.glue import make_sampler, search_space
from vramtune.service.step_time import fit_step_time
from vramtune.service.wire import (
    Plan,
    PlanOut,
    Prediction,
    StepTimeFit,
    StepTimeObservation,
    StudyCreate,
    TrainBudget,
)
from vramtune.worker.device.gpu import parse_size, simulated_card
from vramtune.worker.loop.lookahead import lease_delay
from vramtune.worker.plan.policy import Decision, HandBack, RunAsPlanned, choose_plan
from vramtune.worker.tasks.charlm import CharTransformerTask
from vramtune.worker.tasks.digits import DigitsCNNTask
from vramtune.worker.trial.runner import CardSpec, Config, OutOfMemory

try:  # the [hf] extra (in [dev]); without it the benchmark runs the two other tasks
    from vramtune.worker.tasks.hf import HFCausalLMTask
except ImportError:
    HFCausalLMTask = None  # type: ignore[assignment,misc]
from vramtune.worker.plan.time_routing import HandBackForTime, prefer_larger_card
from vramtune.worker.run.training import TorchTaskRunner, TrainingDiverged

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "tuning_efficiency"
FLEET = ("16MiB", "64MiB", "256MiB")
ARMS = (
    "naive",
    "retry-halving",
    "vramtune",
    "vramtune-lease-late",
    "vramtune-plan-on-clock",
)
STEPS = 20
BULKY = ("curve", "attempts", "hand_back_waits", "step_time_observations")  # not printed
QUICK_SEED = 4


@dataclass(frozen=True)
class Bench:
    """One task as the benchmark tunes it: a search space scaled to the fleet's cards."""

    task: Any
    direction: Literal["minimize", "maximize"]
    search_space: dict[str, Any]
    task_config: dict[str, Any]
    budget_s: float  # simulated wall seconds per arm (every card's clock)

    def spec(self, seed: int) -> StudyCreate:
        return StudyCreate(
            name=f"bench-{self.task.name}-{seed}",
            task=self.task.name,
            search_space=self.search_space,
            directions=[self.direction],
            task_config=self.task_config,
            sampler={"name": "tpe", "args": {"seed": seed}},
            budget=TrainBudget(max_steps=STEPS, eval_every=STEPS),
        )


def _choices(*values: Any) -> dict[str, Any]:
    return {"type": "categorical", "choices": list(values)}


# Discrete spaces: what a user sweeps, and what bounds the distinct real runs (the cache).
# Predicted peaks: digits-cnn 0.2-94 MiB, char-transformer 2-148 MiB, hf-causal-lm (GPT-2)
# 1.6-132 MiB: the 16 and 64 MiB cards hold only part of each space as asked. (An 8 MiB card would
# need up to 18 micro-batches, and the predictor traces every one: one plan choice then costs
# ~35 CPU-s on this machine.) Budgets: 2.5x the previous report's 10 and 12 s, so that the
# best-over-time curves are not the first few trials'; each task's invocation stays < 8 min.
BENCHES = {
    "digits-cnn": Bench(
        DigitsCNNTask(),
        "maximize",
        {
            "width": _choices(8, 16, 32),
            "depth": _choices(2, 3),
            "resolution": _choices(8, 16, 24),
            "batch_size": _choices(16, 32, 64, 128, 256),
            "lr": _choices(0.003, 0.01, 0.03),
        },
        {},
        budget_s=25.0,
    ),
    "char-transformer": Bench(
        CharTransformerTask(),
        "minimize",
        {
            "n_layers": _choices(2, 4),
            "d_model": _choices(32, 64),
            "seq_len": _choices(32, 64, 128),
            "batch_size": _choices(8, 16, 32, 64),
            "lr": _choices(0.001, 0.003, 0.01),
        },
        {"n_heads": 4, "corpus_chars": 300_000, "eval_windows": 32},
        budget_s=30.0,
    ),
}
if HFCausalLMTask is not None:
    # A GPT-2 built from its config (transformers, nothing downloaded), on the char task's
    # corpus; 20 steps of the largest configuration (2 x 64 wide, 64 x 128 tokens) take
    # 3.9 CPU-s and peak at 132 MiB predicted, the smallest 0.16 CPU-s and 1.6 MiB.
    BENCHES["hf-causal-lm"] = Bench(
        HFCausalLMTask(),
        "minimize",
        {
            "num_hidden_layers": _choices(1, 2),
            "hidden_size": _choices(32, 64),
            "seq_len": _choices(32, 64, 128),
            "batch_size": _choices(8, 16, 32, 64),
            "lr": _choices(0.001, 0.003, 0.01),
        },
        {
            "model_type": "gpt2",
            "num_attention_heads": 4,
            "corpus_chars": 300_000,
            "eval_windows": 32,
        },
        budget_s=30.0,
    )


@dataclass(frozen=True)
class Outcome:
    """How one real run ended: COMPLETE (with its metric), OOM or FAIL; its CPU time, peak."""

    state: str
    cpu_s: float
    peak_bytes: int
    value: float | None = None
    train_share: float = 1.0  # of the run's time, the training steps' (evaluation excluded)


class _NoPruning:
    """The Reporter of a run nobody prunes."""

    def report(self, step: int, value: float) -> bool:
        return False

    def stop_reason(self) -> str | None:
        return None


def _plan_key(plan: Plan | PlanOut) -> tuple[Any, ...]:
    return (plan.micro_batch, plan.accumulation, plan.checkpointing, plan.bf16)


def _config_key(config: Config, plan: Plan | PlanOut) -> str:
    return json.dumps([sorted(config.items()), _plan_key(plan)])


class RealRuns:
    """Real trainings on this CPU, one at a time, cached (see the module docstring)."""

    def __init__(self, runner: TorchTaskRunner, budget: TrainBudget) -> None:
        self.runner = runner
        self.budget = budget
        self.completed: dict[str, Outcome] = {}
        self.died: dict[tuple[str, int], Outcome] = {}
        self.executed = 0
        self.served = 0

    def run(self, config: dict[str, Any], plan: Plan, card: CardSpec) -> Outcome:
        key, limit = _config_key(config, plan), card.info.total_bytes
        cached = self.completed.get(key)
        if cached is None or cached.peak_bytes > limit:
            cached = self.died.get((key, limit))
        if cached is not None:
            self.served += 1
            return cached
        outcome = self._measure(config, plan, card)
        self.executed += 1
        if outcome.state == "OOM":
            self.died[(key, limit)] = outcome
        else:
            self.completed[key] = outcome
        return outcome

    def _measure(self, config: dict[str, Any], plan: Plan, card: CardSpec) -> Outcome:
        began = time.process_time()
        try:
            result = self.runner.run(config, plan, self.budget, card, _NoPruning())
        except OutOfMemory as error:
            peak = error.measured.peak_allocated_bytes
            return Outcome("OOM", time.process_time() - began, peak)
        except TrainingDiverged:
            return Outcome("FAIL", time.process_time() - began, 0)
        peak, cpu_s = result.measured.peak_allocated_bytes, time.process_time() - began
        # The worker reports training seconds per step, evaluation excluded (worker.run.training):
        # the share of the run's wall time its steps took, applied to its CPU time.
        batch = self.runner.batch_size(config)
        train_s = result.steps * batch / result.samples_per_s if result.samples_per_s else 0.0
        share = min(1.0, train_s / result.duration_s) if result.duration_s > 0 else 1.0
        return Outcome("COMPLETE", cpu_s, peak, result.values[0], share or 1.0)


class TimedPredictor:
    """The task's runner as the planner sees it: real predictions, each computed once for the
    whole benchmark and charged (its CPU-seconds) to the first plan choice of each arm on each
    card that needs it, as one worker process per card, each with its own cache, would pay.
    Keys are what the predictor's own cache keys by: the shape parameters, batch and plan."""

    def __init__(self, runner: TorchTaskRunner) -> None:
        self.runner = runner
        self.task_name = runner.task_name
        self.can_checkpoint, self.can_bf16 = runner.can_checkpoint, runner.can_bf16
        self.can_swap_optimizer = runner.can_swap_optimizer
        self.memo: dict[tuple[Any, ...], tuple[Any, float]] = {}
        self.charged: set[tuple[Any, ...]] = set()
        self.bill = 0.0

    def new_arm(self) -> None:
        self.charged = set()

    def batch_size(self, config: Config) -> int:
        return self.runner.batch_size(config)

    def predict(self, config: Config, plan: Plan, card: CardSpec) -> Prediction:
        key = ("predict", self._shape(config), _plan_key(plan))
        prediction: Prediction = self._timed(
            key, card, lambda: self.runner.predict(config, plan, card)
        )
        return prediction

    def largest_micro_batch(
        self, config: Config, plan: Plan, budget_bytes: int, card: CardSpec
    ) -> tuple[int, Prediction] | None:
        key = ("solve", self._shape(config), _plan_key(plan), budget_bytes)
        found: tuple[int, Prediction] | None = self._timed(
            key, card, lambda: self.runner.largest_micro_batch(config, plan, budget_bytes, card)
        )
        return found

    def run(self, *args: Any) -> Any:
        raise NotImplementedError("the planner never runs a trial")

    def _shape(self, config: Config) -> str:
        task = self.runner.task
        names = sorted({*task.shape_params, task.batch_size_param})
        return json.dumps([(name, config.get(name)) for name in names])

    def _timed(self, key: tuple[Any, ...], card: CardSpec, compute: Callable[[], Any]) -> Any:
        if key not in self.memo:
            began = time.process_time()
            value = compute()
            self.memo[key] = (value, time.process_time() - began)
        value, cost = self.memo[key]
        if (card.info.model, key) not in self.charged:
            self.charged.add((card.info.model, key))
            self.bill += cost
        return value


class Planner:
    """The worker's own plan choice (vramtune.worker.plan.policy.choose_plan), with the fleet's
    step-time model of the card, and the planning CPU-seconds it is charged (see TimedPredictor)."""

    def __init__(self, predictor: TimedPredictor, spec: StudyCreate) -> None:
        self.predictor = predictor
        self.policy = spec.memory_policy
        predictor.new_arm()

    def decide(
        self,
        config: dict[str, Any],
        card: CardSpec,
        tried: Sequence[PlanOut],
        step_fit: StepTimeFit | None,
        larger_card_bytes: int | None,
    ) -> tuple[Decision, float]:
        bill = self.predictor.bill
        decision = choose_plan(
            self.predictor,
            config,
            self.policy,
            card,
            card.info.free_bytes,
            tried,
            step_fit=step_fit,
        )
        # what the worker does next with the assignment's larger card (the server's)
        decision = prefer_larger_card(decision, larger_card_bytes, self.policy, step_fit)
        return decision, self.predictor.bill - bill


@dataclass
class Attempt:
    """One run of a trial on a card: how it ended, when (simulated seconds) and what it cost."""

    trial: int
    card: str
    start: float
    end: float
    state: str
    cpu_s: float
    value: float | None = None
    plan: str = "as asked"
    changed_hyperparameter: bool = False
    params: str = ""  # the trial's parameters as Optuna suggested them (JSON)
    planning_s: float = 0.0  # of the card's busy time, the plan choice it waited for
    asked: float = 0.0  # when the trial was asked (leased): vramtune leases ahead


@dataclass
class Job:
    """A vramtune trial between its ask and its tell (waiting for a larger card, or retried)."""

    trial: optuna.Trial
    asked: float = 0.0  # simulated time of the ask (its first lease)
    min_bytes: int = 0
    handed_back_by: set[str] = field(default_factory=set)
    plans_tried: list[tuple[str, PlanOut]] = field(default_factory=list)

    def tried_on(self, card: str) -> list[PlanOut]:
        return [plan for model, plan in self.plans_tried if model == card]


Work = tuple[float, Callable[[], None]]  # the card's busy seconds; what happens at the end


class Sim:
    """One arm on one seed: the study, the cards' clocks and the events in time order."""

    def __init__(self, bench: Bench, seed: int, fleet: Sequence[CardSpec]) -> None:
        self.bench = bench
        self.spec = bench.spec(seed)
        self.space = search_space(self.spec)
        self.study = optuna.create_study(direction=bench.direction, sampler=make_sampler(self.spec))
        self.fleet = list(fleet)
        self.attempts: list[Attempt] = []
        self.told: list[tuple[float, float]] = []  # (time, value) of feasible COMPLETE trials
        self.infeasible = 0
        self.routed_for_time = 0  # vramtune: slow resizes handed back to a larger card
        self.settled_ahead = 0  # vramtune: hand-backs made in the background (--plan-ahead)
        self.planning_s = 0.0  # planning the cards waited for (on their clocks)
        self.planning_total_s = 0.0  # every plan choice's CPU-seconds, overlapped or not
        self.hand_back_waits: list[tuple[float, float]] = []  # (start, s) of on-clock hand-backs
        self.step_errors: list[tuple[int, float]] = []  # (trials told before, relative error)
        self.step_observations: list[dict[str, Any]] = []  # what the server's fit was fed
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()  # ties in time apply in the order they were scheduled

    def run(self, work: Callable[[CardSpec], Work]) -> Sim:
        """Give every free card work until the budget; apply each run's end in time order."""
        clocks = [(0.0, index) for index in range(len(self.fleet))]
        while clocks:
            now, index = heapq.heappop(clocks)
            self._apply_until(now)
            if now >= self.bench.budget_s:
                continue
            self.now = now
            busy, finish = work(self.fleet[index])
            end = now + max(busy, 1e-6)
            self.at(end, finish)
            heapq.heappush(clocks, (end, index))
        self._apply_until(self.bench.budget_s)
        return self

    def at(self, when: float, action: Callable[[], None]) -> None:
        """Apply `action` at simulated time `when` (never, past the budget: a run cut by the
        budget never reports)."""
        if when <= self.bench.budget_s:
            heapq.heappush(self._events, (when, next(self._order), action))

    def _apply_until(self, now: float) -> None:
        while self._events and self._events[0][0] <= now:
            self.now, _, finish = heapq.heappop(self._events)
            finish()

    def ask(self) -> tuple[optuna.Trial, dict[str, Any]]:
        trial = self.study.ask(self.space)
        return trial, {**self.bench.task_config, **trial.params}

    def record(self, attempt: Attempt) -> None:
        self.attempts.append(attempt)

    def tell(self, trial: optuna.Trial, outcome: Outcome, value: float | None = None) -> None:
        """Tell Optuna how the trial ended; `value` overrides the metric (retry-halving)."""
        if outcome.state == "COMPLETE":
            told = outcome.value if value is None else value
            assert told is not None
            self.study.tell(trial, told)
            self.told.append((self.now, told))
        else:
            self.study.tell(trial, state=optuna.trial.TrialState.FAIL)


def naive(sim: Sim, runs: RealRuns) -> Callable[[CardSpec], Work]:
    """Plain Optuna: as asked on whichever card is free."""

    def work(card: CardSpec) -> Work:
        trial, config = sim.ask()
        outcome, start = runs.run(config, Plan(), card), sim.now

        def finish() -> None:
            sim.record(_attempt(trial, card, start, outcome))
            sim.tell(trial, outcome)

        return outcome.cpu_s, finish

    return work


def retry_halving(sim: Sim, runs: RealRuns) -> Callable[[CardSpec], Work]:
    """On OOM halve the batch and re-run on the same card, as find_executable_batch_size."""
    batch_param = sim.bench.task.batch_size_param

    def work(card: CardSpec) -> Work:
        trial, config = sim.ask()
        asked, start, spent = int(config[batch_param]), sim.now, 0.0
        attempts = []
        batch = asked
        while True:
            outcome = runs.run({**config, batch_param: batch}, Plan(), card)
            attempt = _attempt(trial, card, start + spent, outcome)
            attempt.changed_hyperparameter, attempt.asked = batch != asked, start
            attempts.append(attempt)
            spent += outcome.cpu_s
            if outcome.state != "OOM" or batch == 1:
                break
            batch //= 2

        def finish() -> None:
            for attempt in attempts:
                sim.record(attempt)
            sim.tell(trial, outcome)  # the metric of the halved run, under the asked params

        return spent, finish

    return work


@dataclass(frozen=True)
class Ahead:
    """A trial a card leased and planned while its previous trial trained (--plan-ahead)."""

    job: Job
    decision: Decision
    planning_s: float
    ready: float  # simulated time the plan choice ends


def vramtune(
    sim: Sim,
    runs: RealRuns,
    planner: Planner,
    plan_ahead: bool,
    settle: bool = True,
    lease_late: bool = False,
) -> Callable[[CardSpec], Work]:
    """Plan on the card that asks; hand back, wait for a larger card, or end infeasible.

    With `plan_ahead` (the worker's --plan-ahead, worker/loop/lookahead.py) a card that starts a run
    leases and plans its next trial at once, on the host's CPU while the card trains: only the
    part of that planning that outlasts the run waits on the card's clock. A trial so planned
    that this card hands back is handed back in the background and the next one planned
    (PlanAhead's `settle`), so the plan after a hand-back is off the clock too while the run
    lasts. Without --plan-ahead the card plans each trial on its own clock, between runs.
    With `plan_ahead` and not `settle` (PlanAhead without settle: the arm that isolates
    background hand-backs) a trial planned ahead that this card hands back waits for the run
    to end; the main thread hands it back then and plans the next trial on the card's clock.
    With `lease_late` the lease ahead waits for lease_delay (the run's predicted seconds, the
    card's longest plan choice of its last five), cancelled if the run ends first."""
    waiting: list[Job] = []
    ahead: dict[str, Ahead] = {}
    busy_until: dict[str, float] = {}  # a card's background choice that outlasted its run
    choices: dict[str, list[float]] = {}  # each card's plan choices' CPU-seconds, in order
    pending: dict[str, object] = {}  # a card's lease ahead still waiting for its delay
    observed: dict[str, list[StepTimeObservation]] = {}
    fits: dict[str, StepTimeFit] = {}

    def offered(card: CardSpec, now: float) -> Job:
        """A waiting trial this card holds (oldest first, not its own hand-back), else new."""
        for job in waiting:
            if job.min_bytes <= card.info.total_bytes and card.info.model not in job.handed_back_by:
                waiting.remove(job)
                return job
        return Job(sim.ask()[0], asked=now)

    def prepare(card: CardSpec, start: float) -> Ahead:
        """Lease a trial for this card and choose its plan, beginning at `start`."""
        job = offered(card, start)
        config = {**sim.bench.task_config, **job.trial.params}
        model = card.info.model
        larger = max(c.info.total_bytes for c in sim.fleet if c is not card)
        larger_card = larger if larger > card.info.total_bytes else None
        tried, fit = job.tried_on(model), fits.get(model)
        decision, planning_s = planner.decide(config, card, tried, fit, larger_card)
        sim.planning_total_s += planning_s
        choices.setdefault(model, []).append(planning_s)
        return Ahead(job, decision, planning_s, start + planning_s)

    def plan_while_training(card: CardSpec, start: float, end: float) -> None:
        """worker/loop/lookahead.py with `settle`: from `start`, while the run ends at `end`, lease
        and plan; a hand-back is handed back there (at the time its choice ends) and the next
        trial planned, until a trial runs here or the run has ended (take(): the main thread
        leases itself once the choice in progress is done)."""
        model = card.info.model
        while True:
            prepared = prepare(card, start)
            if not settle or not isinstance(prepared.decision, HandBack):
                ahead[model] = prepared
                return
            sim.at(
                prepared.ready, functools.partial(hand_back, prepared.job, card, prepared.decision)
            )
            sim.settled_ahead += 1
            start = prepared.ready
            if start >= end:
                busy_until[model] = start  # the card waits for that choice to finish
                return

    def lease_ahead(card: CardSpec, start: float, end: float, decision: RunAsPlanned) -> None:
        """PlanAhead.begin with the agent's delay: at once, or at start + lease_delay."""
        model = card.info.model
        features = decision.step_time
        step_s = None if features is None else features.predicted_step_s
        recent = max(choices.get(model, [])[-5:], default=0.0)
        delay = lease_delay(None if step_s is None else step_s * STEPS, recent)
        if not lease_late or delay <= 0:
            plan_while_training(card, start, end)
            return
        token = pending[model] = object()

        def due() -> None:
            if pending.get(model) is token:  # not cancelled by the run's end (take())
                del pending[model]
                plan_while_training(card, start + delay, end)

        sim.at(start + delay, due)

    def work(card: CardSpec) -> Work:
        model = card.info.model
        pending.pop(model, None)  # take(): a lease still waiting for its delay is cancelled
        began = sim.now
        prepared = ahead.pop(model, None) or prepare(card, max(began, busy_until.pop(model, began)))
        job, decision = prepared.job, prepared.decision
        config = {**sim.bench.task_config, **job.trial.params}
        waited = max(0.0, prepared.ready - began)  # planning the card waits for
        sim.planning_s += waited
        start = began + waited
        if isinstance(decision, HandBack):
            sim.hand_back_waits.append((began, waited))
            return waited, lambda: hand_back(job, card, decision)
        outcome = runs.run(config, decision.plan, card)
        if plan_ahead:  # the worker begins the next plan choice as this run starts
            lease_ahead(card, start, start + outcome.cpu_s, decision)

        def finish() -> None:
            attempt = _attempt(job.trial, card, began, outcome, waited)
            attempt.asked = job.asked
            attempt.plan = plan_in_words(decision.plan)
            sim.record(attempt)
            if outcome.state == "OOM":  # the prediction was wrong: retried once elsewhere
                job.plans_tried.append((card.info.model, PlanOut(**decision.plan.model_dump())))
                if len(job.plans_tried) <= 1:
                    waiting.append(job)
                    return
            if outcome.state == "COMPLETE":
                room = headroom(outcome.peak_bytes, card.info.total_bytes)
                job.trial.set_constraint(MEMORY_CONSTRAINT, min(room, 0.0))
                learn_step_time(model, decision.step_time, outcome)
            sim.tell(job.trial, outcome)

        return waited + outcome.cpu_s, finish

    def learn_step_time(model: str, features: StepTimeObservation | None, outcome: Outcome) -> None:
        """What the server does with a result's step time: store it, refit the card's model."""
        if features is None:
            return
        step_s = outcome.cpu_s * outcome.train_share / STEPS
        measured = features.model_copy(update={"measured_step_s": step_s})
        if features.predicted_step_s is not None:  # predicted when the plan was chosen
            error = abs(features.predicted_step_s - step_s) / step_s
            sim.step_errors.append((len(sim.told), error))
        observed.setdefault(model, []).insert(0, measured)  # newest first, as the server reads
        sim.step_observations.append({"card": model, **measured.model_dump(mode="json")})
        fits[model] = fit_step_time(model, sim.bench.task.name, observed[model])

    def hand_back(job: Job, card: CardSpec, decision: HandBack) -> None:
        sim.routed_for_time += isinstance(decision, HandBackForTime)
        need = max(job.min_bytes, decision.min_footprint_bytes)
        others = [c.info.total_bytes for c in sim.fleet if c is not card]
        if max(others, default=0) >= need:
            job.min_bytes = need
            job.handed_back_by.add(card.info.model)
            waiting.append(job)
            return
        largest = max([*others, card.info.total_bytes])
        job.trial.set_constraint(MEMORY_CONSTRAINT, max(headroom(need, largest), 1e-9))
        values = placeholder_values(sim.study, sim.spec, need)
        sim.study.tell(job.trial, values)
        sim.infeasible += 1

    return work


def _attempt(
    trial: optuna.Trial, card: CardSpec, start: float, outcome: Outcome, planning_s: float = 0.0
) -> Attempt:
    busy = planning_s + outcome.cpu_s
    params = json.dumps(sorted(trial.params.items()))
    model, state, value = card.info.model, outcome.state, outcome.value
    return Attempt(
        trial.number,
        model,
        start,
        start + busy,
        state,
        busy,
        value,
        params=params,
        planning_s=planning_s,
        asked=start,
    )


# ---------------------------------------------------------------------------- figures


def best_curve(sim: Sim) -> list[tuple[float, float]]:
    """(time, best so far) at every improvement of the feasible metric."""
    sign = 1.0 if sim.bench.direction == "maximize" else -1.0
    curve: list[tuple[float, float]] = []
    for when, value in sorted(sim.told):
        if not curve or sign * value > sign * curve[-1][1]:
            curve.append((round(when, 3), value))
    return curve


def time_to_reach(curve: list[tuple[float, float]], target: float, direction: str) -> float | None:
    """The first time the curve is at least as good as `target`; None if it never is."""
    sign = 1.0 if direction == "maximize" else -1.0
    return next((when for when, value in curve if sign * value >= sign * target), None)


def figures(arm: str, sim: Sim) -> dict[str, Any]:
    """What one arm measured on one seed."""
    died = [a for a in sim.attempts if a.state == "OOM"]
    trials = {a.trial for a in sim.attempts}
    curve = best_curve(sim)
    return {
        "arm": arm,
        "runs": len(sim.attempts),
        "trials_told": len(sim.study.get_trials(states=(optuna.trial.TrialState.COMPLETE,)))
        + len(sim.study.get_trials(states=(optuna.trial.TrialState.FAIL,))),
        "completed": len(sim.told),
        "oom_crashes": len(died),
        "wasted_s": round(sum(a.cpu_s for a in died), 3),
        "compute_s": round(sum(a.cpu_s for a in sim.attempts), 3),
        "infeasible": sim.infeasible,
        "routed_for_time": sim.routed_for_time,
        "handed_back_ahead": sim.settled_ahead,
        "changed_hyperparameter": len(
            {a.trial for a in sim.attempts if a.changed_hyperparameter and a.state == "COMPLETE"}
        ),
        "resized": len({a.trial for a in sim.attempts if a.plan != "as asked"}),
        "trials_run": len(trials),
        "planning_s": round(sim.planning_s, 3),
        "planning_total_s": round(sim.planning_total_s, 3),
        "step_time_errors_after_20": [round(e, 4) for told, e in sim.step_errors if told >= 20],
        "step_time_observations": sim.step_observations,
        "best": curve[-1][1] if curve else None,
        "curve": curve,
        # every run: [trial, card, start, end, state, plan, value, planning_s, params, asked]
        "attempts": [
            [
                a.trial,
                a.card,
                round(a.start, 4),
                round(a.end, 4),
                a.state,
                a.plan,
                a.value,
                round(a.planning_s, 4),
                a.params,
                round(a.asked, 4),
            ]
            for a in sim.attempts
        ],
        "hand_back_waits": [[round(t, 4), round(w, 4)] for t, w in sim.hand_back_waits],
    }


def run_seed(
    name: str,
    bench: Bench,
    seed: int,
    fleet: Sequence[CardSpec],
    runs: RealRuns,
    predictor: TimedPredictor,
) -> list[dict[str, Any]]:
    """The three arms on one seed; time to reach naive's final best for each."""
    rows: list[dict[str, Any]] = []
    for arm in ARMS:
        sim = Sim(bench, seed, fleet)
        if arm == "naive":
            work = naive(sim, runs)
        elif arm == "retry-halving":
            work = retry_halving(sim, runs)
        else:
            planner = Planner(predictor, sim.spec)
            plan_ahead = arm != "vramtune-plan-on-clock"
            lease_late = arm == "vramtune-lease-late"
            work = vramtune(sim, runs, planner, plan_ahead=plan_ahead, lease_late=lease_late)
        row: dict[str, Any] = {"task": name, "seed": seed, "budget_s": bench.budget_s}
        row |= {"direction": bench.direction, "fleet": [card.info.model for card in fleet]}
        rows.append(row | figures(arm, sim.run(work)))
    target = rows[0]["best"]
    for row in rows:
        reached = None if target is None else time_to_reach(row["curve"], target, bench.direction)
        row["time_to_naive_best_s"] = reached
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--tasks", nargs="+", default=list(BENCHES), choices=list(BENCHES))
    parser.add_argument("--budget", type=float, help="simulated seconds per arm (per task)")
    parser.add_argument("--quick", action="store_true", help="digits-cnn, seed 4, 5 s budget")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--report-only", action="store_true", help="rewrite the .md and .png from the .json"
    )
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="write --out from several invocations' .json (tasks or seeds run apart)",
    )
    args = parser.parse_args(argv)
    if args.report_only or args.merge:
        saved = merge(args.merge or [args.out.with_suffix(".json")])
        write_results(saved["runs"], saved["meta"], args.out)
        return 0
    if args.quick:
        # Seed 4: TPE's first configuration (width 32, resolution 16, batch 256; 39 MiB
        # predicted) does not fit the 16 MiB card, which asks first, so both naive arms meet an
        # OOM in the first run whatever the machine's load (the smoke test asserts it).
        args.seeds, args.tasks, args.budget = [QUICK_SEED], ["digits-cnn"], args.budget or 5.0
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    logging.getLogger("vramtune.worker.run.training").setLevel(
        logging.ERROR
    )  # every naive OOM warns
    torch.set_num_threads(1)  # deterministic runs, and CPU time that is one card's time
    fleet = [CardSpec(info=simulated_card(parse_size(size))) for size in FLEET]
    load_before, began = _loadavg(), time.monotonic()
    rows, cache = [], {}
    for name in args.tasks:
        bench = BENCHES[name]
        if args.budget is not None:
            bench = Bench(**{**bench.__dict__, "budget_s": args.budget})
        runs = RealRuns(TorchTaskRunner(bench.task), bench.spec(0).budget)
        _warm_up(runs.runner, bench, fleet[0])
        predictor = TimedPredictor(runs.runner)
        for seed in args.seeds:
            for row in run_seed(name, bench, seed, fleet, runs, predictor):
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k not in BULKY}), flush=True)
        cache[name] = {
            "executed": runs.executed,
            "served_from_cache": runs.served,
            "predictions_computed": len(predictor.memo),
            "prediction_cpu_s": round(sum(cost for _, cost in predictor.memo.values()), 1),
        }
    invocation = {
        "command": " ".join(["bench/tuning_efficiency.py", *(argv or sys.argv[1:])]),
        "tasks": args.tasks,
        "seeds": args.seeds,
        "loadavg_before": load_before,
        "loadavg_after": _loadavg(),
        "bench_wall_s": round(time.monotonic() - began, 1),
        "bench_cpu_s": round(time.process_time(), 1),
    }
    meta = {
        "invocations": [invocation],
        "tasks": {n: _describe_bench(BENCHES[n], args.budget) for n in args.tasks},
        "seeds": args.seeds,
        "fleet": list(FLEET),
        "steps_per_trial": STEPS,
        "real_runs": cache,
        "torch_threads": 1,
    }
    write_results(rows, meta, args.out)
    return 0


def merge(paths: Sequence[Path]) -> dict[str, Any]:
    """Several invocations' results as one: their runs, tasks and invocations side by side
    (each invocation keeps its own command and load average; the real-run counts add up)."""
    runs: list[dict[str, Any]] = []
    meta: dict[str, Any] = {"invocations": [], "tasks": {}, "seeds": [], "real_runs": {}}
    for path in paths:
        saved = json.loads(path.read_text())
        runs += saved["runs"]
        part = saved["meta"]
        meta |= {k: part[k] for k in ("fleet", "steps_per_trial", "torch_threads")}
        meta["invocations"] += part["invocations"]
        meta["tasks"] |= part["tasks"]
        meta["seeds"] = sorted({*meta["seeds"], *part["seeds"]})
        for task, counts in part["real_runs"].items():
            mine = meta["real_runs"].setdefault(task, dict.fromkeys(counts, 0))
            for key, value in counts.items():
                mine[key] = round(mine[key] + value, 1)
    return {"meta": meta, "runs": runs}


def _warm_up(runner: TorchTaskRunner, bench: Bench, card: CardSpec) -> None:
    """Pay torch's one-time start-up (fake-tensor mode, data loading) before any clock runs."""
    config = {**bench.task_config, **{k: v["choices"][0] for k, v in bench.search_space.items()}}
    runner.predict(config, Plan(), card)
    runner.run(config, Plan(), TrainBudget(max_steps=1, eval_every=1), card, _NoPruning())


def _describe_bench(bench: Bench, budget: float | None) -> dict[str, Any]:
    return {
        "direction": bench.direction,
        "search_space": bench.search_space,
        "task_config": bench.task_config,
        "budget_s": budget or bench.budget_s,
    }


def _loadavg() -> str:
    """The 1, 5 and 15 minute load averages, as /proc/loadavg gives them."""
    if not os.path.exists("/proc/loadavg"):
        return "n/a"
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


# ---------------------------------------------------------------------------- decomposition


def decompose(row: dict[str, Any], other: dict[str, Any], target: float | None) -> dict[str, Any]:
    """Where an arm's card-seconds went until it reached naive's final best (`target`).

    Until time T (the budget when never reached) the fleet's cards spend len(fleet) x T
    card-seconds: on runs that died (OOM), runs as asked, resized runs (micro-batches), plan
    choices the card waited for, on-clock hand-backs, and idle. T = (card-seconds per trial
    asked) x (trials asked until the reaching trial) / cards: the first factor is the arm's own
    cost, the second TPE's draw order. `other` is the arm compared with (its configurations)."""
    horizon = row["time_to_naive_best_s"]
    horizon = row["budget_s"] if horizon is None else horizon
    parts = dict.fromkeys(("oom", "as_asked", "resized", "planning", "hand_back", "new"), 0.0)
    theirs = {a[8] for a in other["attempts"]}
    for _, _, start, end, state, plan, _, planning, params, *_ in row["attempts"]:
        if start >= horizon:
            continue
        waited = min(start + planning, horizon) - start
        ran = min(end, horizon) - start - waited
        parts["planning"] += waited
        kind = "oom" if state == "OOM" else "as_asked" if plan == "as asked" else "resized"
        parts[kind] += ran
        parts["new"] += ran if params not in theirs else 0.0
    parts["hand_back"] = sum(min(w, horizon - t) for t, w in row["hand_back_waits"] if t < horizon)
    reach = _reaching_trial(row, target)
    reaching_run = [a for a in row["attempts"] if a[0] == reach and a[4] == "COMPLETE"]
    # the reaching trial's wait between its ask (lease) and its run's start
    held = reaching_run[-1][2] - reaching_run[-1][9] if reaching_run else None
    asked = 1 + max((a[0] for a in row["attempts"] if a[2] < horizon), default=-1)
    cards = len(row.get("fleet", FLEET))
    return {
        "seed": row["seed"],
        "arm": row["arm"],
        "horizon_s": horizon,
        "reached": row["time_to_naive_best_s"] is not None,
        "card_s": cards * horizon,
        **{k: round(v, 3) for k, v in parts.items()},
        "reaching_trial": reach,
        "reaching_trial_held_s": held,
        "trials_asked": asked if reach is None else reach + 1,
        "distinct_configs": len({a[8] for a in row["attempts"] if a[2] < horizon}),
    }


def _reaching_trial(row: dict[str, Any], target: float | None) -> int | None:
    """The number (ask order) of the trial whose run first reached `target`."""
    if target is None or row["time_to_naive_best_s"] is None:
        return None
    when = row["time_to_naive_best_s"]
    done = [a for a in row["attempts"] if a[4] == "COMPLETE" and abs(a[3] - when) < 2e-3]
    sign = 1.0 if row.get("direction", "maximize") == "maximize" else -1.0
    hits = [a for a in done if a[6] is not None and sign * a[6] >= sign * target - 1e-9]
    return min((a[0] for a in hits), default=None)


def decomposition(
    rows: list[dict[str, Any]], task: str, arms: Sequence[str]
) -> list[dict[str, Any]]:
    """decompose() for each seed and arm of `arms`; each compared with naive (naive with
    vramtune)."""
    out = []
    mine = [r for r in rows if r["task"] == task]
    for seed in sorted({r["seed"] for r in mine}):
        by_arm = {r["arm"]: r for r in mine if r["seed"] == seed}
        target = by_arm["naive"]["best"]
        for arm in arms:
            other = by_arm["vramtune" if arm == "naive" else "naive"]
            out.append(decompose(by_arm[arm], other, target))
    return out


# ---------------------------------------------------------------------------- report


def summary(rows: list[dict[str, Any]], task: str, direction: str) -> dict[str, dict[str, Any]]:
    """Per arm, the means over seeds; time to naive's best counts a miss as the budget."""
    out = {}
    for arm in ARMS:
        mine = [r for r in rows if r["task"] == task and r["arm"] == arm]
        budget = mine[0]["budget_s"]
        reach = [r["time_to_naive_best_s"] for r in mine]
        out[arm] = {
            key: statistics.mean(r[key] for r in mine)
            for key in (
                "oom_crashes",
                "wasted_s",
                "compute_s",
                "completed",
                "infeasible",
                "routed_for_time",
                "handed_back_ahead",
                "changed_hyperparameter",
                "resized",
                "planning_s",
                "planning_total_s",
            )
        } | {
            "best": statistics.mean(r["best"] for r in mine if r["best"] is not None),
            "time_to_naive_best_s": statistics.mean(budget if t is None else t for t in reach),
            "missed_naive_best": sum(t is None for t in reach),
            "seeds": len(mine),
            "step_time_error": _quantiles(
                [e for r in mine for e in r["step_time_errors_after_20"]]
            ),
        }
    return out


def _quantiles(errors: list[float]) -> dict[str, float | int | None]:
    """Median and 90th percentile of relative errors (None without any)."""
    if not errors:
        return {"median": None, "p90": None, "n": 0}
    ranked = sorted(errors)
    p90 = ranked[min(len(ranked) - 1, math.ceil(0.9 * len(ranked)) - 1)]
    return {"median": statistics.median(ranked), "p90": p90, "n": len(ranked)}


def targets(means: dict[str, dict[str, Any]], direction: str) -> list[str]:
    """The issue's three targets, each with whether it was met."""
    ours, naive_, halving = means["vramtune"], means["naive"], means["retry-halving"]
    ratio = ours["time_to_naive_best_s"] / max(naive_["time_to_naive_best_s"], 1e-9)
    sign = 1.0 if direction == "maximize" else -1.0
    not_worse = sign * ours["best"] >= sign * halving["best"]

    def verdict(met: bool) -> str:
        return "met" if met else "NOT met"

    clock = means["vramtune-plan-on-clock"]
    clock_ratio = clock["time_to_naive_best_s"] / max(naive_["time_to_naive_best_s"], 1e-9)
    return [
        f"- 0 OOM crashes: {verdict(ours['oom_crashes'] == 0)} ({ours['oom_crashes']:.1f}; "
        f"naive {naive_['oom_crashes']:.1f}, retry-halving {halving['oom_crashes']:.1f}).",
        f"- reaches naive's final best in <= 50 % of naive's time (mean over seeds): "
        f"{verdict(ratio <= 0.5)} ({ours['time_to_naive_best_s']:.1f} s against "
        f"{naive_['time_to_naive_best_s']:.1f} s: {ratio:.0%}; missed on "
        f"{ours['missed_naive_best']} of {ours['seeds']} seeds, counted as the budget).",
        f"- final best never worse than retry-halving's on the mean: {verdict(not_worse)} "
        f"({ours['best']:.4f} against {halving['best']:.4f}).",
        f"- (not a target) without --plan-ahead (planning on the card's clock): {clock_ratio:.0%} "
        f"of naive's time to naive's best, final best {clock['best']:.4f}.",
    ]


def write_results(rows: list[dict[str, Any]], meta: dict[str, Any], out: Path) -> None:
    """Every figure as JSON, the plot as PNG, the means and targets as Markdown."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "runs": rows}, indent=2) + "\n")
    plot(rows, meta, out.with_suffix(".png"))
    lines = [
        "# Tuning efficiency on real training",
        "",
        f"Fleet: one simulated CPU card of each of {', '.join(meta['fleet'])}; "
        f"{meta['steps_per_trial']} steps per trial; TPE seeds {meta['seeds']}; torch on "
        f"{meta['torch_threads']} thread; every figure is in tuning_efficiency.json. "
        "Invocations (each under the exclusive benchmark lock):",
        "",
        *(
            f"- `{run['command']}`: load average before {run['loadavg_before']}, after "
            f"{run['loadavg_after']}; {run['bench_wall_s']} s wall, {run['bench_cpu_s']} CPU-s."
            for run in meta["invocations"]
        ),
        "",
        f"![best metric over wall time]({out.with_suffix('.png').name})",
        "",
    ]
    for task, described in meta["tasks"].items():
        means = summary(rows, task, described["direction"])
        runs = meta["real_runs"][task]
        lines += [
            f"## {task} ({described['direction']}, {described['budget_s']:.0f} simulated "
            "seconds per arm)",
            "",
            f"Real trainings run: {runs['executed']}; runs served from the cache: "
            f"{runs['served_from_cache']}.",
            "",
            "| arm | OOM crashes | wasted CPU-s | compute CPU-s | planning CPU-s (on the cards' "
            "clocks) | completed | infeasible | routed by time | changed hyperparameter | resized "
            "| final best | time to naive's best s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
            *(
                f"| {arm} | {m['oom_crashes']:.1f} | {m['wasted_s']:.1f} | {m['compute_s']:.1f}"
                f" | {m['planning_total_s']:.1f} ({m['planning_s']:.1f}) | {m['completed']:.1f} | "
                f"{m['infeasible']:.1f} | {m['routed_for_time']:.1f} | "
                f"{m['changed_hyperparameter']:.1f} | {m['resized']:.1f} | {m['best']:.4f} | "
                f"{m['time_to_naive_best_s']:.1f} |"
                for arm, m in means.items()
            ),
            "",
            _step_time_line(means["vramtune"]["step_time_error"]),
            "",
            f"vramtune hand-backs made in the background while the card trained "
            f"(--plan-ahead): {means['vramtune']['handed_back_ahead']:.1f} a seed.",
            "",
            *targets(means, described["direction"]),
            "",
            "Per seed (final best; time to naive's final best, - when never reached):",
            "",
            "| seed | " + " | ".join(ARMS) + " |",
            "|---" * (len(ARMS) + 1) + "|",
            *(
                f"| {seed} | "
                + " | ".join(_seed_cell(rows, task, seed, arm) for arm in ARMS)
                + " |"
                for seed in _seeds(rows, task)
            ),
            "",
            *spread_lines(rows, task),
            "",
            *decomposition_lines(rows, task),
            "",
        ]
    lines += NOTES
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def _seeds(rows: list[dict[str, Any]], task: str) -> list[int]:
    return sorted({r["seed"] for r in rows if r["task"] == task})


def ratios(rows: list[dict[str, Any]], task: str, arm: str) -> list[float]:
    """Per seed, the arm's time to naive's final best over naive's (a miss as the budget)."""
    out = []
    for seed in _seeds(rows, task):
        by_arm = {r["arm"]: r for r in rows if r["task"] == task and r["seed"] == seed}
        mine, naive_ = by_arm[arm], by_arm["naive"]
        reached = mine["time_to_naive_best_s"]
        reached = mine["budget_s"] if reached is None else reached
        out.append(reached / max(naive_["time_to_naive_best_s"] or naive_["budget_s"], 1e-9))
    return out


def spread_lines(rows: list[dict[str, Any]], task: str) -> list[str]:
    """Each vramtune arm's per-seed ratios to naive's time, their median, mean and range."""
    lines = [
        "Spread of the time ratio (arm's time to naive's final best / naive's, per seed; the "
        "target is the ratio of the means):",
        "",
        "| arm | per seed | median | mean of ratios | min-max | seeds <= 50 % | ratio of means |",
        "|---|---|---|---|---|---|---|",
    ]
    naive_times = [
        r["time_to_naive_best_s"] for r in rows if r["task"] == task and r["arm"] == "naive"
    ]
    for arm in ARMS[1:]:
        found = ratios(rows, task, arm)
        mine = [r for r in rows if r["task"] == task and r["arm"] == arm]
        times = [
            r["budget_s"] if r["time_to_naive_best_s"] is None else r["time_to_naive_best_s"]
            for r in mine
        ]
        of_means = statistics.mean(times) / statistics.mean(naive_times)
        lines.append(
            f"| {arm} | {', '.join(f'{x:.0%}' for x in found)} | {statistics.median(found):.0%} | "
            f"{statistics.mean(found):.0%} | {min(found):.0%}-{max(found):.0%} | "
            f"{sum(x <= 0.5 for x in found)} of {len(found)} | {of_means:.0%} |"
        )
    return lines


def decomposition_lines(rows: list[dict[str, Any]], task: str) -> list[str]:
    """The per-seed decomposition (decompose()) of naive and vramtune, and the ceiling."""
    parts = decomposition(rows, task, ("naive", "vramtune", "vramtune-lease-late"))
    header = (
        "| seed | arm | T s | card-s | OOM | as asked | resized | planning | hand-back | idle | "
        "configs the other arm never ran | reaching trial (held s) | card-s per trial asked |"
    )
    lines = [
        "Where the card-seconds went until each arm reached naive's final best (T; 3 cards, so "
        "3 x T card-seconds; *planning*: plan choices the card waited for; *hand-back*: on-clock "
        "hand-backs; *configs the other arm never ran*: card-seconds of runs of configurations "
        "the compared arm (vramtune for naive, naive for vramtune) never ran in its whole "
        "budget; *reaching trial*: the ask number of the trial that reached it, and in "
        "brackets the seconds it was held between its ask (lease) and its run's start):",
        "",
        header,
        "|---" * 13 + "|",
    ]
    for d in parts:
        idle = d["card_s"] - sum(
            d[k] for k in ("oom", "as_asked", "resized", "planning", "hand_back")
        )
        lines.append(
            f"| {d['seed']} | {d['arm']} | {d['horizon_s']:.1f}{'' if d['reached'] else ' (never)'}"
            f" | {d['card_s']:.1f} | {d['oom']:.1f} | {d['as_asked']:.1f} | {d['resized']:.1f} | "
            f"{d['planning']:.1f} | {d['hand_back']:.1f} | {idle:.1f} | {d['new']:.1f} | "
            f"{_reaching_cell(d)} | "
            f"{d['card_s'] / d['trials_asked']:.2f} |"
        )
    return [*lines, "", *ceiling_lines(parts)]


def _reaching_cell(d: dict[str, Any]) -> str:
    if d["reaching_trial"] is None:
        return "-"
    held = d["reaching_trial_held_s"]
    return f"{d['reaching_trial']} ({'?' if held is None else f'{held:.1f}'})"


def ceiling_lines(parts: list[dict[str, Any]]) -> list[str]:
    """T = cost per trial x trials asked / cards: how much of vramtune/naive each factor is,
    and what naive's time would be with its OOM card-seconds removed and nothing else."""
    naive_ = [d for d in parts if d["arm"] == "naive"]
    ours = [d for d in parts if d["arm"] == "vramtune"]

    def mean(items: list[dict[str, Any]], key: Callable[[dict[str, Any]], float]) -> float:
        return statistics.mean(key(d) for d in items)

    t_n, t_v = mean(naive_, lambda d: d["horizon_s"]), mean(ours, lambda d: d["horizon_s"])
    n_n, n_v = mean(naive_, lambda d: d["trials_asked"]), mean(ours, lambda d: d["trials_asked"])
    c_n = mean(naive_, lambda d: d["card_s"] / d["trials_asked"])
    c_v = mean(ours, lambda d: d["card_s"] / d["trials_asked"])
    oom_share = mean(naive_, lambda d: d["oom"]) / mean(naive_, lambda d: d["card_s"])
    no_oom = mean(naive_, lambda d: d["horizon_s"] - d["oom"] / len(FLEET)) / t_n
    per_seed = [v["trials_asked"] / n["trials_asked"] for n, v in zip(naive_, ours, strict=True)]
    return [
        f"Means over seeds: trials asked until naive's best is reached: naive {n_n:.1f}, "
        f"vramtune {n_v:.1f} ({n_v / n_n:.0%}; per seed "
        f"{', '.join(f'{x:.0%}' for x in per_seed)}); card-seconds per trial asked: naive "
        f"{c_n:.2f}, vramtune {c_v:.2f} ({c_v / c_n:.0%}); time ratio of the means "
        f"{t_v / t_n:.0%}. Naive's card-seconds on runs that died, until it reached its best: "
        f"{oom_share:.0%}; with them removed and nothing else changed (the same draws, the "
        f"same order) naive would reach its best in {no_oom:.0%} of its time: the ratio a "
        "policy that only removes OOMs can expect at equal TPE luck.",
    ]


def _step_time_line(errors: dict[str, Any]) -> str:
    """The step-time model's online error on the vramtune arm, after its 20th trial."""
    if not errors["n"]:
        return "Step-time prediction error after 20 trials: no run was predicted (too few)."
    return (
        f"Step-time prediction error after 20 trials (vramtune, |predicted - measured| / "
        f"measured, predicted when the plan was chosen, {errors['n']} runs over all seeds): "
        f"median {errors['median']:.1%}, p90 {errors['p90']:.1%}."
    )


def _seed_cell(rows: list[dict[str, Any]], task: str, seed: int, arm: str) -> str:
    row = next(r for r in rows if r["task"] == task and r["seed"] == seed and r["arm"] == arm)
    reached = row["time_to_naive_best_s"]
    return f"{row['best']:.4f}; {'-' if reached is None else f'{reached:.1f} s'}"


NOTES = [
    "## How to read it",
    "",
    "- *OOM crashes*: runs that died out of memory (retry-halving's retries each count). "
    "*Wasted CPU-s*: the CPU time of those runs, until they died. *Compute*: every run's "
    "(for vramtune with the planning the card waited for). *Planning*: the predictor's "
    "CPU-seconds, hand-backs included (each prediction is computed once per benchmark and "
    "charged to every arm and card that needs it, as separate worker processes would pay); in "
    "brackets the part the cards waited for: with --plan-ahead a plan choice runs on the host "
    "while the card trains the previous trial, and only what outlasts that run is on the clock; "
    "a trial so planned that the card hands back is handed back there and the next planned.",
    "- *Completed*: trials told with a metric within the budget. *Infeasible*: vramtune trials "
    "no card holds even resized, told COMPLETE with a violated memory constraint.",
    "- *Routed by time*: vramtune hand-backs of trials that fit the card only resized, "
    "predicted at least 2x slower a step than as asked, to a larger card that holds them as "
    "asked (vramtune/worker/plan/time_routing.py).",
    "- *Changed hyperparameter*: retry-halving trials whose metric came from a smaller batch "
    "than the one Optuna suggested (and was told it had). *Resized*: vramtune trials run with "
    "micro-batches (the effective batch kept).",
    "- *Time to naive's best*: simulated seconds until the arm's best is at least naive's "
    "final best on the same seed; a seed where it is never reached counts as the budget.",
    "- The clock is the cards' simulated one, advanced by each real run's CPU-seconds "
    "(one torch thread) plus, for vramtune, the planning time the card waited for.",
    "- *Step-time error*: the fleet's step-time model (service/step_time.py) as the worker "
    "applied it when it chose the plan, against the run's training CPU-seconds per step, "
    "evaluation excluded, as the worker reports it (vramtune/worker/run/training.py).",
    "- *vramtune-lease-late*: the candidate worker/loop/lookahead.py's lease_delay (not yet called "
    "by the agent): once the fleet's step-time model predicts the current run, the next trial "
    "is leased at 0.6 x its predicted seconds less twice the card's longest recent plan "
    "choice, so that a trial is not held by a card still running a long trial while another "
    "card frees up; *vramtune* leases at the run's start, as the worker does.",
    "- *Spread*: per seed, the arm's time to naive's final best over naive's (a seed never "
    "reached counts as the budget); the target is the ratio of the means over seeds.",
    "- *Where the card-seconds went*: from the runs' log (attempts in the .json), clipped at T; "
    "runs still going at the budget's end never report, so a seed never reached shows them "
    "as idle. *Card-s per trial asked* x *trials asked* (the reaching trial's number + 1) = "
    "3 x T: the first factor is the arm's own cost per trial, the second TPE's draw order and "
    "the arm's ask cadence. The ceiling line removes naive's OOM card-seconds and nothing "
    "else.",
]


def plot(rows: list[dict[str, Any]], meta: dict[str, Any], path: Path) -> None:
    """Best metric over simulated wall time, mean over seeds, one panel per task."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    tasks = list(meta["tasks"])
    figure, axes = pyplot.subplots(1, len(tasks), figsize=(6 * len(tasks), 4), squeeze=False)
    for axis, task in zip(axes[0], tasks, strict=True):
        budget = meta["tasks"][task]["budget_s"]
        grid = [budget * i / 200 for i in range(201)]
        for arm in ARMS:
            curves = [r["curve"] for r in rows if r["task"] == task and r["arm"] == arm]
            points = [(t, _mean_at(curves, t)) for t in grid]
            shown = [(t, v) for t, v in points if v is not None]
            axis.step([t for t, _ in shown], [v for _, v in shown], where="post", label=arm)
        axis.set_title(f"{task} ({meta['tasks'][task]['direction']})")
        axis.set_xlabel("simulated wall seconds (CPU-seconds per card)")
        axis.set_ylabel("best metric so far, mean over seeds")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    pyplot.close(figure)


def _mean_at(curves: list[list[tuple[float, float]]], when: float) -> float | None:
    """The mean over seeds of the best so far at `when` (None until every seed has one)."""
    values = []
    for curve in curves:
        reached = [value for t, value in curve if t <= when]
        if not reached:
            return None
        values.append(reached[-1])
    return statistics.mean(values)


if __name__ == "__main__":
    sys.exit(main())
