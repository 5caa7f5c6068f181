"""What the agent's two loops share: its options and the trial-cycle steps a loop is built from.

The one-at-a-time loop lives in the agent (vramtune/worker/loop/agent.py); the packing loop
(worker/loop/packing.py) drives the same steps several trials at a time. Both depend on this
module, and the agent on the packing loop, so imports flow one way.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from vramtune.service.wire import (
    Assignment,
    CompleteRequest,
    FailRequest,
    Plan,
    PlanChoice,
    Prediction,
    StepTimeObservation,
    TrainBudget,
)
from vramtune.worker.loop.heartbeat import Heartbeats
from vramtune.worker.plan.policy import Decision, HandBack, RunAsPlanned
from vramtune.worker.run.slot_process import RunnerSource
from vramtune.worker.trial.runner import CardSpec, Config, Reporter, RunResult, TrialRunner

Chosen = tuple[Decision, PlanChoice, dict[str, Any]]
"""A plan choice: the decision, how it was chosen (sent to the server), that in log fields."""

T = TypeVar("T")


@dataclass
class AgentOptions:
    """How an agent behaves, beyond the card it drives."""

    name: str
    device: str = "cpu"
    memory_limit: int | None = None
    max_trials: int | None = None
    exit_when_idle_s: float | None = None
    idle_poll_s: float = 1.0
    shutdown_grace_s: float = 30.0
    spool_dir: Path | None = None
    plan_ahead: bool = False  # lease and plan the next trial while one trains (loop.lookahead)
    # More than 1: trials of studies that allow packing share the card, each in its own
    # process (vramtune/worker/loop/packing.py); 1 runs one trial at a time in this process.
    max_trials_per_card: int = 1
    # Where a packed trial's process finds the runners; None: the agent's own, pickled.
    runner_source: RunnerSource | None = None
    # A node worker's cards, one per rank ("cpu" for each simulated card): a trial of a study
    # with a distributed policy may run on several at once (worker/run/ranks.py). Empty: one.
    devices: tuple[str, ...] = ()
    # Waited for after registering, before the first lease: the predictor's warm-up
    # (vramtune.worker.predictor.wait_for_warm_up), passed in so that the loop never imports torch.
    # Returns False when the stop event was set first. None: nothing to wait for.
    warm_up: Callable[[threading.Event], bool] | None = None


class RunsTrials(Protocol):
    """What runs a planned trial: a task's `TrialRunner`, or a packed trial's process."""

    def run(
        self, config: Config, plan: Plan, budget: TrainBudget, card: CardSpec, reporter: Reporter
    ) -> RunResult: ...


class TrialCycle(Protocol):
    """The steps of a trial's cycle on one card, as the agent implements them.

    A loop leases a trial (`lease`), finds its runner (`runner_for`), chooses its plan
    (`choose`), then either hands it back (`hand_back`) or tells the server it starts
    (`started`) and runs it (`run_planned`), which delivers its final call (`finish`). Every
    REST call about a trial goes through `guarded`, which ends the trial on a lost lease or a
    refused call. `offered_bytes` is what the heartbeats and leases state as free; a loop that
    holds part of the card replaces it.
    """

    options: AgentOptions
    card: CardSpec
    runners: dict[str, TrialRunner]
    stop: threading.Event
    heartbeats: Heartbeats
    offered_bytes: Callable[[], int]

    def free_bytes(self) -> int: ...

    def lease(self, free_bytes: int, free_cards: int | None = None) -> Assignment | None: ...

    def guarded(self, assignment: Assignment, work: Callable[[], T]) -> T | None: ...

    def runner_for(self, assignment: Assignment) -> tuple[TrialRunner, dict[str, Any]] | None: ...

    def choose(
        self,
        assignment: Assignment,
        runner: TrialRunner,
        config: dict[str, Any],
        free_bytes: int | None = None,
    ) -> Chosen | None: ...

    def hand_back(
        self, assignment: Assignment, decision: HandBack, choice: PlanChoice, how: dict[str, Any]
    ) -> None: ...

    def started(
        self,
        assignment: Assignment,
        decision: RunAsPlanned,
        choice: PlanChoice,
        how: dict[str, Any],
        cards: list[int] | None = None,
        **fields: Any,
    ) -> None: ...

    def run_planned(
        self,
        assignment: Assignment,
        runner: RunsTrials,
        config: dict[str, Any],
        plan: Plan,
        prediction: Prediction,
        step_time: StepTimeObservation | None = None,
        alone: bool = True,
    ) -> None: ...

    def finish(
        self,
        assignment: Assignment,
        request: CompleteRequest | FailRequest,
        seconds: float | None = None,
    ) -> None: ...

    def event(self, name: str, assignment: Assignment | None = None, **fields: Any) -> None: ...

    def reached_max_trials(self) -> bool: ...

    def idle_too_long(self, idle_since: float) -> bool: ...
