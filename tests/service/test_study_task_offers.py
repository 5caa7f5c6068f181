"""Issue 29 item 6: a study is checked against what the fleet's workers registered.

A search space lacking the task's batch parameter (as a worker registered it) is a 422 naming
it, and nothing is written; a task no live worker offers is accepted with a warning, in the
create response and in `GET /studies/NAME`. SQLite and PostgreSQL, over a real uvicorn server.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import optuna
import pytest
from optuna.storages import RDBStorage
from sqlalchemy import create_engine, func, select

from vramtune.service.db.tables import StudyRow
from vramtune.service.testing import (
    fresh_postgres_database,
    server_factory,
    sqlite_url,
    upgrade_database,
)

STALE_S = 2.0


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A migrated database for this module on one backend."""
    if request.param == "sqlite":
        yield upgrade_database(sqlite_url(tmp_path_factory.mktemp("db")))
        return
    with fresh_postgres_database() as pg_url:
        yield upgrade_database(pg_url)


@pytest.fixture(scope="module")
def api(url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    """An HTTP client of a real `vramtune serve` whose workers go stale after STALE_S."""
    with server_factory(tmp_path_factory.mktemp("logs")) as start:
        server = start(url, worker_stale_s=STALE_S)
        with httpx.Client(base_url=server.url + "/api/v1/", timeout=30) as client:
            yield client


def register(api: httpx.Client, task: str, batch_param: str | None) -> int:
    """Register a CPU worker advertising `task` (and its batch parameter, when given)."""
    body: dict[str, Any] = {
        "name": f"w-{uuid.uuid4().hex[:6]}",
        "device": "cpu",
        "card": {"model": "cpu", "total_bytes": 2**26, "free_bytes": 2**26},
        "tasks": [task],
        "batch_params": {task: batch_param} if batch_param else {},
    }
    response = api.post("workers", json=body)
    assert response.status_code == 201, response.text
    return int(response.json()["worker_id"])


def study(task: str, space: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    """A study spec of `task` over `space` with a unique name."""
    body = {"name": f"s-{uuid.uuid4().hex[:10]}", "task": task, "search_space": space}
    return body | overrides


WIDTH = {"width": {"type": "int", "low": 8, "high": 64}}
BATCH = {"batch_size": {"type": "categorical", "choices": [8, 16]}}


def unique_task() -> str:
    return f"task-{uuid.uuid4().hex[:8]}"


def test_missing_batch_param_is_422_naming_it_and_writes_nothing(
    api: httpx.Client, url: str
) -> None:
    task = unique_task()
    register(api, task, "batch_size")
    body = study(task, WIDTH)
    response = api.post("studies", json=body)
    assert response.status_code == 422, response.text
    (error,) = response.json()["detail"]
    assert error["loc"] == ["body", "search_space", "batch_size"]
    assert "'batch_size'" in error["msg"]
    engine = create_engine(url)
    with engine.connect() as connection:
        count = connection.scalar(
            select(func.count()).select_from(StudyRow).where(StudyRow.name == body["name"])
        )
    engine.dispose()
    assert count == 0
    storage = RDBStorage(url)
    assert body["name"] not in optuna.study.get_all_study_names(storage=storage)
    storage.engine.dispose()


def test_batch_param_in_space_or_task_config_is_accepted(api: httpx.Client) -> None:
    task = unique_task()
    register(api, task, "batch_size")
    in_space = api.post("studies", json=study(task, WIDTH | BATCH))
    assert in_space.status_code == 201, in_space.text
    fixed = api.post("studies", json=study(task, WIDTH, task_config={"batch_size": 32}))
    assert fixed.status_code == 201, fixed.text
    assert in_space.json()["warnings"] == fixed.json()["warnings"] == []


def test_the_newest_registration_names_the_batch_param(api: httpx.Client) -> None:
    task = unique_task()
    register(api, task, "batch_size")
    register(api, task, "bs")  # the task's newer version renamed it
    response = api.post("studies", json=study(task, WIDTH | BATCH))
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["loc"] == ["body", "search_space", "bs"]


def test_unknown_batch_param_is_not_guessed(api: httpx.Client) -> None:
    task = unique_task()
    register(api, task, None)  # an older worker that does not send batch_params
    response = api.post("studies", json=study(task, WIDTH))
    assert response.status_code == 201, response.text


def test_task_no_worker_offers_is_accepted_with_a_warning(api: httpx.Client) -> None:
    task = unique_task()
    created = api.post("studies", json=study(task, WIDTH))
    assert created.status_code == 201, created.text
    (warning,) = created.json()["warnings"]
    assert f"no live worker offers task {task!r}" in warning
    shown = api.get(f"studies/{created.json()['name']}").json()
    assert shown["warnings"] == [warning]


def test_warning_follows_the_live_fleet(api: httpx.Client) -> None:
    task = unique_task()
    name = api.post("studies", json=study(task, WIDTH)).json()["name"]
    worker_id = register(api, task, None)
    assert api.get(f"studies/{name}").json()["warnings"] == []
    assert api.post(f"workers/{worker_id}/stop").status_code == 204
    (warning,) = api.get(f"studies/{name}").json()["warnings"]
    assert task in warning


def test_a_misspelt_task_gets_did_you_mean_when_a_live_worker_offers_a_close_name(
    api: httpx.Client,
) -> None:
    """Issue 43 item 10: accepted (a worker with the very name may come later), with a warning
    that names the live worker's close task; no guess when nothing is close."""
    task = unique_task()
    worker_id = register(api, task, None)
    misspelt = task[:-1] + ("x" if task[-1] != "x" else "y")
    created = api.post("studies", json=study(misspelt, WIDTH))
    assert created.status_code == 201, created.text
    (warning,) = created.json()["warnings"]
    assert f"no live worker offers task {misspelt!r}" in warning
    assert warning.endswith(f"did you mean {task!r}?"), warning
    far = api.post("studies", json=study("zzzzzzzz-" + uuid.uuid4().hex[:6], WIDTH))
    assert "did you mean" not in far.json()["warnings"][0]
    assert api.post(f"workers/{worker_id}/stop").status_code == 204
