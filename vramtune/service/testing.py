"""Test helpers shared by every suite (as ``optuna.testing``): databases and server processes.

Not used by the server itself; imported by tests/conftest.py and by tests that need a database
or a server with a wider scope than one test.
"""

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

import httpx

# The Host Starlette's TestClient sends, beside the default names: auth-off apps under an
# in-process TestClient list it in allowed_hosts (the DNS-rebinding check reads Host only).
IN_PROCESS_HOSTS = "localhost,127.0.0.1,::1,testserver"
PG_ADMIN_DSN = os.environ.get("VRAMTUNE_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
SERVER_START_LIMIT_S = 60.0


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
    *args: str, env: dict[str, str] | None = None, timeout: float = 120, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `python -m vramtune ARGS` (in `cwd`, first on its `sys.path`) and capture its output."""
    return subprocess.run(
        [sys.executable, "-m", "vramtune", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=cwd,
        check=False,
    )


def upgrade_database(url: str) -> str:
    """`vramtune db upgrade` on a URL (as a subprocess); returns the URL."""
    result = run_vramtune("db", "upgrade", "--database-url", url)
    if result.returncode != 0:
        raise RuntimeError(f"db upgrade failed:\n{result.stdout}\n{result.stderr}")
    return url


# ---------------------------------------------------------------- servers


def free_port() -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def env_name(key: str) -> str:
    """lease_ttl_s -> VRAMTUNE_LEASE_TTL_S; upper-case names pass through as they are."""
    return key if key.isupper() else f"VRAMTUNE_{key.upper()}"


class ServerProcess:
    """`python -m vramtune serve` as a real subprocess on a free port (loopback).

    Auth is set explicitly: off unless ``env`` says otherwise (``VRAMTUNE_AUTH=on``), as the
    suites that test the fleet, the dashboard or the database are not about tokens and the
    server listens on 127.0.0.1 only; tests/security and tests/browser turn it on.
    """

    def __init__(
        self, database_url: str, log_path: Path, env: dict[str, str], cwd: Path | None = None
    ) -> None:
        self.database_url = database_url
        self.cwd = cwd
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.env = {"VRAMTUNE_AUTH": "off", **env}
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> ServerProcess:
        """Start the server and wait until /api/v1/health answers ok."""
        command = [sys.executable, "-m", "vramtune", "serve", "--host", "127.0.0.1"]
        command += ["--port", str(self.port), "--database-url", self.database_url]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                cwd=self.cwd,
            )
        self._wait_healthy()
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + SERVER_START_LIMIT_S
        assert self.process is not None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.logs()}")
            try:
                if httpx.get(f"{self.url}/api/v1/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"server not healthy after {SERVER_START_LIMIT_S} s:\n{self.logs()}")

    def logs(self) -> str:
        """Everything the server wrote so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout: float = 20) -> int | None:
        """SIGTERM (graceful shutdown), SIGKILL if it does not exit in time; the exit code."""
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return self.kill()

    def kill(self) -> int | None:
        """SIGKILL: the server dies without shutting down; the exit code."""
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
    """start(url, **env) servers on demand; stop every one at the end and print its log."""
    servers: list[ServerProcess] = []

    def start(url: str, **env: object) -> ServerProcess:
        log_path = log_dir / f"server-{len(servers)}.log"
        server = ServerProcess(url, log_path, {env_name(k): str(v) for k, v in env.items()})
        servers.append(server)
        return server.start()

    try:
        yield start
    finally:
        for server in servers:
            server.stop()
            # pytest shows captured output only for a failed test.
            print(f"----- {server.log_path.name} ({server.url})\n{server.logs()[-20000:]}")
