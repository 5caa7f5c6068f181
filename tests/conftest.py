"""Shared fixtures: databases (SQLite and PostgreSQL), migrated URLs, real server processes.

The helpers behind them (ServerProcess, fresh_postgres_database, upgrade_database, ...) live in
vramtune/service/testing.py so that tests can build module-scoped variants.
"""

from __future__ import annotations

import os
import signal
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from vramtune.service.testing import (
    IN_PROCESS_HOSTS,
    ServerFactory,
    fresh_postgres_database,
    server_factory,
    sqlite_url,
    upgrade_database,
)

if TYPE_CHECKING:
    from fastapi.testclient import TestClient


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A fresh PostgreSQL database on 127.0.0.1:5432, dropped (connections ended) after."""
    with fresh_postgres_database() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty database: a SQLite file in tmp_path, or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return sqlite_url(tmp_path)
    return str(request.getfixturevalue("postgres_url"))


@pytest.fixture
def migrated_url(database_url: str) -> str:
    """database_url after `vramtune db upgrade` (run as a subprocess)."""
    return upgrade_database(database_url)


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[ServerFactory]:
    """start_server(url, **env) -> ServerProcess; keys like lease_ttl_s=2 become VRAMTUNE_*."""
    with server_factory(tmp_path) as start:
        yield start


@pytest.fixture
def app_client(migrated_url: str) -> Iterator[TestClient]:
    """An in-process TestClient of create_app on migrated_url, lifespan running."""
    from fastapi.testclient import TestClient

    from vramtune.service.app import create_app
    from vramtune.service.settings import Settings

    with TestClient(
        create_app(Settings(database_url=migrated_url, auth="off", allowed_hosts=IN_PROCESS_HOSTS))
    ) as client:
        yield client


# Marks the processes this test session starts (they inherit the environment), so that the
# check below never touches another session's workers on the same machine.
SESSION_MARK = f"VRAMTUNE_TEST_SESSION={os.getpid()}"
os.environ["VRAMTUNE_TEST_SESSION"] = str(os.getpid())


def _worker_pids() -> set[int]:
    """This session's worker processes (`... worker --server ...`), read from /proc."""
    pids = set()
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            ours = b"worker" in argv and b"--server" in argv
            if ours and SESSION_MARK.encode() in (entry / "environ").read_bytes().split(b"\0"):
                pids.add(int(entry.name))
        except OSError:
            continue  # it ended while we looked, or is not ours to read
    return pids


@pytest.fixture(scope="module", autouse=True)
def no_worker_outlives_its_module(request: pytest.FixtureRequest) -> Iterator[None]:
    """A worker whose server is gone retries for ever, and reached a later test's server once
    when the OS gave it the old port (CI): kill any the module's tests left, and say which."""
    before = _worker_pids()
    yield
    deadline = time.monotonic() + 15
    while (left := _worker_pids() - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
    if left:
        module = request.node.nodeid
        warnings.warn(f"{len(left)} worker process(es) outlived {module}; killed", stacklevel=1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the heavy fault/load suite so that -m can pick it; run the fleet's end-to-end tests
    on PostgreSQL only where the database matters (marked ``both_databases``)."""
    for item in items:
        if "reliability" in item.path.parts:
            item.add_marker(pytest.mark.reliability)
    sqlite_only = [item for item in items if _postgres_fleet_not_needed(item)]
    if sqlite_only:
        config.hook.pytest_deselected(items=sqlite_only)
        items[:] = [item for item in items if not _postgres_fleet_not_needed(item)]


def _postgres_fleet_not_needed(item: pytest.Item) -> bool:
    """An end-to-end test on the PostgreSQL fleet whose subject is not the database (a task
    kind, a rung, packing...): its SQLite run tests the same code at half the suite's cost."""
    callspec = getattr(item, "callspec", None)
    on_postgres = callspec is not None and callspec.params.get("fleet_server") == "postgresql"
    return on_postgres and item.get_closest_marker("both_databases") is None
