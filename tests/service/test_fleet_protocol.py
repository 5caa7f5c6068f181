"""The worker protocol against a real server, on SQLite and PostgreSQL, with simulated workers.

Workers here are plain HTTP clients (``SimWorker``), so every call and every answer is under
the test's control. One server per database backend serves the whole module; each test gets
its own study and task name, and workers advertise only that task, so tests cannot see each
other's trials. Lease expiry is driven by ``reap_once(state, now)`` with a ``now`` in the
future, from the test process on the server's database: no test waits for a clock, except the
one that checks the server's own reaper loop.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import httpx
import optuna
import pytest
from optuna.trial import FrozenTrial, TrialState
from sqlalchemy import func, select

from vramtune.common.plans import plan_key
from vramtune.service.app import build_state
from vramtune.service.db.tables import (
    MAX_ROW_ID,
    LeaseRow,
    MemoryObservationRow,
    StudyRow,
    TrialEventRow,
    TrialRow,
    WorkerRow,
)
from vramtune.service.fleet import dispatch, predictions, reaper
from vramtune.service.fleet.dispatch import next_assignment
from vramtune.service.fleet.reaper import reap_once
from vramtune.service.optuna.drafts import draft_trials
from vramtune.service.optuna.glue import dispose_storage
from vramtune.service.settings import Settings
from vramtune.service.state import AppState, utcnow
from vramtune.service.testing import (
    ServerFactory,
    fresh_postgres_database,
    server_factory,
    sqlite_url,
    upgrade_database,
)
from vramtune.service.wire import Assignment, NextRequest, Plan, PlanOut

GIB = 2**30
PLAN = {"micro_batch": None, "accumulation": 1, "checkpointing": False, "bf16": False}
HALVED = {"micro_batch": 8, "accumulation": 2, "checkpointing": False, "bf16": False}
# What the server fills in for a plan sent without the later rungs' fields (older workers).
NO_NEW_RUNGS = {"checkpoint_blocks": None, "chunked_loss": False}
TTL_S = 30.0  # the shared server's lease TTL: only reap_once(now + LATER) expires leases
LATER = timedelta(seconds=TTL_S + 5)
_JSON = {"Content-Type": "application/json"}
_names = itertools.count()


class SimWorker:
    """A worker as the server sees it: registration, heartbeats and trial calls over HTTP."""

    def __init__(
        self,
        http: httpx.Client,
        name: str,
        task: str,
        total_bytes: int = 8 * GIB,
        model: str = "Sim 8G",
        cards: int = 1,
        rungs: list[str] | None = None,
    ) -> None:
        self.http = http
        self.total_bytes = total_bytes
        card = {"model": model, "total_bytes": total_bytes, "free_bytes": total_bytes}
        body: dict[str, Any] = {"name": name, "device": "cpu", "card": card, "tasks": [task]}
        if cards > 1:  # a node worker: one card per rank
            body["cards"] = [card] * cards
        if rungs is not None:  # the rungs its task can take on its card (None: an older worker)
            body["rungs"] = {task: rungs}
        response = http.post("/workers", json=body)
        assert response.status_code == 201, response.text
        self.id: int = response.json()["worker_id"]
        self.started: set[str] = set()  # the leases this worker has sent `start` under

    def next(self) -> dict[str, Any] | None:
        """An assignment, or None on 204."""
        response = self.http.post(f"/workers/{self.id}/next", json={"free_bytes": self.total_bytes})
        assert response.status_code in (200, 204), response.text
        return None if response.status_code == 204 else response.json()

    def heartbeat(self) -> list[dict[str, Any]]:
        """The stop orders of one heartbeat."""
        response = self.http.post(f"/workers/{self.id}/heartbeat", json={})
        assert response.status_code == 200, response.text
        return list(response.json()["stop"])

    def call(
        self, assignment: dict[str, Any], verb: str, start: bool = True, **body: Any
    ) -> httpx.Response:
        """A trial call under the assignment's lease. A result of running the trial is
        preceded, as a real worker's is, by a `start` the first time (``start=False``: not)."""
        lease = assignment["lease"]
        if start and lease not in self.started and _ran(verb, body):
            self.call(assignment, "start", plan=body.get("plan") or PLAN)
        url = f"/trials/{assignment['trial_id']}/{verb}"
        response = self.http.post(url, json={"lease": lease, **body})
        if verb == "start" and response.status_code == 200:
            self.started.add(lease)
        return response

    def complete(
        self, assignment: dict[str, Any], *values: float, peak: int = GIB, start: bool = True
    ) -> httpx.Response:
        """Complete with values and a measured peak (after a start, as `call`)."""
        return self.call(
            assignment,
            "complete",
            start,
            values=list(values),
            plan=PLAN,
            prediction=_prediction(peak),
            measured={"peak_allocated_bytes": peak, "peak_reserved_bytes": peak},
            duration_s=1.5,
        )

    def out(self) -> dict[str, Any]:
        """This worker as GET /workers lists it."""
        workers = self.http.get("/workers", params={"limit": 1000}).json()["workers"]
        return next(w for w in workers if w["id"] == self.id)


def _ran(verb: str, body: dict[str, Any]) -> bool:
    """Whether a call reports a run, which the server takes only under a started lease."""
    if verb == "fail":
        return body["kind"] in ("oom", "pruned") or body.get("measured") is not None
    return verb in ("complete", "report")


def _prediction(peak: int) -> dict[str, Any]:
    return {"peak_allocated_bytes": peak, "peak_reserved_bytes": peak}


@dataclass
class Env:
    """One test's view of the shared server: its own study and task names."""

    http: httpx.Client
    state: AppState
    study: str
    task: str

    def worker(
        self,
        name: str,
        total_bytes: int = 8 * GIB,
        model: str = "Sim 8G",
        cards: int = 1,
        rungs: list[str] | None = None,
    ) -> SimWorker:
        """A worker that runs this test's task only (a node of `cards` cards when above 1;
        `rungs`: those it registers for the task)."""
        return SimWorker(self.http, name, self.task, total_bytes, model, cards, rungs)

    def create_study(self, **extra: Any) -> None:
        """This test's study: a quadratic on one float, random sampler, no pruner."""
        body = {
            "name": self.study,
            "task": self.task,
            "search_space": {"x": {"type": "float", "low": -3.0, "high": 3.0}},
            "sampler": {"name": "random", "args": {"seed": 7}},
            "pruner": {"name": "none"},
            "n_trials": 1,
            **extra,
        }
        response = self.http.post("/studies", json=body)
        assert response.status_code == 201, response.text

    def trials(self) -> list[FrozenTrial]:
        """The study's trials as Optuna itself loads them."""
        return self.optuna_study().get_trials()

    def optuna_study(self) -> optuna.Study:
        """The study as plain Optuna loads it (on the test process's one storage)."""
        return optuna.load_study(study_name=self.study, storage=self.state.storage)

    def page(self) -> dict[int, dict[str, Any]]:
        """The study's trials as GET /studies/{name}/trials shows them, by trial id."""
        trials = self.http.get(f"/studies/{self.study}/trials").json()["trials"]
        return {t["id"]: t for t in trials}

    def observations(self) -> int:
        """Memory observations stored for this study's trials."""
        ids = [t._trial_id for t in self.trials()]
        query = select(func.count()).select_from(MemoryObservationRow)
        with self.state.sessions() as session:
            return int(session.scalar(query.where(MemoryObservationRow.trial_id.in_(ids))) or 0)


@contextlib.contextmanager
def client_side_state(url: str) -> Iterator[AppState]:
    """The server's database as the test process sees it; its connections given back after."""
    state = build_state(Settings(database_url=url, lease_ttl_s=TTL_S))
    try:
        yield state
    finally:
        dispose_storage(state.storage)
        state.engine.dispose()


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def shared_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """One migrated database per backend for the whole module."""
    if request.param == "sqlite":
        yield upgrade_database(sqlite_url(tmp_path_factory.mktemp("fleet-db")))
        return
    with fresh_postgres_database() as url:
        yield upgrade_database(url)


