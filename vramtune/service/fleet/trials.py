"""Trial calls under a lease: start, report, complete, fail, hand back; helpers never commit.

Each call is fenced (service.fleet.leases.fence): nothing changes under a lost lease. Optuna's rows
and vramtune's are written in the call's one transaction (vramtune.service.optuna.rows). A call that
ends the lease stores its answer there, so that a worker retrying it after a lost reply gets
the same answer and Optuna is told once.

Values of a complete: ``Assignment.n_objectives`` values, the study's objectives with the
measured peak memory last when the study minimizes it. A worker may also leave the peak out:
the server then appends the measured peak itself (reserved bytes when measured, else
allocated), the same number the worker would have sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from optuna.storages import BaseStorage
from optuna.trial import TrialState
from sqlalchemy.orm import Session

from vramtune.common.memory import held_peak, peak_of, raw_peaks
from vramtune.common.plans import ran_as
from vramtune.common.units import human_bytes, infeasible_reason
from vramtune.service.db.tables import MemoryObservationRow, StepTimeObservationRow
from vramtune.service.db.writes import insert_row, set_columns
from vramtune.service.errors import Invalid
from vramtune.service.fleet import events, predictions, trust
from vramtune.service.fleet.leases import Fenced, check_started, end, fence, resolution
from vramtune.service.fleet.routing import (
    MAX_OOM_RETRIES,
    OptunaTell,
    attempts_left,
    headroom,
    live_capacity,
    reoffer,
    tell_failed,
    tell_infeasible,
    write_attrs,
    write_constraint,
)
from vramtune.service.fleet.workers import check_owner, count_done, heard_from
from vramtune.service.optuna import rows as optuna_rows
from vramtune.service.optuna.glue import load_optuna_study, spec_of, tell
from vramtune.service.settings import Settings
from vramtune.service.wire import (
    CompleteRequest,
    FailRequest,
    HandBackRequest,
    Measured,
    Plan,
    PlanChoice,
    Prediction,
    ReportReply,
    ReportRequest,
    StartRequest,
    StepTimeObservation,
    StopReason,
    StudyCreate,
    TrialAck,
    TrialResolution,
)


@dataclass(frozen=True)
class TrialCall:
    """What every trial call needs: the session, Optuna's storage, settings, the time, and
    the calling token (None: auth off), which must be the one that registered the worker."""

    session: Session
    storage: BaseStorage
    settings: Settings
    now: datetime
    token_id: int | None = None

    def fence(
        self,
        trial_id: int,
        lease: str,
        call: str,
        kind: str | None = None,
        ran: bool = False,
    ) -> Fenced:
        """The call admitted under its lease (vramtune.service.fleet.leases.fence), by the worker's
        token.

        Checked before a replay too: a lease token is no use to another token's worker.
        ``ran``: the call reports what running the trial gave, which a lease that never
        started cannot have (service.fleet.leases.check_started); a replay is answered as is.
        """
        fenced = fence(self.session, trial_id, lease, self.now, call, kind)
        check_owner(fenced.worker, self.token_id)
        if ran and fenced.replay is None:
            check_started(fenced.lease, trial_id, call)
        heard_from(fenced.worker, self.now, self.settings.worker_stale_s)
        return fenced

    def made_for(self, fenced: Fenced) -> predictions.MadeFor:
        """The fenced trial as the server knows it, and the scope its worker teaches in."""
        trial, study = fenced.trial, fenced.study
        return predictions.MadeFor(
            trial_id=trial.trial_id,
            study_id=trial.study_id,
            task=study.task,
            config={**spec_of(study).task_config, **(trial.params or {})},
            scope=trust.scope_of(self.session, fenced.worker, study),
            visible=tuple(trust.visible_to_trial(study)),
        )

    def telling(self, fenced: Fenced) -> OptunaTell:
        """Where to tell Optuna about the fenced trial."""
        return OptunaTell(self.session, self.storage, fenced.study, self.now)


def _story(call: TrialCall, fenced: Fenced, kind: events.EventKind, **detail: Any) -> None:
    """One event of the fenced trial's story, by the worker that made it happen."""
    worker = fenced.worker
    detail |= {"worker": worker.name, "card_bytes": worker.total_bytes}
    events.record(call.session, fenced.trial.trial_id, kind, call.now, **detail)


