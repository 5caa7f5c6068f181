"""Prometheus metrics at ``GET /metrics``.

Facts that live in the database (trials by state and outcome, workers and their free memory,
leases) are read at scrape time, so that every replica of the service reports the same numbers.
What only one process sees (request latencies, reaper actions, its own CPU and memory) is
counted in-process, in ``REGISTRY``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any, cast

from fastapi import APIRouter, FastAPI, Request, Response
from optuna.storages._rdb import models as optuna_models
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vramtune.common.logs import log_outage
from vramtune.service.db.tables import LeaseRow, StudyRow, TrialRow, WorkerRow
from vramtune.service.state import AppState

__all__ = ["REGISTRY", "install_metrics", "phase", "record_reaper_action"]

log = logging.getLogger("vramtune.metrics")

METRICS_PATH = "/metrics"
UNMATCHED = "unmatched"

REGISTRY = CollectorRegistry(auto_describe=True)
ProcessCollector(registry=REGISTRY)

REQUEST_SECONDS = Histogram(
    "vramtune_http_request_duration_seconds",
    "Time to answer a request, by method, route template and status.",
    ["method", "route", "status"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
    registry=REGISTRY,
)
REAPER_ACTIONS = Counter(
    "vramtune_reaper_actions",
    "Leases the reaper ended, by what became of their trial (reoffered, failed, ...).",
    ["action"],
    registry=REGISTRY,
)
# Where a worker call's time goes, inside the route: waiting for a pooled connection, holding
# a transaction, drafting with the sampler. Next to the request histogram it tells an operator
# whether slow calls queue for the server (threads, CPU), the pool, a lock, or the sampler.
PHASE_SECONDS = Histogram(
    "vramtune_call_phase_seconds",
    "Time spent in one phase of a worker call (connect: waiting for a pooled connection).",
    ["call", "phase"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10),
    registry=REGISTRY,
)
SCRAPE_ERRORS = Counter(
    "vramtune_metrics_scrape_errors",
    "Scrapes whose database-backed metrics could not be read.",
    registry=REGISTRY,
)


@contextmanager
def phase(call: str, name: str) -> Iterator[None]:
    """Observe the time the block takes as one phase of a call (PHASE_SECONDS)."""
    began = time.perf_counter()
    try:
        yield
    finally:
        PHASE_SECONDS.labels(call=call, phase=name).observe(time.perf_counter() - began)


def record_reaper_action(action: str, count: int = 1) -> None:
    """Count what the reaper did, e.g. ``record_reaper_action("reoffered", 3)``."""
    if count:
        REAPER_ACTIONS.labels(action=action).inc(count)


# ---------------------------------------------------------------- latency middleware


class RequestTimer:
    """ASGI middleware: observe each HTTP request's duration, labelled by its route template.

    The template (``/api/v1/trials/{trial_id}/complete``) is what routing put in the scope, so
    the label set stays bounded whatever ids clients send.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] == METRICS_PATH:
            await self.app(scope, receive, send)
            return
        status = 500  # what the client gets if the app raises before answering

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        began = time.perf_counter()
        try:
            await self.app(scope, receive, send_and_note)
        finally:
            REQUEST_SECONDS.labels(
                method=scope["method"], route=_route_template(scope), status=str(status)
            ).observe(time.perf_counter() - began)


def _route_template(scope: Scope) -> str:
    """The full path template of the matched route (routers' prefixes included), or unmatched."""
    route = scope.get("route")
    if route is None:
        return UNMATCHED
    app = scope["app"]
    templates: dict[int, str] | None = getattr(app.state, "metrics_templates", None)
    if templates is None:
        templates = app.state.metrics_templates = _full_templates(app)
    return templates.get(id(route)) or getattr(route, "path", None) or UNMATCHED


def _full_templates(app: Any) -> dict[int, str]:
    """id of each route object -> its full path template."""
    try:  # FastAPI >= 0.13x keeps included routers whole: walk into them for full paths
        from fastapi.routing import iter_route_contexts
    except ImportError:  # older FastAPI copies included routes, prefixed, into app.routes
        return {id(route): route.path for route in app.routes if hasattr(route, "path")}
    templates: dict[int, str] = {}
    for context in iter_route_contexts(app.routes):
        if context.path:
            templates.setdefault(id(context.original_route), context.path)
    return templates


# ---------------------------------------------------------------- database-backed gauges


def _gauge(name: str, doc: str, labels: list[str], rows: Iterable[tuple[Any, ...]]) -> Metric:
    """A gauge family from rows of (*label values, value)."""
    family = GaugeMetricFamily(name, doc, labels=labels)
    for *values, value in rows:
        family.add_metric([str(v) for v in values], float(value or 0))
    return family


