"""Issue 49: objective values that are not finite read through REST, the client and the dashboard.

JSON has no infinity nor NaN; the wire says them "Infinity", "-Infinity" and "NaN"
(vramtune.service.wire.ObjectiveValue), never null. The trials are told through plain Optuna on the
server's database (tell_non_finite), as a user's own objective tells them: no worker runs the
study's task.
"""

from __future__ import annotations

import math
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import Studies, tell_non_finite
from vramtune.service.app import create_app
from vramtune.service.settings import Settings
from vramtune.service.testing import ServerProcess
from vramtune.service.wire import NON_FINITE

# The database is part of what this tests: it runs on SQLite and PostgreSQL (tests/conftest.py).
pytestmark = pytest.mark.both_databases

SPACE = {"x": {"type": "float", "low": 0.0, "high": 1.0}}
# Trial by trial: told +inf, -inf, NaN (Optuna fails it), 1.5.
VALUES = [["Infinity"], ["-Infinity"], None, [1.5]]
STATES = ["COMPLETE", "COMPLETE", "FAIL", "COMPLETE"]
REPORTS = ["NaN", "Infinity", "-Infinity", 0.5]  # trial 0's intermediate values


def get(server: ServerProcess, path: str, **params: Any) -> Any:
    """A GET of the API, as JSON (the 200 asserted)."""
    response = httpx.get(f"{server.url}/api/v1{path}", params=params, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def test_non_finite_values_read_through_rest_the_client_and_the_dashboard(
    fleet_server: ServerProcess, studies: Studies
) -> None:
    name = studies.create(SPACE, task="told-by-optuna", n_trials=4)
    tell_non_finite(fleet_server.database_url, name)

    rest = get(fleet_server, f"/studies/{name}/trials")["trials"]
    assert [t["state"] for t in rest] == STATES
    assert [t["values"] for t in rest] == VALUES
    assert list(rest[0]["intermediate"].values()) == REPORTS
    assert get(fleet_server, f"/studies/{name}")["best_value"] == "-Infinity"

    trials = studies.trials(name)  # the client reads them back as floats
    assert [t.values for t in trials] == [[math.inf], [-math.inf], None, [1.5]]
    assert math.isnan(trials[0].intermediate[0])
    assert list(trials[0].intermediate.values())[1:] == [math.inf, -math.inf, 0.5]
    assert studies.summary(name).best_value == -math.inf
    assert [t.number for t in studies.client.best(name).trials] == [1]

    dashboard = f"/dashboard/studies/{name}"
    rows = get(fleet_server, f"{dashboard}/trials", sort="number")["rows"]
    assert [r["values"] for r in rows] == VALUES
    assert get(fleet_server, f"{dashboard}/trials/0")["intermediate_values"] == REPORTS
    assert get(fleet_server, dashboard)["best"]["values"] == ["-Infinity"]
    listed = get(fleet_server, "/dashboard/studies")["studies"]
    assert next(s for s in listed if s["name"] == name)["best_value"] == "-Infinity"


def test_the_openapi_schema_states_how_non_finite_values_travel() -> None:
    schemas = create_app(Settings(database_url="sqlite://")).openapi()["components"]["schemas"]
    trial, row = schemas["TrialOut"]["properties"], schemas["TrialRowOut"]["properties"]
    for field in (
        trial["values"],
        trial["intermediate"],
        schemas["StudySummary"]["properties"]["best_value"],
        row["values"],
        schemas["TrialDetail"]["properties"]["intermediate_values"],
        schemas["StudyListItem"]["properties"]["best_value"],
    ):
        assert states_non_finite(field), field


def states_non_finite(schema: Any) -> bool:
    """Whether a JSON schema allows the strings "Infinity", "-Infinity" and "NaN" somewhere."""
    if isinstance(schema, dict):
        if schema.get("type") == "string" and schema.get("enum") == list(NON_FINITE):
            return True
        return any(map(states_non_finite, schema.values()))
    return isinstance(schema, list) and any(map(states_non_finite, schema))