def _plan_facts(plan: Plan | dict[str, Any] | None) -> dict[str, Any] | None:
    """A plan as the story keeps it: its knobs and reason."""
    if isinstance(plan, Plan):
        return plan.model_dump(mode="json")
    return plan or None


def _ack(fenced: Fenced, what: TrialResolution, detail: str = "") -> TrialAck:
    return TrialAck(trial_id=fenced.trial.trial_id, resolution=what, detail=detail)


def _finish(
    call: TrialCall,
    fenced: Fenced,
    ack: TrialAck,
    how: str,
    kind: str | None = None,
    stop: StopReason | None = None,
    **columns: Any,
) -> TrialAck:
    """End the lease with its answer; the trial row is done unless it was routed elsewhere.

    ``columns``: more of the trial row's columns to write in the same statement.
    """
    trial = fenced.trial
    if ack.resolution in ("complete", "failed", "infeasible", "pruned"):
        columns["status"] = "done"
        columns["outcome"] = _OUTCOMES.get(ack.resolution, columns.get("outcome", trial.outcome))
    if ack.resolution != "complete":  # a complete's detail echoes its values: not news
        columns["message"] = ack.detail or trial.message
    set_columns(call.session, trial, **columns, updated_at=call.now)
    end(call.session, fenced.lease, call.now, resolution(how, ack, kind, stop))
    return ack


# An OOM that ends in FAIL keeps its outcome "oom"; a complete has set its own.
_OUTCOMES = {"infeasible": "infeasible", "pruned": "pruned"}


# ---------------------------------------------------------------- start and report


def start(call: TrialCall, trial_id: int, body: StartRequest) -> TrialAck:
    """The worker chose its plan and runs it: store the plan and the prediction."""
    fenced = call.fence(trial_id, body.lease, "start")  # never a replay
    _check_cards(body.cards, fenced.worker.cards)
    check_plan(body.plan, spec_of(fenced.study), fenced.worker.cards)
    predicted = _predicted(body.prediction)
    plan = body.plan.model_dump(mode="json")
    attrs = {
        "plan": plan,
        "cards": body.cards,
        "predicted_peak_bytes": predicted,
        "prediction": None if body.prediction is None else body.prediction.model_dump(),
        "worker": fenced.worker.name,
        "card_model": fenced.worker.card_model,
        "attempt": fenced.trial.attempt,
    }
    _plan_chosen(call, fenced, body, attrs)
    set_columns(
        call.session, fenced.trial, plan=plan, predicted_peak_bytes=predicted, updated_at=call.now
    )
    if fenced.lease.started_at is None:  # a second start keeps the first one's time
        set_columns(call.session, fenced.lease, started_at=call.now)
    resized = ran_as(body.plan, routed=False) == "resized"
    kind: events.EventKind = "resized" if resized else "planned"
    _story(call, fenced, kind, plan=plan, predicted_bytes=predicted, cards=body.cards)
    return _ack(fenced, "started", f"running as planned: {body.plan.reason}".strip(": "))


def _check_cards(cards: list[int] | None, registered: int) -> None:
    """422 for a card the worker did not register (its `cards` count them from 0)."""
    beyond = [card for card in cards or [] if card >= registered]
    if beyond:
        raise Invalid("cards", f"{beyond} beyond the {registered} cards this worker registered")


def check_plan(plan: Plan, spec: StudyCreate, registered: int) -> None:
    """422 for ranks the study does not allow or the worker does not have.

    The worker's word was taken: a study without `distributed` got a two-rank DDP plan stored
    and its outcome counted as run as asked (issue 47).
    """
    if plan.world_size == 1:
        return
    policy = spec.distributed
    if policy is None:
        raise Invalid("plan.world_size", "the study allows one card per trial (no distributed)")
    if plan.world_size > min(policy.max_world_size, registered):
        limit = min(policy.max_world_size, registered)
        raise Invalid("plan.world_size", f"at most {limit} (the study's and worker's cards)")
    if plan.strategy not in policy.strategies:
        raise Invalid("plan.strategy", f"the study allows {policy.strategies} only")


