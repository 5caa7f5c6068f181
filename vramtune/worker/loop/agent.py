"""The worker agent's loop: register → heartbeat thread → next → plan → run → report, until stopped.

One agent drives one card. `run_once()` is one cycle (for tests); `run_forever(stop)` loops
until the Event is set (SIGTERM/SIGINT in the CLI): the running trial then stops at its next
step and goes back to the server as interrupted, to be re-offered, not failed.

The parts around the loop live apart: the outcome mapping (worker/loop/outcomes.py), delivery of a
trial's final call with its spool (vramtune/worker/loop/delivery.py), the heartbeat thread
(worker/loop/heartbeat.py), the structured log (worker/loop/events.py), the packing loop that
runs several trials at once on the card (worker/loop/packing.py, with `max_trials_per_card` > 1),
and the node loop that runs trials side by side on disjoint cards of a node (worker/loop/node.py).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vramtune.common.memory import peak_of
from vramtune.service.wire import (
    MAX_SHARED_PREDICTIONS,
    MAX_SLOTS,
    Assignment,
    Calibration,
    CardConstants,
    CardInfo,
    CompleteReply,
    CompleteRequest,
    FailRequest,
    MemoryPolicy,
    NextRequest,
    Plan,
    PlanChoice,
    Prediction,
    ReportRequest,
    StepTimeFit,
    StepTimeObservation,
    WorkerRegister,
    WorkerRegistered,
)
from vramtune.worker.device import gpu
from vramtune.worker.loop import outcomes
from vramtune.worker.loop.api import LeaseLost, Rejected, ServerClient, ServerUnavailable
from vramtune.worker.loop.cycle import AgentOptions, Chosen, RunsTrials, T
from vramtune.worker.loop.delivery import Delivery
from vramtune.worker.loop.events import AgentLog
from vramtune.worker.loop.heartbeat import Heartbeats, RunningTrial
from vramtune.worker.loop.lookahead import PlanAhead, Prepared
from vramtune.worker.loop.node import NodePacker
from vramtune.worker.loop.packing import Packer
from vramtune.worker.loop.spool import Spool
from vramtune.worker.plan.distributed import choose_distributed
from vramtune.worker.plan.policy import (
    Decision,
    HandBack,
    RunAsPlanned,
    choose_plan,
    measured_step_time,
)
from vramtune.worker.plan.shared_predictions import batch_param, shape_keys, shared
from vramtune.worker.plan.time_routing import prefer_larger_card
from vramtune.worker.run.ranks import RankGroupRunner
from vramtune.worker.trial.rungs import supported_rungs
from vramtune.worker.trial.runner import (
    CardSpec,
    OutOfMemory,
    RunFailed,
    Stopped,
    TrialRunner,
    trial_config,
)


@dataclass
class _TrialReporter:
    """The `Reporter` a runner gets: intermediate values to the server, stop orders back."""

    agent: Agent
    running: RunningTrial
    reported: list[int] = field(default_factory=list)
    # Runners ask `stop_reason` before each step (the Reporter contract): the "go on" answers
    # count the steps begun, so a stop after one of them ends a run that trained.
    steps_begun: int = 0

    def report(self, step: int, value: float) -> bool:
        """Send one intermediate value; True when the pruner prunes the trial."""
        if not math.isfinite(value):
            self.agent.event("report_skipped", self.running.assignment, step=step, value=str(value))
            return False
        request = ReportRequest(lease=self.running.assignment.lease, step=step, value=value)
        try:
            reply = self.agent.client.report(
                self.running.assignment.trial_id, request, retry_for_s=self.agent.lease_ttl_s
            )
        except LeaseLost:
            self.running.stop_reason = "lease_lost"
            return False
        except (ServerUnavailable, Rejected) as error:
            # A lost intermediate value only costs the pruner one point; training goes on.
            self.agent.event("report_lost", self.running.assignment, step=step, error=str(error))
            return False
        self.reported.append(step)
        return reply.prune

    def stop_reason(self) -> str | None:
        """Why the run must stop now: a stop order, or the agent shutting down."""
        if self.running.stop_reason is not None:
            return self.running.stop_reason
        if self.agent.stop.is_set():
            return "interrupted"
        self.steps_begun += 1
        return None

    @property
    def trained(self) -> bool:
        """Whether the run trained at least one step (or reported, which only a step does)."""
        return self.steps_begun > 0 or bool(self.reported)


class Agent:
    """Drives one card: pulls trials, chooses plans, runs them, reports what happened."""

    def __init__(
        self,
        client: ServerClient,
        runners: Mapping[str, TrialRunner],
        card: CardSpec,
        options: AgentOptions,
        stop: threading.Event | None = None,
    ) -> None:
        if not runners:
            raise ValueError("a worker needs at least one task")
        self.client = client
        self.runners = dict(runners)
        self.card = card
        self.options = options
        self.stop = stop or threading.Event()
        self.registered: WorkerRegistered | None = None
        self.trials_run = 0
        self.log = AgentLog(options.name)
        # What the worker can still give: the card's free bytes, less what packed trials hold.
        self.offered_bytes: Callable[[], int] = self.free_bytes
        self.heartbeats = Heartbeats(
            client, lambda: self.offered_bytes(), self.log, self._token_refused
        )
        self.refused: Rejected | None = None  # set when the server refused our token
        self.spool = None if options.spool_dir is None else Spool(options.spool_dir)
        self.delivery = Delivery(
            client, self.spool, self.log, lambda: self.stop, options.shutdown_grace_s
        )
        # The trial the last complete leased (CompleteRequest.next), run next.
        self.following: Assignment | None = None
        self.ahead: PlanAhead[Chosen] = PlanAhead(
            self.lease,
            self._choose_ahead,
            lambda e: self.event("plan_ahead_failed", error=str(e)),
            settle=self._hand_back_ahead,
            keep_going=lambda: not self.stop.is_set() and not self.reached_max_trials(),
        )

    # ------------------------------------------------------------ life cycle

    @property
    def worker_id(self) -> int:
        """The server's id for this worker (registers first if needed)."""
        return self.start().worker_id

    @property
    def lease_ttl_s(self) -> float:
        """How long a lease lives without a heartbeat."""
        return self.start().lease_ttl_s

    def start(self) -> WorkerRegistered:
        """Register (once) and start the heartbeat thread."""
        if self.registered is None:
            self.registered = self.client.register(self._registration(), cancel=self.stop)
            self.log.worker_id = self.registered.worker_id
            self.event("registered", card=self.card.info.model, free_bytes=self.free_bytes())
            self.heartbeats.start(self.registered)
            self.delivery.replay_spool()
        return self.registered

    def close(self) -> None:
        """Give back a trial planned ahead, stop heartbeating, tell the server we leave."""
        self.ahead.release(self._give_back)
        self.heartbeats.close()
        if self.registered is not None:
            try:
                self.client.stop_worker(self.registered.worker_id)
            except (ServerUnavailable, LeaseLost, Rejected) as error:
                self.event("stop_unannounced", error=str(error))
            self.event("stopped", trials_run=self.trials_run)
        self.client.close()

    def run_forever(self, stop: threading.Event | None = None) -> None:
        """Run trials until `stop` is set, the trial cap is reached or the server idles too long."""
        if stop is not None:
            self.stop = stop
        try:
            self.start()
            if not self._warmed_up():
                return
            if self.ranks > 1:
                NodePacker(self).run()
            elif self.options.max_trials_per_card > 1:
                Packer(self).run()
            else:
                self._run_one_at_a_time()
        except ServerUnavailable as error:
            if not self.stop.is_set():
                raise
            self.event("shutdown_unreachable", error=str(error))
        finally:
            self.close()
        if self.refused is not None:
            raise self.refused

    def _warmed_up(self) -> bool:
        """Wait for `options.warm_up` (the predictor's, started as the worker starts) before the
        first lease: its one-time cost, 10-15 s at load 5, would otherwise land in the first
        trial's plan choice while that trial's lease runs. False when stopped meanwhile."""
        if self.options.warm_up is None:
            return True
        began = time.monotonic()
        warmed = self.options.warm_up(self.stop)
        self.event("warmed_up", waited_s=round(time.monotonic() - began, 3), stopped=not warmed)
        return warmed

    def _run_one_at_a_time(self) -> None:
        idle_since = time.monotonic()
        while not self.stop.is_set() and (self.following or not self.reached_max_trials()):
            if self.run_once():
                idle_since = time.monotonic()
            elif self.idle_too_long(idle_since):
                self.event("idle_exit", idle_s=round(time.monotonic() - idle_since, 1))
                break
            else:
                self.stop.wait(self.options.idle_poll_s)

    def run_once(self) -> bool:
        """One cycle: ask for a trial and see it to its end; False when there was no work."""
        ahead = self.ahead.take()
        following, self.following = self.following, None
        if following is not None:
            assignment: Assignment | None = following
        else:
            assignment = ahead.assignment if ahead else self.lease(self.free_bytes())
        if assignment is None:
            return False
        chosen = None if ahead is None else ahead.chosen
        try:
            self.guarded(assignment, lambda: self._run_trial(assignment, chosen))
        finally:
            self.heartbeats.release(assignment.trial_id)
        return True

    def lease(self, free_bytes: int, free_cards: int | None = None) -> Assignment | None:
        """Ask for a trial, stating `free_bytes` (and a node's `free_cards`); hold its lease
        (heartbeats renew it)."""
        request = NextRequest(free_bytes=free_bytes, free_cards=free_cards)
        assignment = self.client.next(self.worker_id, request, cancel=self.stop)
        return None if assignment is None else self._leased(assignment)

    def _leased(self, assignment: Assignment) -> Assignment:
        """A trial leased to this worker (by a next, or by a complete that asked for it)."""
        self.trials_run += 1
        self.heartbeats.hold(assignment.trial_id)
        self.event("leased", assignment, attempt=assignment.attempt, params=assignment.params)
        return assignment

    def guarded(self, assignment: Assignment, work: Callable[[], T]) -> T | None:
        """`work()` for the trial; a lost lease or a refused call ends it (logged), None."""
        try:
            return work()
        except LeaseLost as error:
            self.event("lease_lost", assignment, detail=str(error))
        except Rejected as error:
            self.event("rejected", assignment, status=error.status_code, detail=str(error.detail))
        return None

    # ------------------------------------------------------------ one trial

    def runner_for(self, assignment: Assignment) -> tuple[TrialRunner, dict[str, Any]] | None:
        """The trial's runner and configuration; None once a trial whose task is not installed
        here is failed with that reason."""
        runner = self.runners.get(assignment.task)
        if runner is None:
            message = f"task {assignment.task!r} is not installed here"
            self.finish(assignment, outcomes.failed(assignment, "error", message))
            return None
        return runner, trial_config(assignment.task_config, assignment.params)

    def _run_trial(self, assignment: Assignment, chosen: Chosen | None = None) -> None:
        found = self.runner_for(assignment)
        if found is None:
            return
        runner, config = found
        chosen = chosen or self.choose(assignment, runner, config)
        if chosen is None:
            return
        decision, choice, how = chosen
        if isinstance(decision, HandBack):
            self.hand_back(assignment, decision, choice, how)
            return
        self.started(assignment, decision, choice, how)
        if self.options.plan_ahead and not self.stop.is_set() and not self.reached_max_trials():
            self.ahead.begin(self.free_bytes())  # the card as this trial found it
        on_cards: RunsTrials = runner
        if decision.plan.world_size > 1:
            on_cards = RankGroupRunner(runner, self.options.devices)
        self.run_planned(
            assignment, on_cards, config, decision.plan, decision.prediction, decision.step_time
        )

    def started(
        self,
        assignment: Assignment,
        decision: RunAsPlanned,
        choice: PlanChoice,
        how: dict[str, Any],
        cards: list[int] | None = None,
        **fields: Any,
    ) -> None:
        """Tell the server the trial runs as planned (on a node: on which `cards`), and log it."""
        request = outcomes.started(assignment, decision, choice, cards)
        self.client.start(assignment.trial_id, request)
        on = {} if cards is None else {"cards": cards}  # a one-card worker's line as before
        self.event(
            "started",
            assignment,
            plan=decision.plan.reason,
            predicted=peak_of(decision.prediction),
            **on,
            **how,
            **fields,
        )

    def choose(
        self,
        assignment: Assignment,
        runner: TrialRunner,
        config: dict[str, Any],
        free_bytes: int | None = None,
    ) -> Chosen | None:
        """The plan (or hand-back) within `free_bytes` (default: the card's free bytes now), how
        it was chosen, and that in log fields; None when the configuration is refused (the trial
        is failed with the task's message)."""
        free = self.free_bytes() if free_bytes is None else free_bytes
        try:
            return self._decide(assignment, runner, config, free)
        except Exception as error:  # the task's check of its configuration (TaskConfigError)
            message = outcomes.error_message(error)
            self.finish(assignment, outcomes.failed(assignment, "error", message))
            return None

    def _choose_ahead(self, assignment: Assignment, free: int) -> Chosen | None:
        """The choice made in the background (loop.lookahead); None leaves it to _run_trial."""
        runner = self.runners.get(assignment.task)
        if runner is None:  # failed by the main thread, which owns the trial's calls
            return None
        config = trial_config(assignment.task_config, assignment.params)
        return self._decide(assignment, runner, config, free)

    def _decide(
        self, assignment: Assignment, runner: TrialRunner, config: dict[str, Any], free: int
    ) -> Chosen:
        """choose_plan through the fleet's shared predictions, then routing by predicted time."""
        predictions = shared(runner, config, assignment.predictions)
        fit = self._step_fit(assignment.task, assignment.study)
        calibration = self._calibration(assignment.task, assignment.study)

        def on_one_card(policy: MemoryPolicy) -> Decision:
            return choose_plan(
                predictions, config, policy, self.card, free, assignment.plans_tried,
                calibration, fit,
            )  # fmt: skip

        task: Any = getattr(runner, "task", None)  # a torch Task (TorchTaskRunner's) or None
        if assignment.distributed is not None and hasattr(task, "batch_size_param"):
            decision = choose_distributed(
                task, config, assignment.memory_policy, assignment.distributed, self.card,
                free, self.ranks, on_one_card, step_fit=fit,
            )  # fmt: skip
        else:
            decision = on_one_card(assignment.memory_policy)
        policy, larger = assignment.memory_policy, assignment.larger_card_bytes
        decision = prefer_larger_card(decision, larger, policy, fit)
        choice = PlanChoice(
            planning_s=round(decision.seconds, 4),
            prediction_source=predictions.source,
            predictions=predictions.made[:MAX_SHARED_PREDICTIONS],
        )
        how = {
            "planning_s": choice.planning_s,
            "prediction_source": choice.prediction_source,
            "predictions_shared": predictions.fleet_used,
            "predictions_made": len(predictions.made),
        }
        return decision, choice, how

    def run_planned(
        self,
        assignment: Assignment,
        runner: RunsTrials,
        config: dict[str, Any],
        plan: Plan,
        prediction: Prediction,
        step_time: StepTimeObservation | None = None,
        alone: bool = True,
    ) -> None:
        """Run the trial as planned and deliver its final call.

        A run that shared the card (`alone` False) sends its step-time features unmeasured:
        its neighbours slowed it, and the fleet's step-time model is fit to runs alone.
        """
        running = self.heartbeats.running(assignment)
        reporter = _TrialReporter(self, running)
        began = time.monotonic()
        try:
            result = runner.run(config, plan, assignment.budget, self.card, reporter)
        except OutOfMemory as oom:
            request = outcomes.failed(assignment, "oom", str(oom), plan, prediction, oom.measured)
            self.finish(assignment, request, time.monotonic() - began)
        except Stopped as stopped:
            self._stopped(assignment, stopped, plan, prediction, reporter.trained)
        except RunFailed as failure:  # it trained: its peak is an observation all the same
            message = outcomes.error_message(failure)
            request = outcomes.failed(
                assignment, "error", message, plan, prediction, failure.measured
            )
            self.finish(assignment, request, time.monotonic() - began)
        except Exception as error:  # a broken configuration must fail its trial, not the worker
            message = outcomes.error_message(error)
            request = outcomes.failed(assignment, "error", message, plan, prediction)
            self.finish(assignment, request, time.monotonic() - began)
        else:
            step = measured_step_time(step_time, result) if alone else step_time
            self.finish(assignment, outcomes.completed(assignment, result, plan, prediction, step))
        finally:
            self.heartbeats.finished(running)

    def _stopped(
        self,
        assignment: Assignment,
        stopped: Stopped,
        plan: Plan,
        prediction: Prediction,
        trained: bool,
    ) -> None:
        request = outcomes.stopped(assignment, stopped, plan, prediction, trained)
        if request is None:
            self.event("dropped", assignment, reason=str(stopped.reason))
            return
        self.finish(assignment, request)

    def finish(
        self,
        assignment: Assignment,
        request: CompleteRequest | FailRequest,
        seconds: float | None = None,
    ) -> None:
        """Deliver a complete or fail call and log what became of the trial."""
        if isinstance(request, CompleteRequest):
            if self._asks_next_with_complete():
                request = request.model_copy(
                    update={"next": NextRequest(free_bytes=self.free_bytes())}
                )
            ack = self.delivery.deliver("complete", assignment, request)
            if isinstance(ack, CompleteReply) and ack.next is not None:
                self.following = self._leased(ack.next)
            self.event(
                "completed",
                assignment,
                values=request.values,
                resolution=ack.resolution,
                measured=peak_of(request.measured),
                seconds=round(request.duration_s, 3),
            )
            return
        ack = self.delivery.deliver("fail", assignment, request)
        self.event(
            "failed",
            assignment,
            kind=request.kind,
            message=request.message,
            resolution=ack.resolution,
            seconds=None if seconds is None else round(seconds, 3),
        )

    def _give_back(self, assignment: Assignment) -> None:
        """A trial leased ahead that will not run here: failed 'interrupted', re-offered."""
        message = "the worker stopped before running it"
        self.finish(assignment, outcomes.failed(assignment, "interrupted", message))
        self.heartbeats.release(assignment.trial_id)

    def hand_back(
        self, assignment: Assignment, decision: HandBack, choice: PlanChoice, how: dict[str, Any]
    ) -> None:
        request = outcomes.handed_back(assignment, decision, choice)
        ack = self.delivery.deliver("handback", assignment, request)
        self.event(
            "handed_back",
            assignment,
            min_footprint=decision.min_footprint_bytes,
            resolution=ack.resolution,
            reason=decision.reason,
            **how,
        )

    def _hand_back_ahead(self, prepared: Prepared[Chosen]) -> bool:
        """Hand back, from the plan-ahead thread, a trial planned ahead that will not run on
        this card (vramtune.worker.loop.lookahead's `settle`); False when it runs here."""
        if prepared.chosen is None:
            return False
        decision, choice, how = prepared.chosen
        if not isinstance(decision, HandBack):
            return False
        assignment = prepared.assignment
        try:
            self.guarded(assignment, lambda: self.hand_back(assignment, decision, choice, how))
        finally:
            self.heartbeats.release(assignment.trial_id)
        return True

    # ------------------------------------------------------------ helpers

    def free_bytes(self) -> int:
        """What this card can give a trial now (NVML on a GPU, the limit on a simulated card)."""
        free = None if self.card.info.simulated else gpu.free_bytes(self.card.info.device_index)
        free = self.card.info.free_bytes if free is None else free
        limit = self.options.memory_limit
        return free if limit is None else min(free, limit)

    def event(self, name: str, assignment: Assignment | None = None, **fields: Any) -> None:
        """One structured log line (vramtune.common.logs) with the worker's and the trial's ids."""
        self.log.event(name, assignment, **fields)

    def _token_refused(self, error: Rejected) -> None:
        """Stop at once: the running trial is dropped (the server re-offers it), no new one."""
        self.refused = error
        self.event("token_refused", status=error.status_code, detail=str(error.detail))
        self.stop.set()

    @property
    def ranks(self) -> int:
        """The cards this worker drives: a node's, else 1."""
        return max(1, len(self.options.devices))

    def _node_cards(self, card: CardInfo) -> list[CardInfo] | None:
        """A node's cards as registered (one per rank), None for a one-card worker."""
        if self.ranks == 1:
            return None
        return [
            card.model_copy(update={"device_index": _device_index(device)})
            for device in self.options.devices
        ]

    def _registration(self) -> WorkerRegister:
        card = self.card.info.model_copy(update={"free_bytes": self.free_bytes()})
        return WorkerRegister(
            name=self.options.name,
            device=self.options.device,
            card=card,
            cards=self._node_cards(card),
            tasks=sorted(self.runners),
            constants=CardConstants.model_validate(
                {k: v for k, v in self.card.constants.items() if k in CardConstants.model_fields}
            ),
            shape_params={
                task: keys
                for task, runner in self.runners.items()
                if (keys := shape_keys(runner)) is not None
            },
            slots=self._slots(),
            batch_params={
                task: param
                for task, runner in self.runners.items()
                if (param := batch_param(runner)) is not None
            },
            # What the dashboard's advice may suggest: the rungs plans can use here.
            rungs={
                task: supported_rungs(runner, self.card.device)
                for task, runner in self.runners.items()
            },
        )

    def _slots(self) -> int:
        """Trials at once: a node's, one per card at most; a card's, its packing slots."""
        if self.ranks > 1:
            return self.ranks
        return min(self.options.max_trials_per_card, MAX_SLOTS)

    def _step_fit(self, task: str, study: str) -> StepTimeFit | None:
        """The step-time model for this card model and task, from the fleet's runs and the
        study's own, when the server has one."""
        try:
            return self.client.step_time(self.card.info.model, task, self.worker_id, study=study)
        except (ServerUnavailable, Rejected, LeaseLost):
            return None

    def _calibration(self, task: str, study: str) -> Calibration | None:
        """The service's correction for this card and task (the fleet's runs and the study's
        own), when it has one."""
        torch_version = self.card.info.torch_version or "none"
        try:
            return self.client.calibration(
                self.card.info.model, torch_version, task, self.worker_id, study=study
            )
        except (ServerUnavailable, Rejected, LeaseLost):
            return None

    def _asks_next_with_complete(self) -> bool:
        """Whether a complete asks for the next trial (one request a trial less): one trial at
        a time on one card, nothing leased ahead, and another trial wanted."""
        return (
            self.client.leases_on_complete
            and self.options.max_trials_per_card == 1
            and self.ranks == 1
            and not self.options.plan_ahead
            and self.following is None
            and not self.stop.is_set()
            and not self.reached_max_trials()
        )

    def reached_max_trials(self) -> bool:
        return self.options.max_trials is not None and self.trials_run >= self.options.max_trials

    def idle_too_long(self, idle_since: float) -> bool:
        limit = self.options.exit_when_idle_s
        return limit is not None and time.monotonic() - idle_since >= limit


def _device_index(device: str) -> int:
    """The card index of 'cuda:N' (0 for 'cpu' or a bare 'cuda')."""
    return int(device.partition(":")[2] or 0)
