"""Study routes: create, list, get, trials, best, pause, resume, delete."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Response
from optuna.trial import TrialState
from sqlalchemy.orm import Session

from vramtune.service import studies
from vramtune.service.api.deps import NowDep, SessionDep, SettingsDep, StorageDep
from vramtune.service.auth.tokens import PrincipalDep
from vramtune.service.fleet.offers import live_tasks, task_warnings
from vramtune.service.settings import Settings
from vramtune.service.wire import ParetoFront, StudyCreate, StudyList, StudySummary, TrialPage

router = APIRouter(prefix="/studies", tags=["studies"])

StateName = Literal["RUNNING", "COMPLETE", "PRUNED", "FAIL", "WAITING"]


@router.post("", status_code=201)
def create_study(
    spec: StudyCreate,
    session: SessionDep,
    storage: StorageDep,
    settings: SettingsDep,
    now: NowDep,
) -> StudySummary:
    """Create a study: an Optuna study plus vramtune's record of its spec."""
    row = studies.create_study(session, storage, spec, now, settings.max_search_space_points)
    return _with_warnings(studies.summarize(storage, row), session, settings, now)


@router.get("")
def list_studies(
    session: SessionDep, storage: StorageDep, settings: SettingsDep, now: NowDep
) -> StudyList:
    """Every study with its counts per trial state (and warnings, as `GET /studies/NAME`)."""
    offered = live_tasks(session, now, settings.worker_stale_s)
    summaries = studies.list_summaries(session, storage)
    return StudyList(studies=[_warned(summary, offered) for summary in summaries])


@router.get("/{name}")
def get_study(
    name: str, session: SessionDep, storage: StorageDep, settings: SettingsDep, now: NowDep
) -> StudySummary:
    """One study, with a warning when no live worker offers its task."""
    return _with_warnings(studies.get_summary(session, storage, name), session, settings, now)


def _with_warnings(
    summary: StudySummary, session: Session, settings: Settings, now: datetime
) -> StudySummary:
    return _warned(summary, live_tasks(session, now, settings.worker_stale_s))


def _warned(summary: StudySummary, offered: set[str]) -> StudySummary:
    return summary.model_copy(update={"warnings": task_warnings(summary.task, offered)})


@router.get("/{name}/trials")
def list_trials(
    name: str,
    session: SessionDep,
    storage: StorageDep,
    state: Annotated[list[StateName] | None, Query(description="Keep these states only.")] = None,
    offset: Annotated[int, Query(ge=0)] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> TrialPage:
    """A page of the study's trials in number order."""
    states = [TrialState[s] for s in state] if state else None
    return studies.trial_page(session, storage, name, states, offset, limit)


@router.get("/{name}/best")
def best(name: str, session: SessionDep, storage: StorageDep) -> ParetoFront:
    """The best trial, or the Pareto front of a multi-objective study (empty before any)."""
    return studies.best(session, storage, name)


@router.post("/{name}/pause")
def pause(
    name: str,
    session: SessionDep,
    storage: StorageDep,
    settings: SettingsDep,
    principal: PrincipalDep,
    now: NowDep,
) -> StudySummary:
    """Pause: no new trials are handed out, and workers are told to stop running ones."""
    row = studies.set_paused(session, name, True, now, principal)
    return _with_warnings(studies.summarize(storage, row), session, settings, now)


@router.post("/{name}/resume")
def resume(
    name: str,
    session: SessionDep,
    storage: StorageDep,
    settings: SettingsDep,
    principal: PrincipalDep,
    now: NowDep,
) -> StudySummary:
    """Hand out trials again."""
    row = studies.set_paused(session, name, False, now, principal)
    return _with_warnings(studies.summarize(storage, row), session, settings, now)


@router.delete("/{name}", status_code=204)
def delete_study(
    name: str, session: SessionDep, storage: StorageDep, principal: PrincipalDep, now: NowDep
) -> Response:
    """Delete the study, its trials and vramtune's records of them."""
    studies.delete_study(session, storage, name, now, principal)
    return Response(status_code=204)