def _trial_states(session: Session) -> Metric:
    trial = optuna_models.TrialModel
    rows = session.execute(
        select(StudyRow.name, trial.state, func.count())
        .join(trial, trial.study_id == StudyRow.study_id)
        .group_by(StudyRow.name, trial.state)
    ).all()
    return _gauge(
        "vramtune_trials",
        "Optuna trials of vramtune studies, by study and TrialState.",
        ["study", "state"],
        ((study, getattr(state, "name", state), n) for study, state, n in rows),
    )


def _trial_outcomes(session: Session) -> Metric:
    rows = session.execute(
        select(StudyRow.name, TrialRow.outcome, func.count())
        .join(StudyRow, StudyRow.study_id == TrialRow.study_id)
        .where(TrialRow.outcome.is_not(None))
        .group_by(StudyRow.name, TrialRow.outcome)
    ).all()
    return _gauge(
        "vramtune_trial_outcomes",
        "Finished trials by how they ran: as_asked, resized, routed, infeasible, oom, ...",
        ["study", "outcome"],
        rows,
    )


def _trial_queue(session: Session) -> Metric:
    rows = session.execute(select(TrialRow.status, func.count()).group_by(TrialRow.status)).all()
    return _gauge(
        "vramtune_trial_status",
        "vramtune's bookkeeping of trials: leased, pending (to re-offer), waiting (a larger "
        "card), done.",
        ["status"],
        rows,
    )


def _workers(session: Session, stale_s: float, now: datetime) -> list[Metric]:
    fresh_since = now - timedelta(seconds=stale_s)
    rows = session.execute(
        select(
            WorkerRow.id,
            WorkerRow.name,
            WorkerRow.card_model,
            WorkerRow.free_bytes,
            WorkerRow.total_bytes,
            WorkerRow.last_heartbeat,
            WorkerRow.stopped,
        )
    ).all()
    live = [r for r in rows if not r.stopped and r.last_heartbeat >= fresh_since]
    counts = {
        "live": len(live),
        "stale": sum(1 for r in rows if not r.stopped and r.last_heartbeat < fresh_since),
        "stopped": sum(1 for r in rows if r.stopped),
    }
    labels = ["worker_id", "worker", "card_model"]
    return [
        _gauge("vramtune_workers", "Registered workers by state.", ["state"], counts.items()),
        _gauge(
            "vramtune_worker_free_bytes",
            "Free card memory each live worker last reported.",
            labels,
            ((r.id, r.name, r.card_model, r.free_bytes) for r in live),
        ),
        _gauge(
            "vramtune_worker_total_bytes",
            "Total card memory of each live worker.",
            labels,
            ((r.id, r.name, r.card_model, r.total_bytes) for r in live),
        ),
    ]


def _leases(session: Session, now: datetime) -> Metric:
    total, expired = session.execute(
        select(func.count(), func.count().filter(LeaseRow.expires_at < now)).where(
            LeaseRow.active.is_(True)
        )
    ).one()
    return _gauge(
        "vramtune_leases_active",
        "Active leases; 'expired' ones await the reaper.",
        ["expiry"],
        [("live", total - expired), ("expired", expired)],
    )


class DatabaseCollector(Collector):
    """Gauges read from the database at scrape time, and whether it could be read."""

    def __init__(self, state: AppState) -> None:
        self.state = state

    def collect(self) -> Iterable[Metric]:
        """One read-only transaction for every database-backed gauge."""
        now = self.state.clock()
        try:
            with self.state.sessions() as session:
                families = [
                    _trial_states(session),
                    _trial_outcomes(session),
                    _trial_queue(session),
                    *_workers(session, self.state.settings.worker_stale_s, now),
                    _leases(session, now),
                ]
        except SQLAlchemyError as exc:
            SCRAPE_ERRORS.inc()
            log_outage(log, "metrics scrape", exc)
            families = []
        up = GaugeMetricFamily("vramtune_database_up", "Whether the last scrape read the DB.")
        up.add_metric([], 1.0 if families else 0.0)
        return [*families, up]


def exposition(state: AppState) -> bytes:
    """The whole scrape: in-process metrics, then the database-backed ones."""
    per_scrape = CollectorRegistry(auto_describe=False)
    per_scrape.register(DatabaseCollector(state))
    return generate_latest(REGISTRY) + generate_latest(per_scrape)


router = APIRouter(tags=["metrics"])


@router.get(METRICS_PATH, include_in_schema=False)
async def metrics(request: Request) -> Response:
    """Prometheus text exposition; still answers (database_up 0) when the database is down."""
    state = cast(AppState, request.app.state.vt)
    body = await run_in_threadpool(exposition, state)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


def install_metrics(app: FastAPI) -> None:
    """Add ``GET /metrics`` and the latency middleware to the app."""
    app.include_router(router)
    app.add_middleware(RequestTimer)
