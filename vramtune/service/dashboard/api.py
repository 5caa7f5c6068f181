"""The dashboard's JSON endpoints: everything the pages show, aggregated on the server."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Path, Query
from optuna.trial import TrialState

from vramtune.service.api.deps import NowDep, ReadSessionDep, SettingsDep, path_id
from vramtune.service.auth.tokens import PrincipalDep
from vramtune.service.dashboard import (
    advice as advice_view,
    fleet as fleet_view,
    importance,
    plots,
    studies_view,
    trial_table,
)
from vramtune.service.dashboard.models import (
    Advice,
    Calibration,
    Fleet,
    History,
    Importances,
    MemoryScatter,
    ParetoScatter,
    Regions,
    StudyListOut,
    StudyOverview,
    TrialDetail,
    TrialTable,
)
from vramtune.service.dashboard.series import MAX_POINTS
from vramtune.service.db.tables import StudyRow
from vramtune.service.wire import API_PREFIX

PREFIX = f"{API_PREFIX}/dashboard"
router = APIRouter(prefix=PREFIX, tags=["dashboard"])

# PostgreSQL text cannot hold NUL: refused as bad input (422), never a database error (500).
NO_NUL = r"^[^\x00]*$"
# {name:path}: a plain Optuna study's name may hold "/" (vramtune's own names cannot).
StudyName = Annotated[
    str, Path(min_length=1, max_length=512, pattern=NO_NUL, description="The study's name.")
]
Objective = Annotated[int, Query(ge=0, le=15, description="Which objective (0: the first).")]
MaxPoints = Annotated[
    int, Query(ge=10, le=10_000, description="Most points returned; more are thinned.")
]
OptionalParamName = Annotated[
    str | None,
    Query(min_length=1, max_length=512, pattern=NO_NUL, description="A parameter name."),
]
StateName = Literal["RUNNING", "COMPLETE", "PRUNED", "FAIL", "WAITING"]


@router.get("/studies")
def list_studies(session: ReadSessionDep, now: NowDep) -> StudyListOut:
    """Every study with state counts, best value, trials per hour and running trials."""
    return studies_view.list_studies(session, now)


@router.get("/studies/{name:path}/history")
def history(
    name: StudyName,
    session: ReadSessionDep,
    objective: Objective = 0,
    max_points: MaxPoints = MAX_POINTS,
) -> History:
    """Optimization history: completed values by trial number and the best so far."""
    return plots.history(session, name, objective, max_points)


@router.get("/studies/{name:path}/memory")
def memory(
    name: StudyName,
    session: ReadSessionDep,
    objective: Objective = 0,
    max_points: MaxPoints = MAX_POINTS,
) -> MemoryScatter:
    """Objective against measured peak memory, with the Pareto front."""
    return plots.memory(session, name, objective, max_points)


@router.get("/studies/{name:path}/pareto")
def pareto(
    name: StudyName,
    session: ReadSessionDep,
    x: Objective = 0,
    y: Objective = 1,
    max_points: MaxPoints = MAX_POINTS,
) -> ParetoScatter:
    """Two objectives of a multi-objective study against each other, with their Pareto front."""
    return plots.pareto(session, name, x, y, max_points)


@router.get("/studies/{name:path}/calibration")
def calibration(
    name: StudyName, session: ReadSessionDep, max_points: MaxPoints = MAX_POINTS
) -> Calibration:
    """Predicted against measured peak memory of every run, per card model."""
    return plots.calibration(session, name, max_points)


@router.get("/studies/{name:path}/regions")
def regions(
    name: StudyName,
    session: ReadSessionDep,
    x: OptionalParamName = None,
    y: OptionalParamName = None,
    max_points: MaxPoints = MAX_POINTS,
) -> Regions:
    """Where in the plane of two parameters trials ran as asked, resized, OOMed or did not fit.

    Without x or y the study's likeliest memory parameters (batch, width...) are used.
    """
    return plots.regions(session, name, x, y, max_points)


@router.get("/studies/{name:path}/importances")
def importances(
    name: StudyName, session: ReadSessionDep, now: NowDep, objective: Objective = 0
) -> Importances:
    """Optuna's parameter importances over a bounded sample of completed trials (cached)."""
    return importance.importances(session, name, objective, now)


@router.get("/studies/{name:path}/advice")
def advice(name: StudyName, session: ReadSessionDep, settings: SettingsDep, now: NowDep) -> Advice:
    """What to do next: infeasible configurations and what would make them fit, a biased
    calibration and its likely cause, a task no live worker offers, OOMs prediction missed."""
    return advice_view.advice(session, name, settings, now)


@router.get("/studies/{name:path}/trials")
def trials(
    name: StudyName,
    session: ReadSessionDep,
    settings: SettingsDep,
    now: NowDep,
    sort: Annotated[
        str,
        Query(
            min_length=1,
            max_length=520,
            pattern=NO_NUL,
            description="A column, value:<i> or param:<name>.",
        ),
    ] = "number",
    order: Literal["asc", "desc"] = "asc",
    state: Annotated[list[StateName] | None, Query(max_length=5)] = None,
    outcome: Annotated[
        list[Annotated[str, Query(max_length=32, pattern=NO_NUL)]] | None,
        Query(max_length=16, description="vramtune outcomes; 'none' for trials without one."),
    ] = None,
    worker: Annotated[
        str | None, Query(max_length=128, pattern=NO_NUL, description="A worker's name.")
    ] = None,
    offset: Annotated[int, Query(ge=0, le=10**9)] = 0,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> TrialTable:
    """A sorted, filtered page of the trial table."""
    query = trial_table.TableQuery(
        sort=sort,
        order=order,
        states=[TrialState[s] for s in state or []],
        outcomes=outcome or [],
        worker=worker,
        offset=offset,
        limit=limit,
    )

    def waiting_note(row: StudyRow | None) -> str | None:
        return advice_view.no_worker_note(session, row, settings, now)

    return trial_table.trial_table(session, name, query, waiting_note)


@router.get("/studies/{name:path}/trials/{number}")
def trial(
    name: StudyName,
    number: Annotated[int, path_id("The trial number.", low=0)],
    session: ReadSessionDep,
    max_points: MaxPoints = MAX_POINTS,
) -> TrialDetail:
    """One trial in full, with its intermediate values."""
    return trial_table.trial_detail(session, name, number, max_points)


@router.get("/fleet")
def fleet(
    session: ReadSessionDep,
    settings: SettingsDep,
    now: NowDep,
    principal: PrincipalDep,
    offset: Annotated[int, Query(ge=0, le=2**31 - 1, description="Workers to skip.")] = 0,
    limit: Annotated[
        int,
        Query(
            ge=1, le=fleet_view.MAX_PAGE_SIZE, description="Most workers in the page (1 to 500)."
        ),
    ] = fleet_view.PAGE_SIZE,
) -> Fleet:
    """A page of workers, live first: card, memory, current trials, last heartbeat, stale or
    lost (a token limited to some studies: the workers running their trials only)."""
    return fleet_view.fleet(session, settings, now, principal.studies, (offset, limit))


# Last: {name:path} also matches the suffixed paths above, which must win.
@router.get("/studies/{name:path}")
def study_overview(name: StudyName, session: ReadSessionDep, now: NowDep) -> StudyOverview:
    """One study's header: counts, best trial, parameters, card models and a revision token."""
    return studies_view.overview(session, name, now)
