"""Property: whatever a second token sends to the worker protocol, with the first token's ids,
lease tokens and bodies, nothing the first token owns changes (issue 47).

In-process (auth on, SQLite): token V's worker holds a started lease; Hypothesis drives every
worker-facing endpoint as token A (heartbeat, next, stop, start, report, complete, fail,
hand back, calibration, step time), addressing V's worker, V's trial and V's lease as well as
A's own and made-up ones, and after each call V's worker row, its leases, its trial row and
the trial in Optuna read exactly as before. Derandomized and bounded (~10 s).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings, strategies as st
from security_fixtures import OWN, Secured, migrated_sqlite
from sqlalchemy import select

from vramtune.service.db.tables import LeaseRow, TrialRow, WorkerRow
from vramtune.service.settings import Settings

API = "/api/v1"
PLAN = {"micro_batch": None, "accumulation": 1, "checkpointing": False, "bf16": False}
MEASURED = {"peak_allocated_bytes": 2**20, "peak_reserved_bytes": 2**20}
CARD = {"model": "Sim", "total_bytes": 2**33, "free_bytes": 2**33, "torch_version": "2.13"}


@dataclass
class Pair:
    """The app, the victim's worker with its started lease, and the attacker's worker."""

    secured: Secured
    victim: dict[str, str]
    attacker: dict[str, str]
    victim_worker: int
    attacker_worker: int
    trial_id: int
    lease: str


def _register(client: TestClient, headers: dict[str, str]) -> int:
    body = {"name": "w", "device": "cpu", "card": CARD, "tasks": ["quadratic"]}
    response = client.post(f"{API}/workers", json=body, headers=headers)
    assert response.status_code == 201, response.text
    return int(response.json()["worker_id"])


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """Leases that outlive the run (no reaper interferes); V holds a started lease of OWN."""
    from vramtune.service.app import create_app

    url = migrated_sqlite(Path(tmp_path_factory.mktemp("isolation")))
    settings = Settings(database_url=url, auth="on", lease_ttl_s=3600, worker_stale_s=3600)
    app = create_app(settings)
    with TestClient(app) as client:
        secured = Secured(app, client, url)
        secured.tokens["admin"] = secured.add_token(["admin"])[1]
        secured.ensure_studies()
        victim = {"Authorization": f"Bearer {secured.add_token(['worker'])[1]}"}
        attacker = {"Authorization": f"Bearer {secured.add_token(['worker'])[1]}"}
        victim_worker = _register(client, victim)
        attacker_worker = _register(client, attacker)
        leased = client.post(
            f"{API}/workers/{victim_worker}/next", json={"free_bytes": 2**33}, headers=victim
        )
        assert leased.status_code == 200, leased.text
        assignment = leased.json()
        assert assignment["study"] == OWN
        trial_id, lease = int(assignment["trial_id"]), str(assignment["lease"])
        started = client.post(
            f"{API}/trials/{trial_id}/start", json={"lease": lease, "plan": PLAN}, headers=victim
        )
        assert started.status_code == 200, started.text
        yield Pair(secured, victim, attacker, victim_worker, attacker_worker, trial_id, lease)


def owned_by_victim(pair: Pair) -> dict[str, Any]:
    """Everything of V's the attacker might change: its worker row, its leases, its trial's
    row and the trial in Optuna."""
    state = pair.secured.app.state.vt
    with state.sessions() as session:
        worker = session.get_one(WorkerRow, pair.victim_worker)
        leases = session.scalars(select(LeaseRow).where(LeaseRow.worker_id == worker.id)).all()
        trial = session.get_one(TrialRow, pair.trial_id)
        rows = [worker, *leases, trial]
        columns = [
            {c.key: getattr(row, c.key) for c in row.__mapper__.column_attrs} for row in rows
        ]
    frozen = state.storage.get_trial(pair.trial_id)
    optuna = (frozen.state, frozen.values, frozen.intermediate_values, frozen.user_attrs)
    return {"rows": columns, "optuna": optuna}


VERBS = ["start", "report", "complete", "fail", "handback"]
WORKER_CALLS = ["heartbeat", "next", "stop"]


def trial_body(verb: str, lease: str) -> dict[str, Any]:
    """A well-formed body of a trial call, so that it reaches the route's own checks."""
    bodies: dict[str, dict[str, Any]] = {
        "start": {"plan": PLAN},
        "report": {"step": 1, "value": 0.5},
        "complete": {"values": [0.25], "plan": PLAN, "measured": MEASURED, "duration_s": 1},
        "fail": {"kind": "oom", "message": "boom", "measured": MEASURED},
        "handback": {"min_footprint_bytes": 2**40},
    }
    return {"lease": lease, **bodies[verb]}


@st.composite
def attacks(draw: st.DrawFn, pair: Pair) -> tuple[str, str, dict[str, Any] | None, dict[str, str]]:
    """(method, path, body, query) of one call token A makes."""
    worker = draw(st.sampled_from([pair.victim_worker, pair.attacker_worker, 2**31 - 1]))
    trial = draw(st.sampled_from([pair.trial_id, pair.trial_id + 1, 2**31 - 1]))
    lease = draw(st.sampled_from([pair.lease, "x" * 16, pair.lease[::-1]]))
    kind = draw(st.sampled_from(["worker", "trial", "fit"]))
    if kind == "worker":
        call = draw(st.sampled_from(WORKER_CALLS))
        listed = draw(st.sampled_from([None, [pair.trial_id], [pair.trial_id, 0]]))
        body: dict[str, Any] | None = {
            "heartbeat": {"free_bytes": 2**30, "trials": listed},
            "next": {"free_bytes": 2**30},
            "stop": None,
        }[call]
        return "POST", f"{API}/workers/{worker}/{call}", body, {}
    if kind == "trial":
        verb = draw(st.sampled_from(VERBS))
        return "POST", f"{API}/trials/{trial}/{verb}", trial_body(verb, lease), {}
    path = draw(st.sampled_from(["calibration", "step-time"]))
    query = {"card_model": "Sim", "torch_version": "2.13", "task": "quadratic"}
    query["worker_id"] = str(worker)
    if draw(st.booleans()):
        query["study"] = OWN
    return "GET", f"{API}/{path}", None, query


def test_a_second_token_changes_nothing_the_first_owns(pair: Pair) -> None:
    """Every call of token A leaves V's worker, leases, trial row and Optuna trial as they
    were, and is never a 5xx; V's own trial still completes afterwards."""
    before = owned_by_victim(pair)
    client = pair.secured.client

    @given(attack=attacks(pair))
    @settings(
        max_examples=60,
        deadline=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    def one_call(attack: tuple[str, str, dict[str, Any] | None, dict[str, str]]) -> None:
        method, path, body, query = attack
        response = client.request(method, path, json=body, params=query, headers=pair.attacker)
        assert response.status_code < 500, (path, response.text)
        assert owned_by_victim(pair) == before, (method, path, body, query, response.text)

    one_call()
    done = client.post(
        f"{API}/trials/{pair.trial_id}/complete",
        json=trial_body("complete", pair.lease),
        headers=pair.victim,
    )
    assert done.status_code == 200 and done.json()["resolution"] == "complete", done.text