@pytest.fixture(scope="module")
def shared_server(shared_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One server on it, with long leases and a reaper that never runs on its own in time."""
    with server_factory(tmp_path_factory.mktemp("fleet-logs")) as start:
        yield start(shared_url, lease_ttl_s=TTL_S, reaper_interval_s=3600).url


@pytest.fixture(scope="module")
def shared_state(shared_url: str) -> Iterator[AppState]:
    """The server's database as the test process sees it, for reap_once and direct reads."""
    with client_side_state(shared_url) as state:
        yield state


@pytest.fixture
def env(shared_server: str, shared_state: AppState) -> Iterator[Env]:
    """This test's study and task names on the shared server."""
    n = next(_names)
    with httpx.Client(base_url=f"{shared_server}/api/v1", timeout=60) as http:
        yield Env(http, shared_state, f"study-{n}", f"task-{n}")


# ---------------------------------------------------------------- the happy path


def test_protocol_runs_a_study_to_its_budget(env: Env) -> None:
    env.create_study(n_trials=3)
    worker = env.worker("w1")
    seen = []
    while (assignment := worker.next()) is not None:
        assert assignment["n_objectives"] == 1 and assignment["attempt"] == 0
        assert assignment["study"] == env.study and assignment["task"] == env.task
        started = worker.call(assignment, "start", plan=PLAN, prediction=_prediction(GIB))
        assert started.json()["resolution"] == "started"
        reply = worker.call(assignment, "report", step=1, value=9.0)
        assert reply.json() == {"prune": False}
        assert worker.heartbeat() == []
        x = assignment["params"]["x"]
        done = worker.complete(assignment, x * x)
        assert done.status_code == 200 and done.json()["resolution"] == "complete"
        assert set(done.json()) == {"trial_id", "resolution", "detail"}  # a TrialAck, as ever
        seen.append((assignment["number"], x))
    assert [number for number, _ in seen] == [0, 1, 2]
    trials = env.trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 3
    assert [t.value for t in trials] == [x * x for _, x in seen]
    assert [t.params["x"] for t in trials] == [x for _, x in seen]
    assert trials[0].user_attrs["vramtune.plan"] == {**PLAN, **NO_NEW_RUNGS, "reason": ""}
    assert trials[0].user_attrs["vramtune.measured_peak_bytes"] == GIB
    assert trials[0].intermediate_values == {1: 9.0}
    listed = worker.out()
    assert (listed["state"], listed["trials_done"], listed["current_trials"]) == ("live", 3, [])
    assert {t["outcome"] for t in env.page().values()} == {"as_asked"}
    assert env.observations() == 3


def test_a_grid_study_runs_its_whole_grid(env: Env) -> None:
    # Telling the last point makes Optuna's GridSampler call study.stop(): never a 500.
    grid = {"x": {"type": "categorical", "choices": [-1.0, 0.5, 2.0]}}
    env.create_study(n_trials=3, sampler={"name": "grid"}, search_space=grid)
    worker = env.worker("w1")
    while (assignment := worker.next()) is not None:
        worker.call(assignment, "start", plan=PLAN, prediction=_prediction(GIB))
        x = assignment["params"]["x"]
        done = worker.complete(assignment, x * x)
        assert done.status_code == 200, done.text
    trials = env.trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 3
    assert sorted(t.params["x"] for t in trials) == [-1.0, 0.5, 2.0]


def test_complete_twice_is_one_tell_and_the_same_answer(env: Env) -> None:
    env.create_study(n_trials=2)
    worker = env.worker("w1")
    first, second = worker.next(), worker.next()
    assert first is not None and second is not None
    assert worker.out()["current_trials"] == [first["trial_id"], second["trial_id"]]
    answers = [worker.complete(first, 1.25) for _ in range(2)]
    assert [a.status_code for a in answers] == [200, 200]
    assert answers[0].json() == answers[1].json()
    told = env.trials()[0]
    assert told.state == TrialState.COMPLETE and told.value == 1.25
    assert env.observations() == 1
    assert worker.out()["trials_done"] == 1
    # the same lease for another call, or another trial's lease: refused, nothing changes
    assert worker.call(first, "fail", kind="error", message="late").status_code == 409
    assert worker.call(first, "report", step=2, value=1.0).status_code == 409
    foreign = {**second, "trial_id": first["trial_id"]}
    assert worker.complete(foreign, 3.0).status_code == 409
    assert env.trials()[0].value == 1.25
    assert worker.complete(second, 0.5).status_code == 200


_MEASURED = {"peak_allocated_bytes": GIB, "peak_reserved_bytes": GIB}
# The results of running a trial, each refused under a lease that never started.
_RESULTS_OF_A_RUN: dict[str, tuple[str, dict[str, Any]]] = {
    "complete": (
        "complete",
        {"values": [1.0], "plan": PLAN, "measured": _MEASURED, "duration_s": 1},
    ),
    "report": ("report", {"step": 1, "value": 5.0}),
    "oom": ("fail", {"kind": "oom", "message": "OOM", "plan": PLAN, "measured": _MEASURED}),
    "pruned": ("fail", {"kind": "pruned", "message": "stopped"}),
    "measured error": ("fail", {"kind": "error", "message": "nan", "measured": _MEASURED}),
    "measured interrupt": ("fail", {"kind": "interrupted", "measured": _MEASURED}),
}


def _written(env: Env, trial_id: int) -> dict[str, Any]:
    """What a trial call can write about the trial: vramtune's rows, its story, Optuna's."""
    with env.state.sessions() as session:
        trial = session.get(TrialRow, trial_id)
        lease = session.scalars(select(LeaseRow).where(LeaseRow.trial_id == trial_id)).one()
        story = session.scalars(
            select(TrialEventRow.kind).where(TrialEventRow.trial_id == trial_id)
        )
        rows = {
            "trial": (trial.status, trial.outcome, trial.plan, trial.updated_at),
            "lease": (lease.active, lease.started_at, lease.resolution, lease.expires_at),
            "story": list(story),
        }
    frozen = env.optuna_study().get_trials()[0]
    optuna_sees = (frozen.state, frozen.values, frozen.intermediate_values, frozen.user_attrs)
    return {**rows, "optuna": optuna_sees, "observations": env.observations()}


@pytest.mark.parametrize("result", list(_RESULTS_OF_A_RUN))
def test_a_result_under_a_lease_that_never_started_is_409_and_writes_nothing(
    env: Env, result: str
) -> None:
    env.create_study(pruner={"name": "threshold", "args": {"upper": 1.0}})
    worker = env.worker("w1")
    held = worker.next()
    assert held is not None
    verb, body = _RESULTS_OF_A_RUN[result]
    before = _written(env, held["trial_id"])
    refused = worker.call(held, verb, start=False, **body)
    assert refused.status_code == 409, refused.text
    assert refused.json()["detail"].startswith(f"trial {held['trial_id']}: not started")
    assert _written(env, held["trial_id"]) == before
    assert before["lease"][:3] == (True, None, None)  # still held, never started, not ended
    assert before["optuna"][0] == TrialState.RUNNING
    # Started, the same call is taken as it always was.
    assert worker.call(held, "start", plan=PLAN).status_code == 200
    assert _written(env, held["trial_id"])["lease"][1] is not None
    taken = worker.call(held, verb, **body)
    assert taken.status_code == 200, taken.text


def test_a_fail_without_a_measurement_and_a_hand_back_need_no_start(env: Env) -> None:
    env.create_study(n_trials=2)
    worker = env.worker("w1")
    broken, too_big = worker.next(), worker.next()
    assert broken is not None and too_big is not None
    failed = worker.call(broken, "fail", kind="error", message="task not installed")
    assert failed.json()["resolution"] == "failed"
    back = worker.call(too_big, "handback", min_footprint_bytes=64 * GIB, reason="too big")
    assert back.json()["resolution"] == "infeasible"
    # infeasible: told COMPLETE with a violated constraint
    assert [t.state for t in env.trials()] == [TrialState.FAIL, TrialState.COMPLETE]


def _complete_asking_next(
    worker: SimWorker, assignment: dict[str, Any], value: float, **next_body: Any
) -> httpx.Response:
    """A complete that also asks for the worker's next trial (CompleteRequest.next)."""
    body = {"free_bytes": worker.total_bytes, **next_body}
    return worker.call(
        assignment,
        "complete",
        values=[value],
        plan=PLAN,
        measured={"peak_allocated_bytes": GIB},
        duration_s=1.0,
        next=body,
    )


def test_complete_asking_next_completes_once_and_leases_the_next(env: Env) -> None:
    env.create_study(n_trials=3)
    worker = env.worker("w1")
    assignment = worker.next()
    numbers = []
    while assignment is not None:
        numbers.append(assignment["number"])
        worker.call(assignment, "start", plan=PLAN)
        reply = _complete_asking_next(worker, assignment, assignment["params"]["x"] ** 2)
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        assert answer["resolution"] == "complete" and answer["trial_id"] == assignment["trial_id"]
        following = answer["next"]
        if following is not None:  # leased to this worker, as POST /workers/ID/next would
            assert worker.out()["current_trials"] == [following["trial_id"]]
        else:
            assert answer["next_detail"] == "no work for this worker now"
        last, assignment = assignment, following
    assert numbers == [0, 1, 2]
    trials = env.trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 3
    assert env.observations() == 3
    assert (worker.out()["trials_done"], worker.out()["current_trials"]) == (3, [])
    # the reply was lost: the repeated complete is answered the same, told once
    again = _complete_asking_next(worker, last, 99.0)
    assert again.status_code == 200 and again.json()["resolution"] == "complete"
    assert again.json()["next"] is None  # the budget is spent
    assert env.trials()[2].value == last["params"]["x"] ** 2
    assert env.observations() == 3 and worker.out()["trials_done"] == 3


def test_complete_asking_next_keeps_the_result_when_no_lease_can_be_granted(env: Env) -> None:
    env.create_study(n_trials=2)
    worker = env.worker("w1")
    assignment = worker.next()
    assert assignment is not None
    with env.state.sessions.begin() as session:  # stopped meanwhile, its lease still live
        session.get_one(WorkerRow, worker.id).stopped = True
    reply = _complete_asking_next(worker, assignment, 0.25)
    assert reply.status_code == 200, reply.text
    assert reply.json()["next"] is None and "has stopped" in reply.json()["next_detail"]
    assert env.trials()[0].state == TrialState.COMPLETE and env.trials()[0].value == 0.25
    assert [t.state for t in env.trials()] == [TrialState.COMPLETE]  # nothing else asked


def test_complete_asking_next_with_bad_input_is_422_naming_the_field(env: Env) -> None:
    env.create_study()
    worker = env.worker("w1")
    assignment = worker.next()
    assert assignment is not None
    negative = _complete_asking_next(worker, assignment, 1.0, free_bytes=-1)
    assert negative.status_code == 422
    assert negative.json()["detail"][0]["loc"] == ["body", "next", "free_bytes"]
    unknown = _complete_asking_next(worker, assignment, 1.0, gpus=2)
    assert unknown.status_code == 422
    assert unknown.json()["detail"][0]["loc"] == ["body", "next", "gpus"]
    assert env.trials()[0].state == TrialState.RUNNING  # nothing was written
    assert _complete_asking_next(worker, assignment, 1.0).status_code == 200


def test_wrong_objective_count_is_422_and_the_trial_lives_on(env: Env) -> None:
    env.create_study()
    worker = env.worker("w1")
    assignment = worker.next()
    assert assignment is not None
    wrong = worker.complete(assignment, 1.0, 2.0)
    assert wrong.status_code == 422
    assert wrong.json()["detail"][0]["loc"] == ["body", "values"]
    assert env.trials()[0].state == TrialState.RUNNING
    assert worker.complete(assignment, 1.0).status_code == 200
    assert env.trials()[0].state == TrialState.COMPLETE


def test_bad_input_gets_a_4xx_naming_the_field(env: Env) -> None:
    env.create_study()
    http, worker = env.http, env.worker("w1")
    assignment = worker.next()
    assert assignment is not None
    assert http.post(f"/workers/{10**9}/heartbeat", json={}).status_code == 404
    assert http.post(f"/workers/{10**9}/next", json={"free_bytes": 1}).status_code == 404
    assert http.post(f"/workers/{2**70}/next", json={"free_bytes": 1}).status_code == 422
    negative = http.post(f"/workers/{worker.id}/next", json={"free_bytes": -1})
    assert negative.status_code == 422 and negative.json()["detail"][0]["loc"][-1] == "free_bytes"
    absurd = {"model": "x", "total_bytes": 10**19, "free_bytes": 0}
    body: dict[str, Any] = {"name": "w2", "device": "cpu", "card": absurd, "tasks": [env.task]}
    assert http.post("/workers", json=body).status_code == 422
    url = f"/trials/{assignment['trial_id']}"
    for raw in ("NaN", "Infinity", "-Infinity"):
        content = f'{{"lease": "{assignment["lease"]}", "step": 1, "value": {raw}}}'
        response = http.post(f"{url}/report", content=content, headers=_JSON)
        assert response.status_code == 422, response.text
        assert response.json()["detail"][0]["loc"] == ["body", "value"]
    body = {"lease": assignment["lease"], "values": ["NAN"], "plan": PLAN, "duration_s": 1}
    body["measured"] = {"peak_allocated_bytes": GIB}
    content = json.dumps(body).replace('"NAN"', "NaN")
    complete_nan = http.post(f"{url}/complete", content=content, headers=_JSON)
    assert complete_nan.status_code == 422
    assert complete_nan.json()["detail"][0]["loc"] == ["body", "values", 0]
    unknown_trial = {**assignment, "trial_id": 10**9}
    assert worker.call(unknown_trial, "report", step=1, value=1.0).status_code == 404
    unknown_lease = {**assignment, "lease": "x" * 20}
    assert worker.call(unknown_lease, "report", step=1, value=1.0).status_code == 409
    assert env.trials()[0].state == TrialState.RUNNING  # nothing was lost
    assert worker.complete(assignment, 0.5).status_code == 200


def test_pruned_at_report_is_told_once_and_ordered_stopped(env: Env) -> None:
    env.create_study(pruner={"name": "threshold", "args": {"upper": 1.0}})
    worker = env.worker("w1")
    assignment = worker.next()
    assert assignment is not None
    assert worker.call(assignment, "report", step=1, value=0.5).json() == {"prune": False}
    assert worker.call(assignment, "report", step=2, value=5.0).json() == {"prune": True}
    assert env.trials()[0].state == TrialState.PRUNED
    assert worker.heartbeat() == [{"trial_id": assignment["trial_id"], "reason": "pruned"}]
    assert worker.heartbeat() == []
    acked = worker.call(assignment, "fail", kind="pruned", message="stopped")
    assert acked.status_code == 200 and acked.json()["resolution"] == "pruned"
    assert worker.complete(assignment, 0.1).status_code == 409
    assert env.trials()[0].state == TrialState.PRUNED


def test_a_pruned_runs_peak_is_kept_once_when_its_report_pruned_it(env: Env) -> None:
    env.create_study(pruner={"name": "threshold", "args": {"upper": 1.0}})
    worker = env.worker("w1")
    assignment = worker.next()
    assert assignment is not None
    assert worker.call(assignment, "report", step=1, value=5.0).json() == {"prune": True}
    measured = {"peak_allocated_bytes": 3 * GIB, "peak_reserved_bytes": 4 * GIB}
    for _ in range(2):  # the second call is a retry after a lost reply: one observation
        acked = worker.call(assignment, "fail", kind="pruned", plan=PLAN, measured=measured)
        assert acked.status_code == 200 and acked.json()["resolution"] == "pruned"
    [trial] = env.page().values()
    assert (
        trial["measured_peak_bytes"] == 4 * GIB
    )  # reserved: the one rule of vramtune.service.wire
    assert env.observations() == 1


def test_an_interrupted_runs_peak_is_an_observation_and_the_trial_is_offered_again(
    env: Env,
) -> None:
    env.create_study()
    worker = env.worker("w1")
    assignment = worker.next()
    assert assignment is not None
    measured = {"peak_allocated_bytes": GIB}
    acked = worker.call(assignment, "fail", kind="interrupted", plan=PLAN, measured=measured)
    assert acked.json()["resolution"] == "retry"
    assert env.observations() == 1
    [trial] = env.page().values()
    assert trial["measured_peak_bytes"] == GIB
    again = worker.next()
    assert again is not None and again["trial_id"] == assignment["trial_id"]
    assert worker.complete(again, 0.5, peak=2 * GIB).status_code == 200
    assert env.observations() == 2
    [trial] = env.page().values()
    assert trial["measured_peak_bytes"] == 2 * GIB


def test_a_stop_without_a_measurement_is_no_observation(env: Env) -> None:
    env.create_study()
    worker = env.worker("w1")
    assignment = worker.next()
    assert assignment is not None
    acked = worker.call(assignment, "fail", kind="interrupted", plan=PLAN)
    assert acked.json()["resolution"] == "retry"
    assert env.observations() == 0


def test_memory_objective_gets_the_measured_peak(env: Env) -> None:
    env.create_study(n_trials=2, minimize_peak_memory=True, pruner={"name": "median"})
    worker = env.worker("w1")
    first, second = worker.next(), worker.next()
    assert first is not None and second is not None
    assert first["n_objectives"] == 2 and first["minimize_peak_memory"] is True
    assert worker.call(first, "report", step=1, value=1.0).json() == {"prune": False}
    assert worker.complete(first, 0.5, peak=3 * GIB).status_code == 200  # the server appends
    assert worker.complete(second, 0.7, 1.0, 2.0).status_code == 422
    assert worker.complete(second, 0.7, float(GIB)).status_code == 200
    values = [t.values for t in env.trials()]
    assert values == [[0.5, float(3 * GIB)], [0.7, float(GIB)]]


# ---------------------------------------------------------------- leases and the reaper


def test_lost_lease_reoffers_the_trial_and_refuses_the_late_complete(env: Env) -> None:
    env.create_study()
    slow, other = env.worker("slow"), env.worker("other")
    lost = slow.next()
    assert lost is not None and other.next() is None  # n_trials = 1: nothing else to do
    assert reap_once(env.state, utcnow() + LATER).reoffered >= 1
    again = other.next()
    assert again is not None
    same = ("trial_id", "number", "params")
    assert [again[k] for k in same] == [lost[k] for k in same]
    assert again["attempt"] == 1 and again["lease"] != lost["lease"]
    assert slow.heartbeat() == [{"trial_id": lost["trial_id"], "reason": "lease_lost"}]
    late = slow.complete(lost, 99.0)
    assert late.status_code == 409 and "lost" in late.json()["detail"]
    assert other.complete(again, 1.0).status_code == 200
    assert [(t.state, t.value) for t in env.trials()] == [(TrialState.COMPLETE, 1.0)]
    assert env.observations() == 1
    assert env.page()[lost["trial_id"]]["attempt"] == 1
    detail = env.http.get(f"/dashboard/studies/{env.study}/trials/{lost['number']}").json()
    story = [(e["kind"], e["detail"].get("worker")) for e in detail["events"]]
    assert story == [
        ("leased", "slow"),
        ("lease_lost", "slow"),
        ("leased", "other"),
        ("planned", "other"),
        ("completed", "other"),
    ]
    assert detail["events"][1]["text"] == "lease lost: slow stopped heartbeating; offered again"


def test_trial_fails_after_max_attempts(env: Env) -> None:
    env.create_study(max_attempts=2)
    worker = env.worker("w1")
    now = utcnow()
    assert worker.next() is not None
    reap_once(env.state, now + LATER)
    retried = worker.next()
    assert retried is not None and retried["attempt"] == 1
    assert reap_once(env.state, now + 3 * LATER).failed >= 1
    trial = env.trials()[0]
    assert trial.state == TrialState.FAIL
    assert "lease lost 2 times" in trial.user_attrs["vramtune.fail_reason"]
    assert worker.next() is None
    assert worker.complete(retried, 1.0).status_code == 409


def test_stopped_worker_leaves_its_trial_to_the_next(env: Env) -> None:
    env.create_study()
    leaving, staying = env.worker("leaving"), env.worker("staying")
    held = leaving.next()
    assert held is not None
    assert env.http.post(f"/workers/{leaving.id}/stop").status_code == 204
    assert env.http.post(f"/workers/{leaving.id}/heartbeat", json={}).status_code == 409
    assert env.http.post(f"/workers/{leaving.id}/next", json={"free_bytes": 1}).status_code == 409
    taken = staying.next()
    assert taken is not None and taken["trial_id"] == held["trial_id"]
    assert taken["attempt"] == 0  # leaving is not failing
    assert (leaving.out()["state"], staying.out()["state"]) == ("stopped", "live")
    only_stopped = {"state": "stopped", "limit": 1000}
    stopped = env.http.get("/workers", params=only_stopped).json()["workers"]
    assert leaving.id in {w["id"] for w in stopped} and staying.id not in {w["id"] for w in stopped}
    assert leaving.complete(held, 5.0).status_code == 409
    assert staying.complete(taken, 5.0).status_code == 200


def test_paused_study_orders_its_trials_stopped(env: Env) -> None:
    env.create_study()
    worker = env.worker("w1")
    held = worker.next()
    assert held is not None
    assert env.http.post(f"/studies/{env.study}/pause").status_code == 200
    assert worker.heartbeat() == [{"trial_id": held["trial_id"], "reason": "paused"}]
    acked = worker.call(held, "fail", kind="interrupted", message="paused")
    assert acked.json()["resolution"] == "retry"
    assert worker.next() is None
    assert env.http.post(f"/studies/{env.study}/resume").status_code == 200
    again = worker.next()
    assert again is not None and again["trial_id"] == held["trial_id"]
    assert worker.complete(again, 1.0).status_code == 200


def test_the_servers_own_reaper_reoffers_an_abandoned_trial(
    migrated_url: str, start_server: ServerFactory
) -> None:
    server = start_server(migrated_url, lease_ttl_s=1, reaper_interval_s=0.1)
    http = httpx.Client(base_url=f"{server.url}/api/v1", timeout=60)
    with http, client_side_state(migrated_url) as state:
        env = Env(http, state, "abandoned", "quadratic")
        env.create_study(max_attempts=20)
        abandoned = env.worker("dies").next()
        assert abandoned is not None
        rescuer = env.worker("rescuer")
        deadline = time.monotonic() + 60  # a limit on waiting, not a timing assertion
        completed = None
        while completed is None and time.monotonic() < deadline:
            again = rescuer.next()
            # On a loaded machine the rescuer's own 1 s lease may expire too: then it tries again.
            if again is not None and rescuer.complete(again, 2.0).status_code == 200:
                completed = again
            time.sleep(0.05)
        assert completed is not None and completed["trial_id"] == abandoned["trial_id"]
        assert completed["attempt"] >= 1
        assert [t.state for t in env.trials()] == [TrialState.COMPLETE]


def _waiting_for_a_larger_card(env: Env) -> tuple[SimWorker, SimWorker, dict[str, Any]]:
    """A 4 GiB and a 16 GiB worker; the small one leases a trial and hands it back as needing
    6 GiB: it waits for the large card. (small, large, the small one's assignment.)"""
    small = env.worker("small", 4 * GIB, "Sim 4G")
    large = env.worker("large", 16 * GIB, "Sim 16G")
    held = small.next()
    assert held is not None
    back = small.call(held, "handback", min_footprint_bytes=6 * GIB, plan=HALVED, reason="big")
    assert back.json()["resolution"] == "waiting"
    return small, large, held


def test_a_restarted_server_routes_a_waiting_trial_to_the_card_it_waits_for(
    migrated_url: str, start_server: ServerFactory
) -> None:
    """The server killed while a trial waits for a larger card, started again after that
    card's worker would count as stale: the trial still goes to it, not ended infeasible by
    heartbeats the worker could not send meanwhile."""
    stale_s = 6.0
    server = start_server(migrated_url, worker_stale_s=stale_s, reaper_interval_s=0.2)
    http = httpx.Client(base_url=f"{server.url}/api/v1", timeout=60)
    with http, client_side_state(migrated_url) as state:
        env = Env(http, state, "restart-routing", "quadratic")
        env.create_study(n_trials=1)
        _, large, held = _waiting_for_a_larger_card(env)

        server.kill()
        time.sleep(1.5 * stale_s)
        server.start()
        routed = large.next()

        assert routed is not None and routed["trial_id"] == held["trial_id"], env.page()
        assert large.complete(routed, 0.25, peak=6 * GIB).status_code == 200
        assert [t.state for t in env.trials()] == [TrialState.COMPLETE]


# ---------------------------------------------------------------- routing


def test_handed_back_trial_waits_for_a_larger_card(env: Env) -> None:
    env.create_study(n_trials=2)
    small, large, held = _waiting_for_a_larger_card(env)
    other = small.next()  # the waiting trial is not for this card: a new one is asked
    assert other is not None and other["trial_id"] != held["trial_id"]
    routed = large.next()  # the waiting trial comes first for a card that holds it
    assert routed is not None and routed["trial_id"] == held["trial_id"]
    assert routed["params"] == held["params"] and routed["attempt"] == 0
    assert large.complete(routed, 0.25, peak=6 * GIB).status_code == 200
    assert small.complete(other, 0.5).status_code == 200
    shown = env.page()[held["trial_id"]]
    assert (shown["outcome"], shown["worker"]) == ("routed", "large")
    told = env.trials()[held["number"]]
    assert told.state == TrialState.COMPLETE and told.constraints["memory"] <= 0
    assert told.user_attrs["vramtune.handback"]["min_footprint_bytes"] == 6 * GIB


def test_a_reaper_pass_looking_at_a_waiting_trial_does_not_hide_it_from_its_card(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reaper checks a waiting trial's live capacity while the larger card asks for work:
    the card gets the trial. (The pass once held the trial's row locked while it looked, and a
    ``next`` skips locked rows on PostgreSQL: the card was told there was no work.)"""
    env.create_study(n_trials=1)
    _, large, held = _waiting_for_a_larger_card(env)

    looking, asked = threading.Event(), threading.Event()
    capacity = reaper.live_capacity

    def live_capacity_while_the_card_asks(
        session: Any, study: StudyRow, *args: Any, **kwargs: Any
    ) -> int:
        if study.name == env.study:  # other tests' waiting trials pass as they are
            looking.set()
            asked.wait(60)  # a limit on waiting, not a timing assertion
        return capacity(session, study, *args, **kwargs)

    monkeypatch.setattr(reaper, "live_capacity", live_capacity_while_the_card_asks)
    with ThreadPoolExecutor(1) as pool:
        passed = pool.submit(reap_once, env.state, expire_leases=False)
        assert looking.wait(60)
        try:
            routed = large.next()
        finally:
            asked.set()
        assert passed.result().infeasible == 0
    assert routed is not None and routed["trial_id"] == held["trial_id"]


def test_a_routed_then_pruned_trial_keeps_its_story_and_shows_both(env: Env) -> None:
    env.create_study(pruner={"name": "threshold", "args": {"upper": 1.0}})
    small = env.worker("small", 4 * GIB, "Sim 4G")
    large = env.worker("large", 16 * GIB, "Sim 16G")
    held = small.next()
    assert held is not None
    small.call(held, "handback", min_footprint_bytes=6 * GIB, plan=HALVED, reason="big")
    routed = large.next()
    assert routed is not None and routed["trial_id"] == held["trial_id"]
    started = large.call(routed, "start", plan=PLAN, prediction=_prediction(6 * GIB))
    assert started.status_code == 200, started.text
    assert large.call(routed, "report", step=3, value=5.0).json() == {"prune": True}
    shown = env.page()[held["trial_id"]]
    assert (shown["outcome"], shown["told_outcome"]) == ("pruned", "routed, pruned")
    detail = env.http.get(f"/dashboard/studies/{env.study}/trials/{held['number']}").json()
    assert detail["told_outcome"] == "routed, pruned"
    story = [(e["kind"], e["detail"].get("worker")) for e in detail["events"]]
    assert story == [
        ("leased", "small"),
        ("handed_back", "small"),
        ("routed", "large"),
        ("planned", "large"),
        ("pruned", "large"),
    ]
    texts = [e["text"] for e in detail["events"]]
    assert "needs 6.00 GiB at its smallest plan; waits for a larger card" in texts[1]
    assert texts[2] == "routed to the larger card of large (16.0 GiB)"
    listed = env.http.get("/dashboard/studies").json()["studies"]
    memory = next(s["memory"] for s in listed if s["name"] == env.study)
    assert (memory["routed"], memory["routed_pruned"]) == (1, 1)


def test_infeasible_trials_get_advice_in_human_units(env: Env) -> None:
    space = {"width": {"type": "categorical", "choices": [64, 4096]}}
    env.create_study(n_trials=2, search_space=space, sampler={"name": "grid"})
    small = env.worker("small", 4 * GIB, "Sim 4G")
    first, second = small.next(), small.next()
    assert first is not None and second is not None
    narrow, wide = sorted((first, second), key=lambda a: a["params"]["width"])
    assert small.complete(narrow, 1.0, peak=GIB).status_code == 200
    back = small.call(wide, "handback", min_footprint_bytes=6 * GIB, reason="too wide")
    assert back.json()["detail"] == (
        "needs 6.00 GiB; the largest live card has 4.00 GiB, 3.60 GiB usable after the 10% "
        "safety margin"
    )
    advice = env.http.get(f"/dashboard/studies/{env.study}/advice").json()["items"]
    infeasible = next(a for a in advice if a["kind"] == "infeasible")
    assert infeasible["trials"] == [wide["number"]]
    assert "needs 6.00 GiB" in infeasible["text"]
    assert (
        "The largest live card has 4.00 GiB, 3.60 GiB usable after the 10% safety margin: "
        "2.40 GiB short (+67 %)" in infeasible["text"]
    )
    actions = " | ".join(infeasible["actions"])
    assert "add 'bf16' to memory_policy.resizes" in actions
    for rung in ("chunked_cross_entropy", "adamw_8bit", "adafactor", "activation_offload"):
        assert f"add '{rung}' to memory_policy.resizes" in actions  # every rung left out
    assert "add 'checkpointing'" not in actions  # the default policy lists it
    assert "drop 4096 from search_space.width.choices" in actions
    assert "add a card of at least 6.67 GiB" in actions  # the footprint and the 10 % margin


def test_the_advice_names_no_rung_the_tasks_or_live_cards_cannot_use(env: Env) -> None:
    """A PlainTask without blocks on CPU cards, as its worker registers it: no checkpointing,
    no chunked loss, no offloads (CUDA only); the numerics-changing rungs it can take are
    advised. A footprint under the card but over its margin's budget is short of the budget."""
    space = {"width": {"type": "categorical", "choices": [64, 4096]}}
    env.create_study(n_trials=2, search_space=space, sampler={"name": "grid"})
    can = ["micro_batch", "bf16", "adamw_8bit", "adafactor"]
    small = env.worker("small", 256 * 2**20, "Sim 256M", rungs=can)
    first, second = small.next(), small.next()
    assert first is not None and second is not None
    narrow, wide = sorted((first, second), key=lambda a: a["params"]["width"])
    assert small.complete(narrow, 1.0, peak=2**20).status_code == 200
    back = small.call(wide, "handback", min_footprint_bytes=231 * 2**20, reason="too wide")
    detail = back.json()["detail"]
    assert detail == (
        "needs 231 MiB; the largest live card has 256 MiB, 230 MiB usable after the 10% "
        "safety margin"
    )
    advice = env.http.get(f"/dashboard/studies/{env.study}/advice").json()["items"]
    infeasible = next(a for a in advice if a["kind"] == "infeasible")
    lines = [infeasible["text"], *infeasible["actions"]]
    unusable = ["checkpointing", "chunked", "offload", "host memory", "selective"]
    for line in lines:
        assert not any(word in line for word in unusable), line
    actions = " | ".join(infeasible["actions"])
    for rung in ("bf16", "adamw_8bit", "adafactor"):
        assert f"add '{rung}' to memory_policy.resizes" in actions
    assert "short (+" in infeasible["text"], infeasible["text"]  # of the budget, not the card


def test_an_oom_the_prediction_missed_is_advice_and_story(env: Env) -> None:
    env.create_study()
    worker = env.worker("w1", 4 * GIB, "Sim 4G")
    held = worker.next()
    assert held is not None
    worker.call(held, "start", plan=PLAN, prediction=_prediction(3 * GIB))
    measured = {"peak_allocated_bytes": 5 * GIB}
    body = {"plan": PLAN, "measured": measured, "prediction": _prediction(3 * GIB)}
    oom = worker.call(held, "fail", kind="oom", message="CUDA out of memory", **body)
    assert oom.json()["resolution"] == "retry"
    advice = env.http.get(f"/dashboard/studies/{env.study}/advice").json()["items"]
    missed = next(a for a in advice if a["kind"] == "missed_oom")
    assert missed["title"] == "1 run ran out of memory though predicted to fit"
    assert "predicted at 3.00 GiB on Sim 4G and ran out of memory at 5.00 GiB" in missed["text"]
    assert missed["trials"] == [held["number"]]
    detail = env.http.get(f"/dashboard/studies/{env.study}/trials/{held['number']}").json()
    assert [e["kind"] for e in detail["events"]] == ["leased", "planned", "oom"]
    assert detail["events"][-1]["text"] == (
        "out of memory at 5.00 GiB on w1 (4.00 GiB) running as asked; retried smaller"
    )
    retried = worker.next()
    assert retried is not None and retried["trial_id"] == held["trial_id"]
    assert worker.complete(retried, 1.0, peak=GIB).status_code == 200
    detail = env.http.get(f"/dashboard/studies/{env.study}/trials/{held['number']}").json()
    assert [e["kind"] for e in detail["events"]][3:] == ["leased", "planned", "completed"]


def test_a_constant_excess_over_prediction_is_advised_as_unchunked_evaluation(env: Env) -> None:
    env.create_study(n_trials=4)
    worker = env.worker("w1", 16 * GIB, "Sim 16G")
    for predicted in (GIB, 2 * GIB, 3 * GIB, 4 * GIB):  # each run holds 512 MiB more
        assignment = worker.next()
        assert assignment is not None
        done = worker.call(
            assignment,
            "complete",
            values=[1.0],
            plan=PLAN,
            prediction=_prediction(predicted),
            measured={"peak_allocated_bytes": predicted + GIB // 2},
            duration_s=1.0,
        )
        assert done.status_code == 200, done.text
    advice = env.http.get(f"/dashboard/studies/{env.study}/advice").json()["items"]
    (bias,) = [a for a in advice if a["kind"] == "calibration"]
    assert bias["title"] == "Predictions on Sim 16G are too low (+21 %)"
    assert "512 MiB on the smaller, 512 MiB on the larger" in bias["text"]
    assert "evaluation" in bias["text"] and "chunk" in bias["actions"][0]


def test_a_task_no_live_worker_offers_is_advice_and_a_note_on_waiting_trials(env: Env) -> None:
    env.create_study(n_trials=2)
    advice = env.http.get(f"/dashboard/studies/{env.study}/advice").json()["items"]
    assert [a["kind"] for a in advice] == ["no_worker"]
    assert advice[0]["title"] == f"No live worker offers task '{env.task}'"
    leaving = env.worker("leaving")
    held = leaving.next()
    assert held is not None
    table = env.http.get(f"/dashboard/studies/{env.study}/trials").json()
    assert table["note"] is None and table["rows"][0]["note"] is None  # a live worker has it
    assert env.http.post(f"/workers/{leaving.id}/stop").status_code == 204
    table = env.http.get(f"/dashboard/studies/{env.study}/trials").json()
    note = f"no live worker offers task '{env.task}'"
    assert table["note"] == note
    assert [(r["waiting"], r["note"]) for r in table["rows"]] == [(True, note)]


def test_a_trial_its_worker_is_planning_says_since_when_until_it_starts(env: Env) -> None:
    env.create_study(n_trials=1)
    worker = env.worker("planner")
    assignment = worker.next()
    assert assignment is not None

    def planning() -> tuple[object, object]:
        (rest,) = env.page().values()
        (row,) = env.http.get(f"/dashboard/studies/{env.study}/trials").json()["rows"]
        return rest["planning_since"], row["planning_since"]

    rest, dashboard = planning()
    assert rest is not None and rest == dashboard  # leased, not started: being planned
    assert worker.call(assignment, "start", plan=PLAN).status_code == 200
    assert planning() == (None, None)  # running as planned
    assert worker.complete(assignment, 1.0).status_code == 200
    assert planning() == (None, None)


def test_a_done_study_has_no_worker_advice_and_no_waiting_note(env: Env) -> None:
    env.create_study(n_trials=1)
    worker = env.worker("only")
    assignment = worker.next()
    assert assignment is not None
    assert worker.complete(assignment, 1.0, peak=GIB).status_code == 200
    assert env.http.post(f"/workers/{worker.id}/stop").status_code == 204
    advice = env.http.get(f"/dashboard/studies/{env.study}/advice").json()["items"]
    assert "no_worker" not in [a["kind"] for a in advice]
    table = env.http.get(f"/dashboard/studies/{env.study}/trials").json()
    assert table["note"] is None and [r["note"] for r in table["rows"]] == [None]


def test_trial_no_card_can_hold_is_infeasible_with_its_constraint(env: Env) -> None:
    env.create_study(n_trials=2)
    small = env.worker("small", 4 * GIB, "Sim 4G")
    fits, too_big = small.next(), small.next()
    assert fits is not None and too_big is not None
    assert small.complete(fits, 2.0, peak=GIB).status_code == 200
    back = small.call(too_big, "handback", min_footprint_bytes=6 * GIB, reason="too big")
    assert back.json()["resolution"] == "infeasible"
    feasible, infeasible = env.trials()
    assert infeasible.state == TrialState.COMPLETE
    assert infeasible.system_attrs["constraints:memory"] == pytest.approx(0.5)  # 6 GiB on 4
    assert infeasible.system_attrs["constraints"] == [pytest.approx(0.5)]
    assert infeasible.user_attrs["vramtune.placeholder_values"] is True
    # A placeholder: one float step worse than the worst feasible value, so that no reader
    # ranking by value alone ties it with the only feasible trial.
    assert infeasible.value == math.nextafter(2.0, math.inf)
    assert feasible.system_attrs["constraints:memory"] == pytest.approx(-0.75)
    study = env.optuna_study()
    assert study.best_trial.number == feasible.number  # Optuna skips the infeasible one
    assert env.page()[too_big["trial_id"]]["outcome"] == "infeasible"
    assert env.page()[too_big["trial_id"]]["values"] is None  # not a result
    assert small.complete(too_big, 1.0).status_code == 409


def _need(world_size: int, per_rank_bytes: int) -> dict[str, Any]:
    return {"world_size": world_size, "strategy": "ddp", "per_rank_bytes": per_rank_bytes}


def test_a_hand_back_naming_rank_needs_waits_for_a_node_with_enough_cards(env: Env) -> None:
    env.create_study(n_trials=2, distributed={"max_world_size": 8})
    single = env.worker("single", 4 * GIB, "Sim 4G")
    node = env.worker("node", 4 * GIB, "Sim 4G", cards=4)
    held = single.next()
    assert held is not None and held["distributed"]["max_world_size"] == 8
    needs = [_need(2, 5 * GIB), _need(4, 3 * GIB), _need(8, 2 * GIB)]
    back = single.call(held, "handback", min_footprint_bytes=10 * GIB, rank_needs=needs)
    # 2 ranks need 5 GiB a card, more than the node's: the fewest it holds is 4.
    assert back.json()["resolution"] == "waiting"
    assert "a node with 4 free cards of at least 3.00 GiB" in back.json()["detail"]
    other = single.next()  # the waiting trial is not for a one-card worker
    assert other is not None and other["trial_id"] != held["trial_id"]
    routed = node.next()
    assert routed is not None and routed["trial_id"] == held["trial_id"]
    assert routed["min_world_size"] == 4
    plan = {"world_size": 4, "strategy": "ddp"}
    peaks = [3 * GIB, 3 * GIB - 512, 3 * GIB - 512, 3 * GIB - 1024]
    measured = {"peak_allocated_bytes": 3 * GIB, "rank_peak_bytes": peaks}
    done = node.call(
        routed, "complete", values=[1.0], plan=plan, measured=measured, duration_s=1.0,
        prediction=_prediction(3 * GIB),
    )  # fmt: skip
    assert done.status_code == 200, done.text
    shown = env.page()[held["trial_id"]]
    assert (shown["plan"]["world_size"], shown["plan"]["strategy"]) == (4, "ddp")
    assert shown["rank_peak_bytes"] == peaks and shown["predicted_peak_bytes"] == 3 * GIB
    # 8 ranks of 2 GiB: the node has 4 cards, and a one-card worker none to spare.
    back = single.call(other, "handback", min_footprint_bytes=10 * GIB, rank_needs=[_need(8, GIB)])
    assert back.json()["resolution"] == "infeasible"
    assert "no live node has 8 cards of 1.00 GiB" in back.json()["detail"]


def test_a_node_is_offered_what_its_free_cards_hold_and_says_which_cards_run_it(
    env: Env,
) -> None:
    env.create_study(n_trials=3, distributed={"max_world_size": 4})
    single = env.worker("single", 4 * GIB, "Sim 4G")
    node = env.worker("node", 4 * GIB, "Sim 4G", cards=4)
    held = single.next()
    assert held is not None
    back = single.call(held, "handback", min_footprint_bytes=10 * GIB, rank_needs=[_need(4, GIB)])
    assert back.json()["resolution"] == "waiting"
    url = f"/workers/{node.id}/next"
    two_free = env.http.post(url, json={"free_bytes": 4 * GIB, "free_cards": 2})
    assert two_free.status_code == 200, two_free.text  # a new trial, not the one for 4 cards
    beside = two_free.json()
    assert beside["trial_id"] != held["trial_id"]
    too_many = env.http.post(url, json={"free_bytes": 4 * GIB, "free_cards": 5})
    assert too_many.status_code == 422 and "free_cards" in too_many.text
    plan = {"world_size": 2, "strategy": "ddp"}
    outside = node.call(beside, "start", plan=plan, cards=[3, 4])
    assert outside.status_code == 422 and "cards" in outside.text  # card 4 of cards 0..3
    not_per_rank = node.call(beside, "start", plan=plan, cards=[1])
    assert not_per_rank.status_code == 422 and "cards" in not_per_rank.text
    assert node.call(beside, "start", plan=plan, cards=[2, 3]).status_code == 200
    all_free = env.http.post(url, json={"free_bytes": 4 * GIB, "free_cards": 4})
    assert all_free.status_code == 200 and all_free.json()["trial_id"] == held["trial_id"]
    assert env.page()[beside["trial_id"]]["user_attrs"]["vramtune.cards"] == [2, 3]
    story = env.http.get(f"/dashboard/studies/{env.study}/trials/{beside['number']}").json()
    [planned] = [event for event in story["events"] if event["kind"] == "planned"]
    assert planned["detail"]["cards"] == [2, 3]
    assert planned["text"] == "runs 2 ranks, ddp on node (4.00 GiB), cards 2, 3"
    fleet = env.http.get("/dashboard/fleet", params={"limit": 500}).json()["workers"]
    [shown] = [worker for worker in fleet if worker["id"] == node.id]
    assert (shown["busy_cards"], shown["cards"]) == (3, 4)  # 2 ranks, and 1 leased, planning


def test_fsdp_keeping_parameters_gathered_round_trips_and_keys_apart(env: Env) -> None:
    env.create_study(n_trials=2, distributed={"max_world_size": 2, "prefer": "fastest"})
    node = env.worker("node", 4 * GIB, "Sim 4G", cards=2)
    first, second = node.next(), node.next()
    assert first is not None and second is not None
    assert first["distributed"]["prefer"] == "fastest"
    gathered = {"world_size": 2, "strategy": "fsdp", "reshard_after_forward": False}
    measured = {"peak_allocated_bytes": GIB, "rank_peak_bytes": [GIB, GIB - 512]}
    done = node.call(
        first, "complete", values=[1.0], plan=gathered, measured=measured, duration_s=1.0,
        prediction=_prediction(GIB),
    )  # fmt: skip
    assert done.status_code == 200, done.text
    shown = env.page()[first["trial_id"]]
    assert shown["plan"]["reshard_after_forward"] is False
    table = env.http.get(f"/dashboard/studies/{env.study}/trials").json()["rows"]
    (row,) = [r for r in table if r["id"] == first["trial_id"]]
    assert row["plan_words"] == "2 ranks, fsdp keeping parameters gathered"
    # Out of memory keeping them gathered: the retry knows that plan apart from resharding.
    oom = {"peak_allocated_bytes": 4 * GIB}
    failed = node.call(second, "fail", kind="oom", message="rank 0", plan=gathered, measured=oom)
    assert failed.json()["resolution"] == "retry"
    again = node.next()
    assert again is not None and again["trial_id"] == second["trial_id"]
    tried = [PlanOut.model_validate(plan) for plan in again["plans_tried"]]
    assert [plan_key(plan) for plan in tried] == [plan_key(Plan.model_validate(gathered))]
    assert plan_key(tried[0]) != plan_key(Plan(world_size=2, strategy="fsdp"))
    wrong = node.call(again, "start", plan={**gathered, "strategy": "ddp"})
    assert wrong.status_code == 422 and "reshard_after_forward" in wrong.text


def test_the_story_says_a_plan_in_the_tables_words(env: Env) -> None:
    """The trial view's story and the trials table name a plan alike (plan_in_words): its
    ranks and strategy on several cards, the optimizer and offload rungs on one."""
    env.create_study(n_trials=2, distributed={"max_world_size": 2})
    node = env.worker("node", 4 * GIB, "Sim 4G", cards=2)
    first, second = node.next(), node.next()
    assert first is not None and second is not None
    ranks = {"world_size": 2, "strategy": "fsdp", "reshard_after_forward": False}
    eight_bit = {**ranks, "bf16": True, "optimizer": "adamw_8bit"}
    offloads = {
        "micro_batch": 2, "accumulation": 4, "activation_offload": True, "optimizer_offload": True
    }  # fmt: skip
    told = {
        first["number"]: (
            "2 ranks, fsdp keeping parameters gathered, bf16, 8-bit AdamW optimizer "
            "(changes numerics)"
        ),
        second["number"]: (
            "micro-batch 2 × 4, activations offloaded to host memory, optimizer offloaded to "
            "host memory"
        ),
    }
    for assignment, plan in ((first, eight_bit), (second, offloads)):
        body = {"plan": plan, "prediction": _prediction(GIB)}
        assert node.call(assignment, "start", **body).status_code == 200
        ran = {"measured": {"peak_allocated_bytes": GIB}, "duration_s": 1.0}
        done = node.call(assignment, "complete", values=[1.0], **ran, **body)
        assert done.status_code == 200, done.text
    rows = env.http.get(f"/dashboard/studies/{env.study}/trials").json()["rows"]
    assert {row["number"]: row["plan_words"] for row in rows} == told
    for number, words in told.items():
        story = env.http.get(f"/dashboard/studies/{env.study}/trials/{number}").json()
        [resized] = [event["text"] for event in story["events"] if event["kind"] == "resized"]
        assert resized == f"resized: runs {words} on node (4.00 GiB), predicted 1.00 GiB"


def test_a_plan_names_a_strategy_with_more_than_one_rank_only(env: Env) -> None:
    env.create_study()
    node = env.worker("node", 4 * GIB, "Sim 4G", cards=2)
    held = node.next()
    assert held is not None
    wrong = node.call(held, "start", plan={"world_size": 2})
    assert wrong.status_code == 422 and "plan" in wrong.text
    card = {"model": "Sim", "total_bytes": GIB, "free_bytes": GIB}
    body = {"name": "huge", "device": "cpu", "card": card, "tasks": [env.task]}
    response = env.http.post("/workers", json={**body, "cards": [card] * 65})
    assert response.status_code == 422 and "cards" in response.text  # 64 cards at most


def test_an_infeasible_trial_before_any_feasible_one_never_ranks_best_by_value(env: Env) -> None:
    """optuna-dashboard's "Best Trial" is `RDBStorage.get_best_trial`: values, no constraints."""
    env.create_study(n_trials=2)
    small = env.worker("small", 4 * GIB, "Sim 4G")
    too_big, fits = small.next(), small.next()
    assert too_big is not None and fits is not None
    back = small.call(too_big, "handback", min_footprint_bytes=6 * GIB, reason="too big")
    assert back.json()["resolution"] == "infeasible"
    assert small.complete(fits, 5.0, peak=GIB).status_code == 200
    infeasible, feasible = env.trials()
    assert infeasible.value == math.inf  # no feasible value known yet: the worst there is
    study = env.optuna_study()
    ranked_by_value = study._storage.get_best_trial(study._study_id)
    assert ranked_by_value.number == study.best_trial.number == feasible.number
    assert env.page()[too_big["trial_id"]]["values"] is None


def test_waiting_trial_is_infeasible_once_the_larger_card_leaves(env: Env) -> None:
    env.create_study()
    small = env.worker("small", 4 * GIB, "Sim 4G")
    large = env.worker("large", 16 * GIB, "Sim 16G")
    held = small.next()
    assert held is not None
    back = small.call(held, "handback", min_footprint_bytes=6 * GIB)
    assert back.json()["resolution"] == "waiting"
    reap_once(env.state)
    assert env.trials()[0].state == TrialState.RUNNING  # the large card is live: it waits
    assert env.http.post(f"/workers/{large.id}/stop").status_code == 204
    reap_once(env.state)
    trial = env.trials()[0]
    assert trial.state == TrialState.COMPLETE and trial.constraints["memory"] > 0


def test_a_trial_waiting_for_a_node_is_infeasible_once_the_node_leaves(env: Env) -> None:
    env.create_study(distributed={"max_world_size": 4})
    single = env.worker("single", 4 * GIB, "Sim 4G")
    node = env.worker("node", 4 * GIB, "Sim 4G", cards=2)
    held = single.next()
    assert held is not None
    back = single.call(held, "handback", min_footprint_bytes=6 * GIB, rank_needs=[_need(2, GIB)])
    assert back.json()["resolution"] == "waiting"
    reap_once(env.state)
    assert env.trials()[0].state == TrialState.RUNNING  # the node is live: it waits
    assert env.http.post(f"/workers/{node.id}/stop").status_code == 204
    reap_once(env.state)  # the one-card worker is live, but has one card, not two
    trial = env.trials()[0]
    assert trial.state == TrialState.COMPLETE and trial.constraints["memory"] > 0
    reason = env.page()[held["trial_id"]]["user_attrs"]["vramtune.fail_reason"]
    assert "on each of 2 cards" in reason


def test_oom_retries_once_with_the_plans_tried_then_fails(env: Env) -> None:
    env.create_study()
    first = env.worker("a", 8 * GIB, "Sim 8G")
    other_model = env.worker("b", 8 * GIB, "Other 8G")
    held = first.next()
    assert held is not None
    measured = {"peak_allocated_bytes": 8 * GIB}
    oom = first.call(held, "fail", kind="oom", message="OOM", plan=PLAN, measured=measured)
    assert oom.json()["resolution"] == "retry"
    elsewhere = other_model.next()
    assert elsewhere is not None and elsewhere["plans_tried"] == []  # another card model
    assert other_model.call(elsewhere, "fail", kind="interrupted").json()["resolution"] == "retry"
    again = first.next()
    assert again is not None and again["trial_id"] == held["trial_id"]
    assert again["attempt"] == 1
    assert again["plans_tried"] == [{**PLAN, **NO_NEW_RUNGS, "reason": ""}]
    last = first.call(
        again, "fail", kind="oom", message="OOM again", plan=HALVED, measured=measured
    )
    assert last.json()["resolution"] == "failed"
    trial = env.trials()[0]
    assert trial.state == TrialState.FAIL
    assert "out of memory 2 times" in trial.user_attrs["vramtune.fail_reason"]
    assert env.observations() == 2
    assert env.page()[held["trial_id"]]["outcome"] == "oom"
    assert first.next() is None


def test_error_fails_the_trial_with_its_reason(env: Env) -> None:
    env.create_study()
    worker = env.worker("w1")
    held = worker.next()
    assert held is not None
    failed = worker.call(held, "fail", kind="error", message="d_model % heads != 0")
    assert failed.json()["resolution"] == "failed"
    again = worker.call(held, "fail", kind="error", message="d_model % heads != 0")
    assert again.json() == failed.json()  # a repeated fail is replayed, not told twice
    trial = env.trials()[0]
    assert trial.state == TrialState.FAIL
    assert trial.user_attrs["vramtune.fail_reason"] == "d_model % heads != 0"


def test_a_trial_finished_in_optuna_directly_is_refused_whole_and_settled(env: Env) -> None:
    env.create_study(n_trials=2)
    worker = env.worker("w1")
    first, second = worker.next(), worker.next()
    assert first is not None and second is not None
    study = env.optuna_study()
    study.tell(first["number"], 1.5)  # finished outside vramtune, under an active lease
    study.tell(second["number"], state=TrialState.FAIL)
    assert worker.complete(first, 1.5).status_code == 409
    assert worker.complete(second, 2.0).status_code == 409
    # Refused whole: none of the complete's attributes reached Optuna's rows (the start's did).
    told = {"vramtune.measured_peak_bytes", "vramtune.outcome", "vramtune.duration_s"}
    assert not [k for t in env.trials() for k in t.user_attrs if k in told]
    assert all("vramtune.plan" in t.user_attrs for t in env.trials())  # so the test can fail
    reap_once(env.state, utcnow() + LATER)
    assert worker.next() is None  # the leases expired, and the trials are not offered again
    assert env.page()[second["trial_id"]]["outcome"] == "failed"
    assert [t.state for t in env.trials()] == [TrialState.COMPLETE, TrialState.FAIL]
    assert [t.values for t in env.trials()] == [[1.5], None]


def test_calibration_is_fitted_from_the_runs_it_saw(env: Env) -> None:
    env.create_study(n_trials=3)
    model = f"Calibrated {env.task}"  # a card model of this test only
    workers = [env.worker(name, model=model) for name in ("w1", "w2")]
    query = {"card_model": model, "torch_version": "none", "task": env.task}
    assert env.http.get("/calibration", params=query).json()["n_observations"] == 0
    for number in range(3):
        worker = workers[min(number, 1)]  # w1 runs one trial, w2 the others
        assignment = worker.next()
        assert assignment is not None
        done = worker.call(
            assignment,
            "complete",
            values=[1.0],
            plan=PLAN,
            prediction=_prediction(GIB),
            measured={"peak_allocated_bytes": 2 * GIB},
            duration_s=1.0,
        )
        assert done.status_code == 200
        if number == 0:  # one worker alone does not move the fleet's correction ...
            alone = env.http.get("/calibration", params=query).json()
            assert (alone["scale"], alone["offset_bytes"], alone["n_observations"]) == (1.0, 0, 0)
            # ... but its own run corrects its own predictions
            own = env.http.get("/calibration", params={**query, "worker_id": workers[0].id})
            assert (own.json()["n_observations"], own.json()["offset_bytes"]) == (1, GIB)
            unknown = env.http.get("/calibration", params={**query, "worker_id": 2**30})
            assert unknown.status_code == 404, unknown.text
    calibration = env.http.get("/calibration", params=query).json()
    assert calibration["n_observations"] == 3
    # Measured 1 GiB over each prediction; three runs cannot tell a constant miss from a
    # proportional one, so it is fitted as the offset it was, not as a scale (issue 29).
    assert (calibration["scale"], calibration["offset_bytes"]) == (1.0, GIB)
    other = env.http.get("/calibration", params={**query, "task": "another"}).json()
    assert other["n_observations"] == 0


def test_a_prediction_one_worker_made_comes_with_the_next_assignment_of_its_shape(
    env: Env,
) -> None:
    env.create_study(n_trials=3, task_config={"width": 64})
    maker, twin = env.worker("maker"), env.worker("twin")
    other_card = env.worker("other", model="Sim 16G", total_bytes=16 * GIB)
    first = maker.next()
    assert first is not None and first["predictions"] == []
    config = {"width": 64, **first["params"]}
    shared = {"shape": config, "plan": PLAN, "prediction": _prediction(GIB)}
    started = maker.call(
        first,
        "start",
        plan=PLAN,
        prediction=_prediction(GIB),
        planning_s=1.25,
        prediction_source="worker",
        predictions=[shared, shared],  # a key twice: kept once
    )
    assert started.status_code == 200, started.text
    [trial] = env.page().values()
    assert (trial["planning_s"], trial["prediction_source"]) == (1.25, "worker")
    # The stored predictions are keyed by the whole configuration here (SimWorker registers no
    # shape keys): a trial with other params is another shape, and gets none.
    second = twin.next()
    assert second is not None and second["predictions"] == []
    with env.state.sessions() as session:
        shape = {"width": 64, **second["params"]}
        row = session.get_one(WorkerRow, twin.id)
        study_id = session.get_one(TrialRow, first["trial_id"]).study_id
        study = session.get_one(StudyRow, study_id)
        assert predictions.shared_for(session, row, env.task, shape, study) == []
        [again] = predictions.shared_for(session, row, env.task, config, study)
        assert again.prediction.peak_allocated_bytes == GIB and again.plan.micro_batch is None
        other = session.get_one(WorkerRow, other_card.id)
        assert predictions.shared_for(session, other, env.task, config, study) == [], "card"


def _worker_sharing_by_width(env: Env, name: str) -> SimWorker:
    """A worker that shares `env.task`'s predictions by its width, on a 2-trial study."""
    env.create_study(n_trials=2, search_space={"x": {"type": "categorical", "choices": [1.0]}})
    body = {
        "name": name,
        "device": "cpu",
        "card": {"model": "Sim 8G", "total_bytes": 8 * GIB, "free_bytes": 8 * GIB},
        "tasks": [env.task],
        "shape_params": {env.task: ["width"]},
    }
    worker = SimWorker(env.http, "plain", env.task)
    worker.id = env.http.post("/workers", json=body).json()["worker_id"]
    return worker


def test_an_assignment_carries_the_fleets_predictions_for_its_shape(env: Env) -> None:
    worker = _worker_sharing_by_width(env, "shaped")
    first = worker.next()
    assert first is not None and first["predictions"] == []
    shared = {"shape": {"width": None}, "plan": HALVED, "prediction": _prediction(GIB)}
    started = worker.call(first, "start", plan=HALVED, predictions=[shared])
    assert started.status_code == 200, started.text
    second = worker.next()
    assert second is not None
    assert [p["plan"]["micro_batch"] for p in second["predictions"]] == [8]


def test_predictions_for_other_world_sizes_and_strategies_are_kept_apart(env: Env) -> None:
    """One shape's prediction on one card, on 2 ranks under FSDP2, on 4 under FSDP2 and on 2
    under DDP: four keys, four rows, each handed out with its own per-rank peak (issue 31)."""
    worker = _worker_sharing_by_width(env, "ranked")
    first = worker.next()
    assert first is not None
    plans = [
        PLAN,
        {**PLAN, "world_size": 2, "strategy": "fsdp"},
        {**PLAN, "world_size": 4, "strategy": "fsdp"},
        {**PLAN, "world_size": 2, "strategy": "ddp"},
    ]
    shared = [
        {"shape": {"width": None}, "plan": plan, "prediction": _prediction((n + 1) * GIB)}
        for n, plan in enumerate(plans)
    ]
    started = worker.call(first, "start", plan=PLAN, predictions=shared)
    assert started.status_code == 200, started.text
    second = worker.next()
    assert second is not None
    given = {
        (p["plan"].get("world_size", 1), p["plan"].get("strategy")): p["prediction"]
        for p in second["predictions"]
    }
    assert {ranks: p["peak_allocated_bytes"] // GIB for ranks, p in given.items()} == {
        (1, None): 1,
        (2, "fsdp"): 2,
        (4, "fsdp"): 3,
        (2, "ddp"): 4,
    }


def test_step_time_model_is_fitted_from_the_times_runs_reported(env: Env) -> None:
    env.create_study(n_trials=4)
    model = f"Timed {env.task}"  # a card model of this test only
    worker = env.worker("w1", model=model)
    query = {"card_model": model, "task": env.task}
    own = {**query, "worker_id": worker.id}
    assert env.http.get("/step-time", params=query).json()["n_observations"] == 0
    micro_batches = iter([1, 2, 4, 8])
    while (assignment := worker.next()) is not None:
        n = next(micro_batches)
        step_time = {
            "batch_size": 64,
            "micro_batch": 64 // n,
            "micro_batches": n,
            "as_asked_peak_bytes": GIB,
            "predicted_step_s": 0.1,
            "measured_step_s": 0.1 * n,  # every micro-batch costs a full step on this card
        }
        assert worker.call(assignment, "start", plan=PLAN).status_code == 200
        done = worker.call(
            assignment,
            "complete",
            values=[1.0],
            plan=PLAN,
            prediction=_prediction(GIB),
            measured={"peak_allocated_bytes": GIB},
            duration_s=1.0,
            step_time=step_time,
        )
        assert done.status_code == 200, done.text
    # One worker alone does not teach the fleet (a quorum of two) ...
    assert env.http.get("/step-time", params=query).json()["n_observations"] == 0
    # ... but its own runs time its own plans.
    fit = env.http.get("/step-time", params=own).json()
    assert fit["n_observations"] == 4
    assert fit["overhead_samples"] > 8  # learned: a micro-batch costs more than the fixed model
    attrs = env.trials()[0].user_attrs["vramtune.step_time"]
    assert (attrs["predicted_step_s"], attrs["measured_step_s"]) == (0.1, 0.1)
    bad = env.http.get("/step-time", params={"card_model": model})
    assert bad.status_code == 422 and "task" in bad.text
    unknown = env.http.get("/step-time", params={**query, "worker_id": 2**30})
    assert unknown.status_code == 404, unknown.text


def test_next_offers_only_the_studies_a_limited_token_allows(env: Env) -> None:
    env.create_study()
    other = Env(env.http, env.state, f"{env.study}-other", env.task)
    other.create_study()
    worker = env.worker("limited")

    def next_for(allowed: frozenset[str]) -> Assignment | None:
        body = NextRequest(free_bytes=GIB)
        return next_assignment(env.state, worker.id, body, utcnow(), allowed)

    assert env.http.post(f"/studies/{env.study}/pause").status_code == 200
    assert next_for(frozenset({env.study})) is None  # the other study has work, not for it
    assert env.http.post(f"/studies/{env.study}/resume").status_code == 200
    offered = next_for(frozenset({env.study}))
    assert offered is not None and offered.study == env.study


def test_random_trials_are_asked_ahead_within_the_budget_and_leased_once(env: Env) -> None:
    env.create_study(n_trials=7)
    workers = [env.worker(f"w{i}") for i in range(9)]
    first = [workers[0].next()]
    # Nine live workers: the first next asked four (half of them), leased one, and left the
    # others pending, RUNNING in Optuna, for the next calls.
    assert len(env.trials()) == 4
    first += [worker.next() for worker in workers[1:5]]
    assert len(env.trials()) == 7  # the fifth asked three: what the budget had left
    rest = [worker.next() for worker in workers[5:]]
    leased = [a for a in first + rest if a is not None]
    assert len(leased) == 7 and rest[-2:] == [None, None]  # the budget, not one more
    assert sorted(a["number"] for a in leased) == list(range(7))
    assert len(env.trials()) == 7


def test_an_ask_that_waited_takes_the_trial_another_ask_inserted_meanwhile(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two workers find no pending trial and both draft; the second to reach Optuna's study
    lock leases a trial the first asked ahead, and its own drafts wait as pending trials."""
    env.create_study(n_trials=20)
    early = [env.worker(f"w{i}") for i in range(4)]
    racer, late = env.worker("racer"), env.worker("late")
    # Six live workers: asks of three; the first three nexts leave no trial pending.
    assert all(worker.next() is not None for worker in early[:3])
    raced: list[dict[str, Any] | None] = []

    def draft_while_another_asks(*args: Any, **kwargs: Any) -> list[FrozenTrial]:
        if not raced:  # the racer's whole next (its own server process) runs meanwhile
            raced.append(racer.next())
        return draft_trials(*args, **kwargs)

    monkeypatch.setattr(dispatch, "draft_trials", draft_while_another_asks)
    assignment = next_assignment(env.state, late.id, NextRequest(free_bytes=GIB), utcnow())
    [first] = raced
    assert first is not None and assignment is not None
    # The racer asked three (trials 3 to 5) and leased the first; the late ask leased the
    # next, and inserted its three drafts (6 to 8) for the calls to come.
    assert sorted([first["number"], assignment.number]) == [3, 4]
    assert len(env.trials()) == 9


def _lease_at_once(env: Env, workers: list[SimWorker]) -> list[Assignment | None]:
    """Each worker's `next`, all at once on threads of this process (the server's own)."""

    def lease(worker: SimWorker) -> Assignment | None:
        return next_assignment(env.state, worker.id, NextRequest(free_bytes=GIB), utcnow())

    with ThreadPoolExecutor(len(workers)) as pool:
        return list(pool.map(lease, workers))


def test_concurrent_asks_in_one_process_lease_every_trial_once(env: Env) -> None:
    """Threads of one process that find no pending trial wait for one asker (dispatch._Flight)
    instead of queueing on the study lock; every trial of the budget is leased exactly once."""
    env.create_study(n_trials=12)
    workers = [env.worker(f"w{i}") for i in range(12)]
    leased = _lease_at_once(env, workers)
    assert all(a is not None for a in leased)
    assert sorted(a.number for a in leased if a is not None) == list(range(12))
    assert len({a.trial_id for a in leased if a is not None}) == 12
    assert len(env.trials()) == 12  # the budget, not one more
    assert [worker.next() for worker in workers[:2]] == [None, None]


def test_a_sampler_that_reads_the_study_is_asked_one_trial_at_a_time(env: Env) -> None:
    env.create_study(n_trials=20, sampler={"name": "nsga2", "args": {"seed": 3}})
    for count, worker in enumerate((env.worker(f"w{i}") for i in range(8)), start=1):
        assert worker.next() is not None
        assert len(env.trials()) == count


def test_tpe_asks_one_trial_a_call_and_for_the_asks_that_wait_on_its_asker(env: Env) -> None:
    """TPE asks ahead only for the asks of this process waiting on the study's asker
    (dispatch._Flight; a batch shares one Parzen fit, vramtune.service.optuna.tpe): asks in sequence
    ask one trial each; concurrent ones lease every trial of the budget exactly once."""
    env.create_study(n_trials=12, sampler={"name": "tpe", "args": {"seed": 3}})
    for count, worker in enumerate((env.worker(f"w{i}") for i in range(4)), start=1):
        assert worker.next() is not None
        assert len(env.trials()) == count
    workers = [env.worker(f"c{i}") for i in range(8)]
    leased = _lease_at_once(env, workers)
    assert all(a is not None for a in leased)
    assert sorted(a.number for a in leased if a is not None) == list(range(4, 12))
    trials = env.trials()
    assert [t.number for t in trials] == list(range(12))  # the budget, not one more
    assert all(t.state == TrialState.RUNNING for t in trials)


def test_a_trial_row_from_before_migration_0002_is_leased_with_optunas_params(env: Env) -> None:
    env.create_study(n_trials=1)
    first = env.worker("w1")
    assignment = first.next()
    assert assignment is not None
    with env.state.sessions() as session, session.begin():
        trial = session.get_one(TrialRow, assignment["trial_id"])
        trial.params = None  # as migration 0002 leaves the rows it found
    interrupted = first.call(assignment, "fail", kind="interrupted", message="test")
    assert interrupted.status_code == 200  # offered again
    again = env.worker("w2").next()
    assert again is not None and again["trial_id"] == assignment["trial_id"]
    assert again["params"] == assignment["params"] == env.trials()[0].params


def test_a_heartbeat_renews_only_the_leases_of_the_trials_the_worker_lists(env: Env) -> None:
    env.create_study(n_trials=2)
    worker = env.worker("w1")
    running, lost = worker.next(), worker.next()  # as if the second answer never arrived
    assert running is not None and lost is not None
    time.sleep(0.05)  # the renewed expiry must be later than the granted one
    body = {"free_bytes": GIB, "trials": [running["trial_id"]]}
    assert env.http.post(f"/workers/{worker.id}/heartbeat", json=body).status_code == 200
    with env.state.sessions() as session:
        expiry = dict(session.execute(select(LeaseRow.trial_id, LeaseRow.expires_at)).all())

    def granted(assignment: dict[str, Any]) -> datetime:  # the wire's UTC, as stored (naive)
        return datetime.fromisoformat(assignment["lease_expires_at"]).replace(tzinfo=None)

    assert expiry[running["trial_id"]] > granted(running)
    assert expiry[lost["trial_id"]] == granted(lost)
    reap_once(env.state, utcnow() + LATER)  # both expire eventually; the lost one is offered
    offered = env.worker("w2").next()
    assert offered is not None and offered["trial_id"] in (running["trial_id"], lost["trial_id"])


def test_heartbeats_sent_together_each_get_their_own_answer(env: Env) -> None:
    """Heartbeats that share a batch (service.heartbeats): each renews its own worker's lease
    and gets its own answer, 404 and 409 included, whatever the others of the batch are."""
    env.create_study(n_trials=4)
    workers = [env.worker(f"batch{i}") for i in range(4)]
    held = [worker.next() for worker in workers]
    assert all(held)
    gone = env.worker("gone")
    assert env.http.post(f"/workers/{gone.id}/stop").status_code == 204
    assert env.http.post(f"/studies/{env.study}/pause").status_code == 200
    calls = [(w.id, {"trials": [a["trial_id"]]}) for w, a in zip(workers, held, strict=True)]
    calls += [(gone.id, {}), (MAX_ROW_ID, {})]
    with ThreadPoolExecutor(len(calls)) as pool:
        answers = list(
            pool.map(lambda c: env.http.post(f"/workers/{c[0]}/heartbeat", json=c[1]), calls)
        )
    assert [a.status_code for a in answers] == [200] * 4 + [409, 404]
    for answer, assignment in zip(answers, held, strict=False):
        assert answer.json()["stop"] == [{"trial_id": assignment["trial_id"], "reason": "paused"}]


def test_a_listed_trial_whose_lease_was_reaped_is_ordered_stopped_at_every_heartbeat(
    env: Env,
) -> None:
    env.create_study()
    worker = env.worker("listing")
    held = worker.next()
    assert held is not None
    reap_once(env.state, utcnow() + LATER)
    body = {"trials": [held["trial_id"]]}
    for _ in range(2):  # as long as the worker lists it, not only once
        beat = env.http.post(f"/workers/{worker.id}/heartbeat", json=body)
        assert beat.json()["stop"] == [{"trial_id": held["trial_id"], "reason": "lease_lost"}]
    assert env.http.post(f"/workers/{worker.id}/heartbeat", json={"trials": []}).json() == {
        "stop": []
    }


def test_a_lease_past_its_expiry_is_held_until_the_reaper_ends_it(env: Env) -> None:
    """Expiry is the reaper's to decide (it counts only time it could see the database): a
    result delivered after the expiry but before the reaper's pass is told, not refused."""
    env.create_study()
    worker = env.worker("late")
    held = worker.next()
    assert held is not None
    with env.state.sessions.begin() as session:
        lease = session.scalar(select(LeaseRow).where(LeaseRow.token == held["lease"]))
        assert lease is not None
        lease.expires_at = utcnow() - timedelta(seconds=1)
    assert worker.complete(held, 2.0).status_code == 200
    assert [(t.state, t.value) for t in env.trials()] == [(TrialState.COMPLETE, 2.0)]


def _last_heard(env: Env, worker: SimWorker, ago_s: float | None = None) -> datetime:
    """The worker's last_heartbeat; first set ``ago_s`` seconds in the past, if given."""
    with env.state.sessions.begin() as session:
        row = session.get_one(WorkerRow, worker.id)
        if ago_s is not None:
            row.last_heartbeat = utcnow() - timedelta(seconds=ago_s)
        return row.last_heartbeat


def test_next_and_complete_count_as_hearing_from_a_worker(env: Env) -> None:
    """A worker that calls but never heartbeats stays live: its next and its trial calls stamp
    it once half the stale window (30 s by default) has passed; sooner, nothing is written."""
    env.create_study(n_trials=3)
    worker = env.worker("silent")
    silent_since = _last_heard(env, worker, ago_s=40)  # stale: nothing heard for 40 s
    assert worker.out()["state"] == "stale"
    assignment = worker.next()
    assert assignment is not None
    heard = _last_heard(env, worker)
    assert heard > silent_since and worker.out()["state"] == "live"
    assert worker.call(assignment, "start", plan=PLAN).status_code == 200
    assert _last_heard(env, worker) == heard  # heard from 0 s ago: no write
    recently = _last_heard(env, worker, ago_s=5)
    assert worker.complete(assignment, 1.0).status_code == 200
    assert _last_heard(env, worker) == recently  # within half the window: unchanged
    _last_heard(env, worker, ago_s=20)  # past half the window, not stale yet
    assert worker.complete(assignment, 1.0).status_code == 200  # a replay is a call too
    assert (utcnow() - _last_heard(env, worker)).total_seconds() < 5
    assert worker.out()["state"] == "live"


def test_an_offload_plan_is_recorded_and_a_bad_one_names_its_field(env: Env) -> None:
    env.create_study()
    worker = env.worker("gpu", 4 * GIB, "Sim 4G")
    held = worker.next()
    assert held is not None
    wrong = worker.call(held, "start", plan={"activation_offload": "sometimes"})
    assert wrong.status_code == 422, wrong.text
    locs = [".".join(map(str, error["loc"])) for error in wrong.json()["detail"]]
    assert any(loc.endswith("plan.activation_offload") for loc in locs), locs
    plan = {"micro_batch": 1, "accumulation": 2, "optimizer_offload": True}
    done = worker.call(
        held, "complete", values=[1.0], plan=plan, duration_s=1.0,
        measured={"peak_allocated_bytes": GIB}, prediction=_prediction(GIB),
    )  # fmt: skip
    assert done.status_code == 200, done.text
    shown = env.page()[held["trial_id"]]["plan"]
    assert shown["optimizer_offload"] is True and "activation_offload" not in shown