def _plan_chosen(call: TrialCall, fenced: Fenced, body: PlanChoice, attrs: dict[str, Any]) -> None:
    """How the plan was chosen, on the trial with the call's other ``attrs`` (one statement);
    the predictions made for it, for the fleet."""
    chosen = {"planning_s": body.planning_s, "prediction_source": body.prediction_source}
    write_attrs(call.session, fenced.trial.trial_id, {**attrs, **chosen})
    predictions.keep(call.session, fenced.worker, call.made_for(fenced), body.predictions, call.now)


def report(call: TrialCall, trial_id: int, body: ReportRequest) -> ReportReply:
    """An intermediate value; the study's pruner decides on it (single-objective studies)."""
    fenced = call.fence(trial_id, body.lease, "report", ran=True)
    frozen = call.storage.get_trial(trial_id)  # the values reported before, as committed
    if body.step in frozen.intermediate_values:
        return ReportReply(prune=False)  # as Optuna's Trial.report: a step is reported once
    optuna_rows.set_intermediate(call.session, trial_id, body.step, body.value)
    study = load_optuna_study(call.storage, fenced.study)
    if len(study.directions) > 1:
        return ReportReply(prune=False)  # Optuna prunes single-objective studies only
    frozen.intermediate_values[body.step] = body.value
    if not study.pruner.prune(study, frozen):
        return ReportReply(prune=False)
    # Told now, so a worker that ignores the answer cannot keep the trial; its fail(pruned)
    # replays this answer and its heartbeat carries the stop order.
    _tell_pruned(call, fenced)
    _story(call, fenced, "pruned", step=body.step, value=body.value)
    ack = _ack(fenced, "pruned", f"pruned at step {body.step} by the study's pruner")
    _finish(call, fenced, ack, "fail", "pruned", stop="pruned")
    return ReportReply(prune=True)


def _tell_pruned(call: TrialCall, fenced: Fenced) -> None:
    write_attrs(call.session, fenced.trial.trial_id, {"outcome": "pruned"})
    tell(call.session, call.storage, fenced.study, fenced.trial, TrialState.PRUNED, call.now)


# ---------------------------------------------------------------- complete


def objective_values(spec: StudyCreate, body: CompleteRequest) -> list[float]:
    """The values to tell, with the measured peak appended if the worker left it out."""
    wanted = len(spec.objective_directions)
    values = list(body.values)
    if spec.minimize_peak_memory and len(values) == wanted - 1:
        values.append(float(peak_of(body.measured)))
    if len(values) != wanted:
        names = [*spec.directions, *(["peak memory"] if spec.minimize_peak_memory else [])]
        raise Invalid("values", f"expected {wanted} values ({', '.join(names)}), got {len(values)}")
    return values


def complete(call: TrialCall, trial_id: int, body: CompleteRequest) -> TrialAck:
    """Tell Optuna the value(s), with the plan, the peaks and a feasible memory constraint."""
    return complete_by(call, trial_id, body)[0]


def complete_by(call: TrialCall, trial_id: int, body: CompleteRequest) -> tuple[TrialAck, int]:
    """``complete``, and the id of the worker whose lease it was (it may ask for its next)."""
    fenced = call.fence(trial_id, body.lease, "complete", ran=True)
    if fenced.replay is not None:
        return fenced.replay, fenced.worker.id
    return _complete(call, fenced, body), fenced.worker.id


