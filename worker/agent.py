"""The worker agent: register → heartbeat thread → next → plan → run → report, until stopped.

One agent drives one card. `run_once()` is one cycle (for tests); `run_forever(stop)` loops
until the Event is set (SIGTERM/SIGINT in the CLI): the running trial then stops at its next
step and goes back to the server as interrupted, to be re-offered, not failed.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.logs import log_event
from service.wire import (
    Assignment,
    Calibration,
    CardConstants,
    CompleteRequest,
    FailKind,
    FailRequest,
    HandBackRequest,
    Heartbeat,
    Measured,
    NextRequest,
    Plan,
    Prediction,
    ReportRequest,
    StartRequest,
    TrialAck,
    WorkerRegister,
    WorkerRegistered,
)
from worker import gpu
from worker.api import FinalCall, LeaseLost, Rejected, ServerClient, ServerUnavailable
from worker.policy import HandBack, choose_plan, footprint
from worker.runner import CardSpec, OutOfMemory, RunResult, Stopped, TrialRunner
from worker.spool import Spool, Spooled

log = logging.getLogger("vramtune.worker")

# Why a stop order ends a trial, and what the server is told: a paused study gets its trial back
# to offer again; a deleted study or a lost lease has nobody left to tell.
_STOP_KINDS: dict[str, FailKind | None] = {
    "pruned": "pruned",
    "paused": "interrupted",
    "interrupted": "interrupted",
    "deleted": None,
    "lease_lost": None,
    # The server refused this worker's token (revoked, expired): no call can be made any
    # more, and the server offers the trial again itself.
    "token_refused": None,
}
# Answers to a heartbeat that no retry will change: the token is not (or no longer) valid,
# or this worker is not the token's.
_CREDENTIALS_REFUSED = (401, 403)


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


@dataclass
class _Running:
    """The trial being run now; the heartbeat thread may set `stop_reason`."""

    assignment: Assignment
    stop_reason: str | None = None


@dataclass
class _TrialReporter:
    """The `Reporter` a runner gets: intermediate values to the server, stop orders back."""

    agent: Agent
    running: _Running
    reported: list[int] = field(default_factory=list)

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
        return "interrupted" if self.agent.stop.is_set() else None


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
        self._running: _Running | None = None
        # The trial this worker holds, from next's answer until its final call is settled:
        # heartbeats name it, and the server renews that lease only (a lease whose answer
        # never reached us then expires and its trial is offered again).
        self._held: int | None = None
        self._heartbeats: threading.Thread | None = None
        self._heartbeats_stop = threading.Event()
        self._beat_now = threading.Event()
        self.refused: Rejected | None = None  # set when the server refused our token
        self.spool = None if options.spool_dir is None else Spool(options.spool_dir)

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
            self.event("registered", card=self.card.info.model, free_bytes=self.free_bytes())
            self._heartbeats = threading.Thread(
                target=self._heartbeat_loop, name="vramtune-heartbeat", daemon=True
            )
            self._heartbeats.start()
            self._replay_spool()
        return self.registered

    def close(self) -> None:
        """Stop heartbeating and tell the server this worker leaves."""
        self._heartbeats_stop.set()
        self._beat_now.set()
        if self._heartbeats is not None:
            self._heartbeats.join(timeout=5.0)
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
        idle_since = time.monotonic()
        try:
            self.start()
            while not self.stop.is_set() and not self._reached_max_trials():
                if self.run_once():
                    idle_since = time.monotonic()
                elif self._idle_too_long(idle_since):
                    self.event("idle_exit", idle_s=round(time.monotonic() - idle_since, 1))
                    break
                else:
                    self.stop.wait(self.options.idle_poll_s)
        except ServerUnavailable as error:
            if not self.stop.is_set():
                raise
            self.event("shutdown_unreachable", error=str(error))
        finally:
            self.close()
        if self.refused is not None:
            raise self.refused

    def run_once(self) -> bool:
        """One cycle: ask for a trial and see it to its end; False when there was no work."""
        request = NextRequest(free_bytes=self.free_bytes())
        assignment = self.client.next(self.worker_id, request, cancel=self.stop)
        if assignment is None:
            return False
        self.trials_run += 1
        self._held = assignment.trial_id
        # Renew the new lease at once: it started ticking before a slow answer reached us.
        self._beat_now.set()
        self.event("leased", assignment, attempt=assignment.attempt, params=assignment.params)
        try:
            self._run_trial(assignment)
        except LeaseLost as error:
            self.event("lease_lost", assignment, detail=str(error))
        except Rejected as error:
            self.event("rejected", assignment, status=error.status_code, detail=str(error.detail))
        finally:
            self._held = None
        return True

    # ------------------------------------------------------------ one trial

    def _run_trial(self, assignment: Assignment) -> None:
        runner = self.runners.get(assignment.task)
        if runner is None:
            self._fail(assignment, "error", f"task {assignment.task!r} is not installed here")
            return
        config = {**assignment.task_config, **assignment.params}
        planning_began = time.monotonic()
        try:
            decision = choose_plan(
                runner,
                config,
                assignment.memory_policy,
                self.card,
                self.free_bytes(),
                assignment.plans_tried,
                self._calibration(assignment.task),
            )
        except Exception as error:  # the task's check of its configuration (TaskConfigError)
            self._fail(assignment, "error", _message(error))
            return
        planning_s = round(time.monotonic() - planning_began, 4)
        if isinstance(decision, HandBack):
            self._hand_back(assignment, decision, planning_s)
            return
        self.client.start(
            assignment.trial_id,
            StartRequest(
                lease=assignment.lease, plan=decision.plan, prediction=decision.prediction
            ),
        )
        predicted = footprint(decision.prediction)
        self.event(
            "started",
            assignment,
            plan=decision.plan.reason,
            predicted=predicted,
            planning_s=planning_s,
        )
        self._run_planned(assignment, runner, config, decision.plan, decision.prediction)

    def _run_planned(
        self,
        assignment: Assignment,
        runner: TrialRunner,
        config: dict[str, Any],
        plan: Plan,
        prediction: Prediction,
    ) -> None:
        running = _Running(assignment)
        self._running = running
        began = time.monotonic()
        try:
            result = runner.run(
                config, plan, assignment.budget, self.card, _TrialReporter(self, running)
            )
        except OutOfMemory as oom:
            seconds = time.monotonic() - began
            self._fail(assignment, "oom", str(oom), plan, prediction, oom.measured, seconds)
        except Stopped as stopped:
            self._stopped(assignment, str(stopped.reason), plan, prediction, stopped.measured)
        except Exception as error:  # a broken configuration must fail its trial, not the worker
            seconds = time.monotonic() - began
            self._fail(assignment, "error", _message(error), plan, prediction, None, seconds)
        else:
            self._complete(assignment, result, plan, prediction)
        finally:
            self._running = None

    def _complete(
        self, assignment: Assignment, result: RunResult, plan: Plan, prediction: Prediction
    ) -> None:
        values = list(result.values)
        if assignment.minimize_peak_memory:
            values.append(float(peak_bytes(result.measured)))
        if len(values) != assignment.n_objectives or not all(map(math.isfinite, values)):
            message = f"values {values}: the study needs {assignment.n_objectives} finite ones"
            self._fail(assignment, "error", message, plan, prediction, result.measured)
            return
        request = CompleteRequest(
            lease=assignment.lease,
            values=values,
            plan=plan,
            prediction=prediction,
            measured=result.measured,
            duration_s=result.duration_s,
            samples_per_s=result.samples_per_s,
        )
        ack = self._deliver("complete", assignment, request)
        self.event(
            "completed",
            assignment,
            values=values,
            resolution=ack.resolution,
            measured=peak_bytes(result.measured),
            seconds=round(result.duration_s, 3),
        )

    def _stopped(
        self,
        assignment: Assignment,
        reason: str,
        plan: Plan,
        prediction: Prediction,
        measured: Measured | None,
    ) -> None:
        kind = _STOP_KINDS.get(reason, "interrupted")
        if kind is None:
            self.event("dropped", assignment, reason=reason)
            return
        self._fail(assignment, kind, reason, plan, prediction, measured)

    def _fail(
        self,
        assignment: Assignment,
        kind: FailKind,
        message: str,
        plan: Plan | None = None,
        prediction: Prediction | None = None,
        measured: Measured | None = None,
        seconds: float | None = None,
    ) -> None:
        request = FailRequest(
            lease=assignment.lease,
            kind=kind,
            message=message[:4096],
            plan=plan,
            prediction=prediction,
            measured=measured,
        )
        ack = self._deliver("fail", assignment, request)
        self.event(
            "failed",
            assignment,
            kind=kind,
            message=message,
            resolution=ack.resolution,
            seconds=None if seconds is None else round(seconds, 3),
        )

    def _hand_back(self, assignment: Assignment, decision: HandBack, planning_s: float) -> None:
        request = HandBackRequest(
            lease=assignment.lease,
            min_footprint_bytes=decision.min_footprint_bytes,
            plan=decision.plan,
            reason=decision.reason[:4096],
        )
        ack = self._deliver("handback", assignment, request)
        self.event(
            "handed_back",
            assignment,
            min_footprint=decision.min_footprint_bytes,
            planning_s=planning_s,
            resolution=ack.resolution,
            reason=decision.reason,
        )

    # ------------------------------------------------------------ helpers

    def free_bytes(self) -> int:
        """What this card can give a trial now (NVML on a GPU, the limit on a simulated card)."""
        free = None if self.card.info.simulated else gpu.free_bytes(self.card.info.device_index)
        free = self.card.info.free_bytes if free is None else free
        limit = self.options.memory_limit
        return free if limit is None else min(free, limit)

    def event(self, name: str, assignment: Assignment | None = None, **fields: Any) -> None:
        """One structured log line (common.logs) with the worker's and the trial's ids."""
        ids: dict[str, Any] = {"worker": self.options.name}
        if self.registered is not None:
            ids["worker_id"] = self.registered.worker_id
        if assignment is not None:
            ids |= {
                "trial_id": assignment.trial_id,
                "number": assignment.number,
                "study": assignment.study,
            }
        log_event(log, name, **(ids | fields))

    def _registration(self) -> WorkerRegister:
        return WorkerRegister(
            name=self.options.name,
            device=self.options.device,
            card=self.card.info.model_copy(update={"free_bytes": self.free_bytes()}),
            tasks=sorted(self.runners),
            constants=CardConstants.model_validate(
                {k: v for k, v in self.card.constants.items() if k in CardConstants.model_fields}
            ),
        )

    def _calibration(self, task: str) -> Calibration | None:
        """The service's correction for this card and task, when it has one."""
        torch_version = self.card.info.torch_version or "none"
        try:
            return self.client.calibration(self.card.info.model, torch_version, task)
        except (ServerUnavailable, Rejected, LeaseLost):
            return None

    def _deliver(
        self,
        call: FinalCall,
        assignment: Assignment,
        request: CompleteRequest | FailRequest | HandBackRequest,
    ) -> TrialAck:
        """Send a trial's final call until the server answers it, kept in the spool meanwhile.

        The agent takes no new trial before that. A shutdown that finds the server still away
        after its grace period leaves the call in the spool (if any) for the next start.
        """
        kept = None if self.spool is None else self.spool.keep(call, assignment.trial_id, request)
        queued_at: list[float] = []

        def queued(problem: str) -> None:
            if not queued_at:  # said once: the retries themselves are logged by the client
                queued_at.append(time.monotonic())
                where = None if kept is None else str(kept.path)
                self.event("result_queued", assignment, call=call, problem=problem, spool=where)

        try:
            ack = self.client.deliver(
                call,
                assignment.trial_id,
                request,
                retry_for_s=self._delivery_s(),
                on_retry=queued,
            )
        except ServerUnavailable:
            where = None if kept is None else str(kept.path)
            self.event("result_kept" if kept else "result_lost", assignment, call=call, spool=where)
            raise
        except (LeaseLost, Rejected):
            self._answered(kept)
            raise
        self._answered(kept)
        if queued_at:
            waited = round(time.monotonic() - queued_at[0], 3)
            self.event(
                "delivered", assignment, call=call, resolution=ack.resolution, waited_s=waited
            )
        return ack

    def _answered(self, kept: Spooled | None) -> None:
        if self.spool is not None and kept is not None:
            self.spool.answered(kept)

    def _replay_spool(self) -> None:
        """Send the final calls an earlier run of this worker kept but never had answered."""
        if self.spool is None:
            return
        models: dict[str, type[CompleteRequest | FailRequest | HandBackRequest]] = {
            "complete": CompleteRequest,
            "fail": FailRequest,
            "handback": HandBackRequest,
        }
        for kept in self.spool.pending():
            body = models[kept.call].model_validate(kept.body)
            facts: dict[str, Any] = {"trial_id": kept.trial_id, "call": kept.call}
            facts["kept_s"] = round(time.time() - kept.kept_at, 1)
            try:
                ack = self.client.deliver(kept.call, kept.trial_id, body, cancel=self.stop)
            except LeaseLost as error:  # re-offered meanwhile: the trial is another's now
                self.event("replay_refused", **facts, detail=str(error))
            except Rejected as error:
                self.event("replay_rejected", **facts, status=error.status_code, detail=str(error))
            else:
                self.event("delivered", **facts, replayed=True, resolution=ack.resolution)
            self.spool.answered(kept)

    def _delivery_s(self) -> float | None:
        """Outcomes are retried until delivered, except for a grace period when shutting down."""
        return self.options.shutdown_grace_s if self.stop.is_set() else None

    def _heartbeat_loop(self) -> None:
        assert self.registered is not None
        interval = self.registered.heartbeat_interval_s
        while True:
            self._beat_now.wait(interval)
            self._beat_now.clear()
            if self._heartbeats_stop.is_set():
                return
            try:
                reply = self.client.heartbeat(
                    self.registered.worker_id,
                    Heartbeat(free_bytes=self.free_bytes(), trials=self._held_trials()),
                    retry_for_s=interval,
                )
            except Rejected as error:
                if error.status_code in _CREDENTIALS_REFUSED:
                    self._token_refused(error)
                    return
                self.event("heartbeat_missed", error=str(error))
                continue
            except (ServerUnavailable, LeaseLost) as error:
                self.event("heartbeat_missed", error=str(error))
                continue
            running = self._running
            for order in reply.stop:
                if running is not None and order.trial_id == running.assignment.trial_id:
                    running.stop_reason = order.reason
                    self.event("stop_ordered", running.assignment, reason=order.reason)

    def _token_refused(self, error: Rejected) -> None:
        """Stop at once: the running trial is dropped (the server re-offers it), no new one."""
        self.refused = error
        self.event("token_refused", status=error.status_code, detail=str(error.detail))
        running = self._running
        if running is not None:
            running.stop_reason = "token_refused"
        self.stop.set()

    def _held_trials(self) -> list[int]:
        held = self._held
        return [] if held is None else [held]

    def _reached_max_trials(self) -> bool:
        return self.options.max_trials is not None and self.trials_run >= self.options.max_trials

    def _idle_too_long(self, idle_since: float) -> bool:
        limit = self.options.exit_when_idle_s
        return limit is not None and time.monotonic() - idle_since >= limit


def peak_bytes(measured: Measured) -> int:
    """The measured peak the card had to hold (reserved when known, else allocated)."""
    return max(measured.peak_reserved_bytes or 0, measured.peak_allocated_bytes)


def _message(error: BaseException) -> str:
    text = str(error)
    return text if text else type(error).__name__
