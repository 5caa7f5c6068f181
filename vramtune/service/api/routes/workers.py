"""Worker protocol routes (workers): register, heartbeat, next trial, stop, the fleet."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response
from sqlalchemy import select
from sqlalchemy.orm import Session

from vramtune.service.api.deps import StateDep, path_id, query_id
from vramtune.service.auth.tokens import PrincipalDep
from vramtune.service.db.tables import StudyRow
from vramtune.service.errors import Forbidden, Invalid, NotFound
from vramtune.service.fleet import dispatch, trust, workers as fleet
from vramtune.service.fleet.calibration import calibration_for, step_time_for
from vramtune.service.principal import Principal
from vramtune.service.wire import (
    Assignment,
    Calibration,
    Heartbeat,
    HeartbeatReply,
    NextRequest,
    StepTimeFit,
    WorkerList,
    WorkerRegister,
    WorkerRegistered,
)

router = APIRouter(tags=["workers"])

DEFAULT_WORKERS_PAGE, MAX_WORKERS_PAGE = 100, 1000
# Beyond any fleet; bounded so that an absurd offset is a 422, never a database error.
MAX_OFFSET = 2**31 - 1

WorkerId = Annotated[int, path_id("The id registration gave.")]
Text = Annotated[str, Query(min_length=1, max_length=256)]
AskingWorker = Annotated[
    int | None,
    query_id("The asking worker's id: its own runs count for it before the fleet's quorum."),
]
ForStudy = Annotated[
    str | None,
    Query(
        min_length=1,
        max_length=128,
        description="The study whose trial the fit is for: its own runs count beside the "
        "fleet's (a study-limited token's knowledge counts for its study only). None: the "
        "fleet's only.",
    ),
]


@router.post("/workers", status_code=201)
def register(body: WorkerRegister, state: StateDep, principal: PrincipalDep) -> WorkerRegistered:
    """Register a worker and its card; the answer has its id and the heartbeat period.

    The worker is bound to the calling token: its calls must come with that token (403).
    """
    with fleet.fleet_transaction(state) as session:
        return fleet.register(session, state.settings, body, state.clock(), principal.token_id)


@router.post("/workers/{worker_id}/heartbeat")
async def heartbeat(
    worker_id: WorkerId, body: Heartbeat, state: StateDep, principal: PrincipalDep
) -> HeartbeatReply:
    """Renew the leases of the trials the worker runs; the answer lists those it must stop."""
    assert state.heartbeats is not None  # built with the state
    return await state.heartbeats.beat(worker_id, body, principal.token_id)


@router.post(
    "/workers/{worker_id}/next",
    responses={200: {"model": Assignment}, 204: {"description": "No work for this worker now."}},
    response_model=None,
)
def next_trial(
    worker_id: WorkerId, body: NextRequest, state: StateDep, principal: PrincipalDep
) -> Assignment | Response:
    """Lease a trial to the worker (200), or 204 when no study of its tasks has work."""
    assignment = dispatch.next_assignment(
        state, worker_id, body, state.clock(), principal.studies, principal.token_id
    )
    return Response(status_code=204) if assignment is None else assignment


@router.post("/workers/{worker_id}/stop", status_code=204)
def stop(worker_id: WorkerId, state: StateDep, principal: PrincipalDep) -> Response:
    """The worker leaves: its leases end now and their trials are offered again."""
    with fleet.fleet_transaction(state) as session:
        fleet.stop_worker(session, worker_id, state.clock(), principal.token_id)
    return Response(status_code=204)


@router.get("/workers")
def list_workers(
    state: StateDep,
    principal: PrincipalDep,
    only: Annotated[
        list[fleet.WorkerState] | None,
        Query(alias="state", description="Keep workers in these states only."),
    ] = None,
    offset: Annotated[int, Query(ge=0, le=MAX_OFFSET, description="Workers to skip.")] = 0,
    limit: Annotated[
        int, Query(ge=1, le=MAX_WORKERS_PAGE, description="Most workers in the page (1 to 1000).")
    ] = DEFAULT_WORKERS_PAGE,
) -> WorkerList:
    """A page of the fleet, live workers first: cards, live / stale / stopped, trials held.

    ``total`` counts every worker the query matches; ask again with ``offset`` for the next
    page. A token limited to some studies sees only the workers running their trials.
    """
    page = fleet.WorkerPage(tuple(only or ()), offset, limit)
    with state.sessions() as session:
        return fleet.list_workers(session, state.settings, state.clock(), principal.studies, page)


@router.get("/calibration")
def calibration(
    card_model: Text,
    torch_version: Text,
    task: Text,
    state: StateDep,
    principal: PrincipalDep,
    worker_id: AskingWorker = None,
    study: ForStudy = None,
) -> Calibration:
    """The correction of predictions for a card model, torch version and task.

    Fitted from the fleet's observations, and with `study` that study's own ones; with
    `worker_id` (a worker the calling token registered), that worker's own runs always count.
    """
    with state.sessions() as session:
        scopes = _fit_scopes(session, principal, card_model, task, worker_id, study)
        return calibration_for(session, card_model, torch_version, task, scopes, worker_id)


@router.get("/step-time")
def step_time(
    card_model: Text,
    task: Text,
    state: StateDep,
    principal: PrincipalDep,
    worker_id: AskingWorker = None,
    study: ForStudy = None,
) -> StepTimeFit:
    """The step-time model for a card model and task, fitted from the fleet's measured runs
    (and with `study`, that study's own ones).

    The fleet's runs count once two workers reported them, each worker's weighing alike,
    runs more than 2x off the fit dropped; with `worker_id` (a worker the calling token
    registered), that worker's own runs always count.
    """
    with state.sessions() as session:
        scopes = _fit_scopes(session, principal, card_model, task, worker_id, study)
        return step_time_for(session, card_model, task, scopes, worker_id)


def _fit_scopes(
    session: Session,
    principal: Principal,
    card_model: str,
    task: str,
    worker_id: int | None,
    study: str | None,
) -> list[str]:
    """The scopes of knowledge the caller reads (vramtune.service.fleet.trust): the fleet's,
    and the named study's own. 403 for a study-limited token asking about a task or card
    outside its studies, a study not its own, or a worker it did not register (404 for one
    that does not exist).

    One study's, never the union of the caller's: a token of studies A and C was served C's
    runs for A's trials (issue 47)."""
    denial = trust.fit_denial(session, principal.studies, principal.token_id, card_model, task)
    if denial is not None:
        raise Forbidden(denial)
    if worker_id is not None:
        fleet.get_worker(session, worker_id, principal.token_id)
    if study is None:
        return [trust.FLEET]
    if not principal.allows_study(study):
        raise Forbidden(f"study: this token is limited to other studies than {study!r}")
    row = session.scalar(select(StudyRow).where(StudyRow.name == study))
    if row is None:
        raise NotFound(f"study {study!r} not found")
    if row.task != task:
        raise Invalid("task", f"study {study!r} runs the task {row.task!r}, not {task!r}")
    return trust.visible_to_trial(row)