def _complete(call: TrialCall, fenced: Fenced, body: CompleteRequest) -> TrialAck:
    trial_id = fenced.trial.trial_id
    spec = spec_of(fenced.study)
    values = objective_values(spec, body)  # 422 before anything is written
    check_plan(body.plan, spec, fenced.worker.cards)
    worker, peak = fenced.worker, peak_of(body.measured)
    outcome = _outcome_of(body.plan, routed=fenced.trial.min_bytes > 0)
    attrs = {
        "plan": body.plan.model_dump(mode="json"),
        "predicted_peak_bytes": _predicted(body.prediction),
        "prediction": None if body.prediction is None else body.prediction.model_dump(),
        "measured_peak_bytes": peak,
        "measured": body.measured.model_dump(mode="json"),
        "worker": worker.name,
        "card_model": worker.card_model,
        "outcome": outcome,
        "duration_s": body.duration_s,
        "samples_per_s": body.samples_per_s,
        "step_time": None if body.step_time is None else body.step_time.model_dump(),
    }
    write_attrs(call.session, trial_id, attrs)
    write_constraint(call.session, trial_id, min(headroom(peak, worker.total_bytes), 0.0))
    told = TrialState.COMPLETE
    tell(call.session, call.storage, fenced.study, fenced.trial, told, call.now, values)
    observe(call, fenced, body.plan, body.prediction, body.measured, "complete")
    observe_step_time(call, fenced, body.step_time)
    count_done(call.session, worker)
    _story(
        call,
        fenced,
        "completed",
        outcome=outcome,
        predicted_bytes=attrs["predicted_peak_bytes"],
        measured_bytes=peak,
    )
    ack = _ack(fenced, "complete", f"told Optuna {values}")
    return _finish(
        call,
        fenced,
        ack,
        "complete",
        plan=attrs["plan"],
        predicted_peak_bytes=attrs["predicted_peak_bytes"],
        measured_peak_bytes=peak,
        outcome=outcome,
    )


def _predicted(prediction: Prediction | None) -> int | None:
    """The peak the trace predicted, before calibration: what the measured peak is held to."""
    return None if prediction is None else held_peak(*raw_peaks(prediction))


def _outcome_of(plan: Plan, routed: bool) -> str:
    """routed (ran on a larger card after a hand-back), resized, or as_asked."""
    return ran_as(plan, routed)


def observe(
    call: TrialCall,
    fenced: Fenced,
    plan: Plan | dict[str, Any] | None,
    prediction: Prediction | None,
    measured: Measured | None,
    outcome: str,
) -> None:
    """Store predicted against measured peak: the calibration's raw material."""
    if measured is None:
        return
    worker, made_for = fenced.worker, call.made_for(fenced)
    plan_json = plan.model_dump(mode="json") if isinstance(plan, Plan) else (plan or {})
    # The fit is fed the raw predictions: calibrating calibrated ones would compound.
    raw_allocated, raw_reserved = (None, None) if prediction is None else raw_peaks(prediction)
    fields = {k: v for k, v in plan_json.items() if k in Plan.model_fields}
    ran = Plan.model_validate(fields) if fields else None
    if ran is not None:
        predictions.withdraw_contradicted(call.session, worker, made_for, ran, peak_of(measured))
    insert_row(
        call.session,
        MemoryObservationRow,
        trial_id=fenced.trial.trial_id,
        study_id=fenced.trial.study_id,
        worker_id=worker.id,
        card_model=worker.card_model,
        torch_version=str(worker.card.get("torch_version") or "none"),
        task=fenced.study.task,
        plan=plan_json,
        outcome=outcome,
        predicted_allocated=raw_allocated,
        predicted_reserved=raw_reserved,
        measured_allocated=measured.peak_allocated_bytes,
        measured_reserved=measured.peak_reserved_bytes,
        nvml_peak=measured.nvml_peak_bytes,
        predicted_training=None if prediction is None else prediction.training_peak_bytes,
        predicted_evaluation=None if prediction is None else prediction.evaluation_peak_bytes,
        measured_training=measured.training_peak_bytes,
        measured_evaluation=measured.evaluation_peak_bytes,
        created_at=call.now,
        scope=made_for.scope,
    )


def observe_step_time(
    call: TrialCall, fenced: Fenced, step_time: StepTimeObservation | None
) -> None:
    """Store a run's measured time per step with its features: the step-time model's material."""
    if step_time is None or not step_time.measured_step_s:
        return
    insert_row(
        call.session,
        StepTimeObservationRow,
        trial_id=fenced.trial.trial_id,
        card_model=fenced.worker.card_model,
        task=fenced.study.task,
        features=step_time.model_dump(mode="json"),
        predicted_step_s=step_time.predicted_step_s,
        measured_step_s=step_time.measured_step_s,
        created_at=call.now,
        worker_id=fenced.worker.id,
        scope=trust.scope_of(call.session, fenced.worker, fenced.study),
    )


