"""Worker protocol routes (trials): start, report, complete, fail, hand back, under a lease."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, TypeVar

from fastapi import APIRouter
from pydantic import BaseModel
from sqlalchemy.exc import SQLAlchemyError

from vramtune.service.api.deps import StateDep, path_id
from vramtune.service.auth.tokens import PrincipalDep
from vramtune.service.errors import DomainError
from vramtune.service.fleet import dispatch, trials as fleet_trials
from vramtune.service.fleet.trials import TrialCall
from vramtune.service.fleet.workers import fleet_transaction
from vramtune.service.principal import Principal
from vramtune.service.state import AppState
from vramtune.service.wire import (
    CompleteReply,
    CompleteRequest,
    FailRequest,
    HandBackRequest,
    ReportReply,
    ReportRequest,
    StartRequest,
    TrialAck,
)

router = APIRouter(prefix="/trials", tags=["trials"])

TrialId = Annotated[int, path_id("Optuna's trial id.", low=0)]
Body = TypeVar("Body", bound=BaseModel)
Reply = TypeVar("Reply", bound=BaseModel)


def _run(
    state: AppState,
    principal: Principal,
    use_case: Callable[[TrialCall, int, Body], Reply],
    trial_id: int,
    body: Body,
) -> Reply:
    """One trial call in one fleet transaction, by the token of the lease's worker."""
    with fleet_transaction(state, use_case.__name__) as session:
        call = TrialCall(session, state.storage, state.settings, state.clock(), principal.token_id)
        return use_case(call, trial_id, body)


@router.post("/{trial_id}/start")
def start(
    trial_id: TrialId, body: StartRequest, state: StateDep, principal: PrincipalDep
) -> TrialAck:
    """The worker starts the trial with the plan it chose; stores plan and prediction.

    The lease is marked started: a result of running the trial (complete, report, a fail of
    kind ``oom`` or ``pruned``, or any fail carrying ``measured``) is refused with a 409,
    writing nothing, under a lease that never started.
    """
    return _run(state, principal, fleet_trials.start, trial_id, body)


@router.post("/{trial_id}/report")
def report(
    trial_id: TrialId, body: ReportRequest, state: StateDep, principal: PrincipalDep
) -> ReportReply:
    """An intermediate value; the answer says whether the study's pruner prunes the trial.

    409 under a lease that was never started (``start``).
    """
    return _run(state, principal, fleet_trials.report, trial_id, body)


# exclude_unset: a complete that did not ask for its next trial is answered a TrialAck, as
# before (workers that validate it strictly, extra fields forbidden, keep working).
@router.post("/{trial_id}/complete", response_model_exclude_unset=True)
def complete(
    trial_id: TrialId, body: CompleteRequest, state: StateDep, principal: PrincipalDep
) -> CompleteReply:
    """The trial's value(s), plan and peaks; told to Optuna once (idempotent per lease).

    409, nothing told, under a lease that was never started (``start``); a repeat of a
    complete that was taken gets the same answer.

    With ``next``, the worker's next trial is leased too, in a transaction of its own once the
    complete has committed: a lease that cannot be granted leaves the result told, and says
    why in ``next_detail``. A repeated complete (a lost reply) leases anew; a trial leased by
    the lost reply is re-offered once its lease expires (its worker never heard of it).
    """
    with fleet_transaction(state, "complete") as session:
        call = TrialCall(session, state.storage, state.settings, state.clock(), principal.token_id)
        ack, worker_id = fleet_trials.complete_by(call, trial_id, body)
    reply = CompleteReply(**ack.model_dump())
    if body.next is not None:
        reply.next, reply.next_detail = None, ""  # set: answered even when null
        try:
            reply.next = dispatch.next_assignment(
                state, worker_id, body.next, state.clock(), principal.studies, principal.token_id
            )
        except (DomainError, SQLAlchemyError) as error:  # told already: the result stands
            reply.next_detail = f"no trial leased: {error}"
        else:
            reply.next_detail = "" if reply.next else "no work for this worker now"
    return reply


@router.post("/{trial_id}/fail")
def fail(
    trial_id: TrialId, body: FailRequest, state: StateDep, principal: PrincipalDep
) -> TrialAck:
    """OOM (retried once smaller), error (FAIL), interrupted (offered again) or pruned.

    An ``oom``, a ``pruned``, or any fail carrying ``measured`` reports a run: 409, nothing
    written, under a lease that was never started (``start``). An ``error`` or
    ``interrupted`` without ``measured`` may come before the start (the task is not
    installed, the configuration is refused, the worker stopped before running it).
    """
    return _run(state, principal, fleet_trials.fail, trial_id, body)


@router.post("/{trial_id}/handback")
def hand_back(
    trial_id: TrialId, body: HandBackRequest, state: StateDep, principal: PrincipalDep
) -> TrialAck:
    """The trial does not fit this card: it waits for a larger one, or ends infeasible.

    Comes instead of a start (the plan does not fit), so needs none.
    """
    return _run(state, principal, fleet_trials.hand_back, trial_id, body)
