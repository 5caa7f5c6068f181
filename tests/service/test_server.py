"""Server start-up, migrations and error translation on SQLite and PostgreSQL."""

from __future__ import annotations

import signal
from datetime import datetime
from pathlib import Path

import httpx
import optuna
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, inspect
from sqlalchemy.orm import Session

from vramtune.service.api.errors import install_error_handlers
from vramtune.service.app import create_app
from vramtune.service.db.migrate import VERSION_TABLE, NotMigrated, head_revision
from vramtune.service.db.tables import Base, StudyRow
from vramtune.service.settings import Settings
from vramtune.service.testing import (
    IN_PROCESS_HOSTS,
    ServerFactory,
    free_port,
    fresh_postgres_database,
    run_vramtune,
    sqlite_url,
    upgrade_database,
)

optuna.logging.set_verbosity(optuna.logging.WARNING)


def test_serve_refuses_an_unmigrated_database(database_url: str) -> None:
    result = run_vramtune("serve", "--database-url", database_url, "--port", str(free_port()))
    assert result.returncode == 2
    assert "not migrated" in result.stderr
    assert "vramtune db upgrade" in result.stderr
    app = create_app(Settings(database_url=database_url))
    with pytest.raises(NotMigrated, match="vramtune db upgrade"), TestClient(app):
        pass


def test_refusing_an_unmigrated_sqlite_file_leaves_nothing_behind(tmp_path: Path) -> None:
    """No database file, nor its -wal / -shm, is created by a serve or a token command that
    refuses to use it."""
    url = sqlite_url(tmp_path / "data")
    (tmp_path / "data").mkdir()
    serve = run_vramtune("serve", "--database-url", url, "--port", str(free_port()))
    token = run_vramtune("token", "list", "--database-url", url)
    assert serve.returncode == 2 and "no file at" in serve.stderr, serve.stderr
    assert token.returncode != 0 and "vramtune db upgrade" in token.stderr, token.stderr
    assert list((tmp_path / "data").iterdir()) == []


def test_db_upgrade_creates_both_schemas_and_is_idempotent(database_url: str) -> None:
    upgrade_database(database_url)
    upgrade_database(database_url)  # a second run changes nothing and does not fail
    engine = create_engine(database_url)
    try:
        tables = set(inspect(engine).get_table_names())
        assert set(Base.metadata.tables) <= tables
        assert {"studies", "trials", "alembic_version", VERSION_TABLE} <= tables  # Optuna's too
        with engine.connect() as connection:
            version = connection.exec_driver_sql(f"SELECT version_num FROM {VERSION_TABLE}")
            assert [row[0] for row in version] == [head_revision()]
    finally:
        engine.dispose()
    optuna.create_study(study_name="plain", storage=database_url)  # Optuna accepts the schema


def test_a_failed_row_insert_leaves_no_optuna_study(migrated_url: str) -> None:
    """A vramtune row that cannot be written undoes the Optuna study; the client gets a bare 500."""
    storage = optuna.storages.RDBStorage(migrated_url)
    probe = optuna.create_study(study_name="probe", storage=storage)
    next_id = probe._study_id + 1
    engine = create_engine(migrated_url)
    with Session(engine) as session, session.begin():  # a stale row holding Optuna's next id
        stale = StudyRow(
            study_id=next_id, name="stale", task="t", spec={}, created_at=datetime(2026, 1, 1)
        )
        session.add(stale)
    engine.dispose()
    app = create_app(
        Settings(database_url=migrated_url, auth="off", allowed_hosts=IN_PROCESS_HOSTS)
    )
    body = {
        "name": "doomed",
        "task": "t",
        "search_space": {"x": {"type": "float", "low": 0, "high": 1}},
    }
    with TestClient(app, raise_server_exceptions=False) as client:
        response = client.post("/api/v1/studies", json=body)
    assert response.status_code == 500
    assert response.json() == {"detail": "internal server error"}
    assert "doomed" not in [s.study_name for s in storage.get_all_studies()]
    storage.engine.dispose()


def test_a_database_that_goes_away_gives_503() -> None:
    with fresh_postgres_database() as url:
        upgrade_database(url)
        client = TestClient(
            create_app(Settings(database_url=url, auth="off", allowed_hosts=IN_PROCESS_HOSTS)),
            raise_server_exceptions=False,
        )
        client.__enter__()
    try:
        health = client.get("/api/v1/health")  # the database was dropped under the server
        assert health.status_code == 503
        assert "database unavailable" in health.json()["detail"]
        listing = client.get("/api/v1/studies")
        assert listing.status_code == 503
        assert listing.json() == {"detail": "database unavailable; retry later"}
    finally:
        client.__exit__(None, None, None)


def test_unexpected_errors_are_a_bare_500() -> None:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    def boom() -> None:
        raise RuntimeError("secret internals")

    response = TestClient(app, raise_server_exceptions=False).get("/boom")
    assert response.status_code == 500
    assert response.json() == {"detail": "internal server error"}
    assert "secret" not in response.text


def test_server_process_restarts_on_its_port(tmp_path: Path, start_server: ServerFactory) -> None:
    server = start_server(upgrade_database(sqlite_url(tmp_path)), log_level="debug")
    assert httpx.get(f"{server.url}/api/v1/health").json() == {"status": "ok"}
    url = server.url
    server.restart()
    assert server.url == url
    assert httpx.get(f"{url}/api/v1/health").json() == {"status": "ok"}
    assert server.kill() == -signal.SIGKILL
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/api/v1/health")