# ---------------------------------------------------------------- fail


def fail(call: TrialCall, trial_id: int, body: FailRequest) -> TrialAck:
    """OOM: retry once with a smaller plan; error: FAIL; interrupted: offer again; pruned."""
    fenced = call.fence(trial_id, body.lease, "fail", body.kind, ran=ran_first(body))
    if fenced.replay is not None:
        if body.kind == "pruned":  # pruned by its report: the peak comes with this call
            _keep_measured(call, fenced, body)
        return fenced.replay
    if body.kind == "oom":
        ack = _out_of_memory(call, fenced, body)
    elif body.kind == "interrupted":
        reoffer(fenced.trial, call.now, next_attempt=False)
        ack = _ack(fenced, "retry", f"interrupted ({body.message}); offered again".strip())
        _story(call, fenced, "interrupted", message=body.message or None)
    elif body.kind == "pruned":
        _tell_pruned(call, fenced)
        ack = _ack(fenced, "pruned", body.message)
        _story(call, fenced, "pruned", message=body.message or None)
    else:
        reason = body.message or "the worker reported an error"
        tell_failed(call.telling(fenced), fenced.trial, reason)
        fenced.trial.outcome = "failed"
        ack = _ack(fenced, "failed", reason)
        _story(call, fenced, "failed", message=reason[:512])
    _finish(call, fenced, ack, "fail", body.kind)
    if body.kind != "oom":  # an OOM is observed as such, with the plan it ran out under
        _keep_measured(call, fenced, body)
    return ack


def ran_first(body: FailRequest) -> bool:
    """Whether a fail reports a run, and so needs its lease started: an OOM or a prune is one,
    and so is any fail that carries a measured peak. An error or an interruption without a
    measurement may come before running (the task is not installed, the configuration is
    refused, the worker stopped with the trial leased ahead) and needs no start."""
    return body.kind in ("oom", "pruned") or body.measured is not None


def _keep_measured(call: TrialCall, fenced: Fenced, body: FailRequest) -> None:
    """A run stopped early still measured its peak: keep it on the trial and as an observation.

    The worker sends `measured` only for a run that trained (at least one step). Once per lease:
    a repeated call (a lost reply) finds the mark in the lease's resolution.
    """
    lease = fenced.lease
    if body.measured is None or (lease.resolution or {}).get("measured"):
        return
    peak = peak_of(body.measured)
    write_attrs(
        call.session,
        fenced.trial.trial_id,
        {"measured_peak_bytes": peak, "measured": body.measured.model_dump(mode="json")},
    )
    fenced.trial.measured_peak_bytes = peak
    outcome = "failed" if body.kind == "error" else body.kind
    observe(call, fenced, body.plan or fenced.trial.plan, body.prediction, body.measured, outcome)
    lease.resolution = {**(lease.resolution or {}), "measured": True}  # a new dict: JSON change


def _out_of_memory(call: TrialCall, fenced: Fenced, body: FailRequest) -> TrialAck:
    """Record the plan as tried on this card model; retry once, then FAIL."""
    trial, worker = fenced.trial, fenced.worker
    plan = body.plan.model_dump(mode="json") if body.plan else (trial.plan or {})
    tried = [*trial.plans_tried, {**plan, "card_model": worker.card_model}]
    retry = len(tried) <= MAX_OOM_RETRIES and attempts_left(trial, spec_of(fenced.study))
    if retry:
        ack = _ack(fenced, "retry", f"out of memory on {worker.card_model}; retried smaller")
    else:
        reason = f"out of memory {len(tried)} times; last: {body.message or 'out of memory'}"
        tell_failed(call.telling(fenced), trial, reason, outcome="oom")
        ack = _ack(fenced, "failed", reason)
    # A new list object: SQLAlchemy sees a change of a JSON column on assignment only.
    trial.plans_tried = tried
    trial.outcome = "oom"
    if retry:
        reoffer(trial, call.now, next_attempt=True)
    observe(call, fenced, body.plan or plan, body.prediction, body.measured, "oom")
    measured = None if body.measured is None else peak_of(body.measured)
    then = "retried smaller" if retry else "failed"
    _story(call, fenced, "oom", plan=plan, measured_bytes=measured, then=then)
    return ack


