"""schemathesis against the service's own OpenAPI: no 5xx, and every answer matches the schema.

In-process over ASGI with VRAMTUNE_AUTH=off on a migrated SQLite database; a bounded,
derandomized number of examples per operation keeps it to about a minute in CI.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck, Phase, settings
from schemathesis.checks import not_a_server_error, response_schema_conformance
from security_fixtures import migrated_sqlite, study_spec

from vramtune.service.app import create_app
from vramtune.service.settings import Settings
from vramtune.service.testing import IN_PROCESS_HOSTS

EXAMPLES_PER_OPERATION = 8


@pytest.fixture(scope="module")
def fuzzed_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FastAPI]:
    """The app on a database holding one study, so some generated names hit something."""
    from fastapi.testclient import TestClient

    url = migrated_sqlite(Path(tmp_path_factory.mktemp("fuzz")))
    with TestClient(
        create_app(Settings(database_url=url, auth="off", allowed_hosts=IN_PROCESS_HOSTS))
    ) as client:
        assert client.post("/api/v1/studies", json=study_spec("a")).status_code == 201
    yield create_app(Settings(database_url=url, auth="off", allowed_hosts=IN_PROCESS_HOSTS))


# The document needs no database (create_app connects nothing); the calls go to fuzzed_app.
schema = schemathesis.openapi.from_dict(create_app(Settings(database_url="sqlite://")).openapi())


@schema.parametrize()
@settings(
    max_examples=EXAMPLES_PER_OPERATION,
    deadline=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)
def test_no_server_error_and_schema_conformance(
    fuzzed_app: FastAPI,
    case: schemathesis.Case,  # type: ignore[type-arg]
) -> None:
    """Whatever the fuzzer sends, the answer is not a 5xx and matches the documented schema."""
    response = case.call(app=fuzzed_app)
    case.validate_response(response, checks=[not_a_server_error, response_schema_conformance])
    assert "Traceback" not in response.text
