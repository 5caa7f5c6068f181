"""Shared fixtures: databases (SQLite and PostgreSQL), migrated URLs, real server processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

if TYPE_CHECKING:
    from fastapi.testclient import TestClient

PG_ADMIN_DSN = os.environ.get("VRAMTUNE_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
SERVER_START_LIMIT_S = 60.0
REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- databases


@contextmanager
def fresh_postgres_database() -> Iterator[str]:
    """A new, empty PostgreSQL database as a postgresql+psycopg:// URL, dropped afterwards."""
    import psycopg

    name = f"vt_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    base = PG_ADMIN_DSN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1)
    try:
        yield f"{base}/{name}"
    finally:
        with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as admin:
            # FORCE terminates the connections a server or pool still holds.
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def sqlite_url(directory: Path) -> str:
    """A SQLite database file in a directory."""
    return f"sqlite:///{directory / 'vramtune.db'}"


def run_vramtune(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run `python -m service ARGS` as a subprocess and capture its output."""
    return subprocess.run(
        [sys.executable, "-m", "service", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=REPO,
    )


def upgrade_database(url: str) -> str:
    """`vramtune db upgrade` on a URL (as a subprocess); returns the URL."""
    result = run_vramtune("db", "upgrade", "--database-url", url)
    assert result.returncode == 0, f"db upgrade failed:\n{result.stdout}\n{result.stderr}"
    return url


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A fresh PostgreSQL database on 127.0.0.1:5432, dropped after the test."""
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
    """database_url after `vramtune db upgrade`."""
    return upgrade_database(database_url)


# ---------------------------------------------------------------- servers


def free_port() -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _env_name(key: str) -> str:
    """lease_ttl_s -> VRAMTUNE_LEASE_TTL_S; names already prefixed pass through."""
    return key if key.startswith("VRAMTUNE_") or key.isupper() else f"VRAMTUNE_{key.upper()}"


class ServerProcess:
    """`python -m service serve` as a real subprocess on a free port."""

    def __init__(self, database_url: str, log_path: Path, env: dict[str, str]) -> None:
        self.database_url = database_url
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.env = env
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> ServerProcess:
        """Start the server and wait until /api/v1/health answers ok."""
        command = [sys.executable, "-m", "service", "serve", "--host", "127.0.0.1"]
        command += ["--port", str(self.port), "--database-url", self.database_url]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                cwd=REPO,
            )
        self._wait_healthy()
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + SERVER_START_LIMIT_S
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.logs()}")
            try:
                if httpx.get(f"{self.url}/api/v1/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server not healthy after {SERVER_START_LIMIT_S} s:\n{self.logs()}")

    def logs(self) -> str:
        """Everything the server wrote so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout: float = 20) -> int | None:
        """SIGTERM (graceful shutdown), SIGKILL if it does not exit in time."""
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return self.kill()

    def kill(self) -> int | None:
        """SIGKILL: the server dies without shutting down."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.kill()
        return self.process.wait()

    def restart(self) -> ServerProcess:
        """Stop, then start again on the same port (so .url stays valid)."""
        self.stop()
        return self.start()


ServerFactory = Callable[..., ServerProcess]


@contextmanager
def server_factory(log_dir: Path) -> Iterator[ServerFactory]:
    """Start servers on demand; stop every one of them at the end, printing their logs."""
    servers: list[ServerProcess] = []

    def start(url: str, **env: object) -> ServerProcess:
        log_path = log_dir / f"server-{len(servers)}.log"
        server = ServerProcess(url, log_path, {_env_name(k): str(v) for k, v in env.items()})
        servers.append(server)
        return server.start()

    try:
        yield start
    finally:
        for server in servers:
            server.stop()
            # Shown by pytest only when the test failed.
            print(f"----- {server.log_path.name} ({server.url})\n{server.logs()[-20000:]}")


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[ServerFactory]:
    """start_server(url, **env) -> ServerProcess; env keys like lease_ttl_s=2 become VRAMTUNE_*."""
    with server_factory(tmp_path) as start:
        yield start


@pytest.fixture
def app_client(migrated_url: str) -> Iterator[TestClient]:
    """An in-process TestClient of create_app on migrated_url (lifespan running)."""
    from fastapi.testclient import TestClient

    from service.app import create_app
    from service.settings import Settings

    with TestClient(create_app(Settings(database_url=migrated_url))) as client:
        yield client