# ---------------------------------------------------------------- hand back


def hand_back(call: TrialCall, trial_id: int, body: HandBackRequest) -> TrialAck:
    """Route a trial that does not fit: wait for a larger live card, or for a node with enough
    cards of enough bytes (the hand-back's rank needs, fewest ranks first), or end it
    infeasible."""
    fenced = call.fence(trial_id, body.lease, "handback")
    if fenced.replay is not None:
        return fenced.replay
    trial, worker = fenced.trial, fenced.worker
    earlier = trial.min_bytes if trial.min_world_size == 1 else 0
    footprint = max(earlier, body.min_footprint_bytes)
    handback = {
        "worker": worker.name,
        "card_model": worker.card_model,
        "card_bytes": worker.total_bytes,
        "min_footprint_bytes": body.min_footprint_bytes,
        "plan": None if body.plan is None else body.plan.model_dump(mode="json"),
        "reason": body.reason,
        "rank_needs": [need.model_dump(mode="json") for need in body.rank_needs or []],
    }
    capacity = _capacity(call, fenced, cards=1)
    _plan_chosen(call, fenced, body, {"handback": handback})
    plan = _plan_facts(body.plan)
    if body.fits_here and capacity < footprint:  # the larger card left: it runs where it fits
        reoffer(trial, call.now, next_attempt=False)
        ack = _ack(fenced, "retry", "no larger card is live: offered again as it fits")
        _story(call, fenced, "handed_back", footprint_bytes=footprint, plan=plan, then="here")
        return _finish(call, fenced, ack, "handback")
    if capacity >= footprint:
        return _wait_for(call, fenced, footprint, 1, plan)
    for need in body.rank_needs or []:
        if _capacity(call, fenced, need.world_size) >= need.per_rank_bytes:
            return _wait_for(call, fenced, need.per_rank_bytes, need.world_size, plan)
    trial.min_bytes = footprint
    largest = max(capacity, worker.total_bytes)
    margin = spec_of(fenced.study).memory_policy.margin
    reason = infeasible_reason(footprint, largest, margin)
    if body.rank_needs:
        fewest = min(body.rank_needs, key=lambda need: need.per_rank_bytes)
        reason += (
            f"; no live node has {fewest.world_size} cards of "
            f"{human_bytes(fewest.per_rank_bytes)} ({fewest.strategy}), nor any other world "
            "size's need"
        )
    tell_infeasible(call.telling(fenced), trial, footprint, largest, reason)
    _story(
        call,
        fenced,
        "infeasible",
        footprint_bytes=footprint,
        largest_card_bytes=largest,
        margin=margin,
    )
    return _finish(call, fenced, _ack(fenced, "infeasible", reason), "handback")


def _capacity(call: TrialCall, fenced: Fenced, cards: int) -> int:
    """The largest card of another live worker of the task with at least `cards` cards."""
    settings = call.settings
    return live_capacity(
        call.session,
        fenced.study,
        call.now,
        settings.worker_stale_s,
        settings.max_card_bytes,
        exclude=fenced.worker.id,
        min_cards=cards,
    )


def _wait_for(
    call: TrialCall, fenced: Fenced, per_card: int, cards: int, plan: dict[str, Any] | None
) -> TrialAck:
    """The trial waits for a worker with `cards` cards of at least `per_card` bytes each."""
    trial = fenced.trial
    trial.min_bytes, trial.min_world_size = per_card, cards
    trial.status = "waiting"
    trial.updated_at = call.now
    where = "a card" if cards == 1 else f"a node with {cards} free cards"
    ack = _ack(fenced, "waiting", f"waits for {where} of at least {human_bytes(per_card)}")
    _story(call, fenced, "handed_back", footprint_bytes=per_card, plan=plan, then="waits")
    return _finish(call, fenced, ack, "handback")
