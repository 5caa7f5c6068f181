"""Secure by default: auth on, `vramtune serve` refuses an unguarded start, settings in one place,
and migration 0003 matching the tables on SQLite and PostgreSQL."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from alembic.autogenerate import compare_metadata
from alembic.command import downgrade
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, inspect

from vramtune.service.auth import tokens as auth
from vramtune.service.db.engine import make_engine, make_sessions
from vramtune.service.db.migrate import (
    VERSION_TABLE,
    alembic_config,
    current_revision,
    head_revision,
    upgrade,
)
from vramtune.service.db.tables import Base
from vramtune.service.settings import Settings
from vramtune.service.state import utcnow
from vramtune.service.testing import free_port, run_vramtune, upgrade_database

SERVE_ENV = {"VRAMTUNE_AUTH": "", "VRAMTUNE_HOST": "", "VRAMTUNE_LOG_FORMAT": ""}


def serve(url: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`vramtune serve` expected to refuse at once (a timeout means it served instead)."""
    given = {k: v for k, v in {**SERVE_ENV, **env}.items() if v}
    clean = {k: v for k, v in os.environ.items() if k not in SERVE_ENV}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "vramtune",
            "serve",
            "--database-url",
            url,
            "--port",
            str(free_port()),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**clean, **given},
        check=False,
    )


def migrated_without_tokens(url: str) -> str:
    """Tables at head but no token (as Alembic alone, or a store whose tokens were removed)."""
    engine = make_engine(url)
    try:
        upgrade(engine)
    finally:
        engine.dispose()
    return url


def test_auth_is_on_unless_said_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VRAMTUNE_AUTH", raising=False)
    assert Settings().auth == "on"
    monkeypatch.setenv("VRAMTUNE_AUTH", "off")
    assert Settings().auth == "off"


def test_serve_without_a_live_token_refuses_naming_the_way_out(database_url: str) -> None:
    """One line naming `vramtune db upgrade` and VRAMTUNE_AUTH=off; the same once every token
    is revoked; with a token it serves (checked in every live-server test)."""
    url = migrated_without_tokens(database_url)
    result = serve(url)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "vramtune db upgrade" in lines[0] and "VRAMTUNE_AUTH=off" in lines[0]
    engine = make_engine(url)
    try:
        with make_sessions(engine).begin() as session:
            row, _clear = auth.create_token(session, "gone", ["admin"], utcnow())
            auth.revoke_token(session, row.id, utcnow())
    finally:
        engine.dispose()
    again = serve(url)
    assert again.returncode == 2 and "no live API token" in again.stderr


def test_serve_on_an_unmigrated_database_says_upgrade_prints_the_token(tmp_path: Path) -> None:
    result = serve(f"sqlite:///{tmp_path / 'empty.db'}")
    assert result.returncode == 2
    assert "vramtune db upgrade" in result.stderr and "first admin token" in result.stderr


def test_auth_off_beyond_loopback_needs_insecure(tmp_path: Path) -> None:
    """Refused on 0.0.0.0 with auth off; --insecure starts it; loopback needs no flag."""
    url = upgrade_database(f"sqlite:///{tmp_path / 'v.db'}")
    refused = serve(url, "--host", "0.0.0.0", VRAMTUNE_AUTH="off")
    assert refused.returncode == 2
    assert "--insecure" in refused.stderr and "0.0.0.0" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "vramtune",
        "serve",
        "--database-url",
        url,
        "--host",
        "0.0.0.0",
    ]
    env = {**os.environ, "VRAMTUNE_AUTH": "off"}
    process = subprocess.Popen(
        [*command, "--port", str(port), "--insecure"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, process.communicate()[1]
            assert time.monotonic() < deadline, "never served"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/api/v1/health", timeout=2).is_success:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=30)
    assert "VRAMTUNE_AUTH=off" in stderr  # the warning is still logged


def test_log_format_is_a_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VRAMTUNE_LOG_FORMAT", "json")
    assert Settings().log_format == "json"
    url = upgrade_database(f"sqlite:///{tmp_path / 'v.db'}")
    bad = serve(url, VRAMTUNE_LOG_FORMAT="yaml", VRAMTUNE_AUTH="off")
    assert bad.returncode == 1
    assert "invalid settings: log_format" in bad.stderr and "Traceback" not in bad.stderr


def test_migration_0003_matches_the_tables_and_goes_down_and_up(database_url: str) -> None:
    """After `db upgrade` the schema is exactly the models'; 0003 downgrades and upgrades."""
    url = upgrade_database(database_url)
    engine = create_engine(url)
    try:
        assert _schema_drift(engine) == []
        # 0009 (trial events) goes down to 0008 alone: its table goes, the others stay.
        downgrade(alembic_config(engine), "0008")
        assert "vramtune_trial_events" not in inspect(engine).get_table_names()
        assert "vramtune_trials" in inspect(engine).get_table_names()
        downgrade(alembic_config(engine), "0002")
        assert current_revision(engine) == "0002"
        upgrade(engine)
        assert current_revision(engine) == head_revision()
        assert _schema_drift(engine) == []
    finally:
        engine.dispose()
    assert run_vramtune("token", "list", "--database-url", url).returncode == 0


def _schema_drift(engine: object) -> list[object]:
    with engine.connect() as connection:  # type: ignore[attr-defined]
        context = MigrationContext.configure(
            connection,
            opts={
                "version_table": VERSION_TABLE,
                "include_name": lambda name, type_, _parents: (
                    type_ != "table" or (name or "").startswith("vramtune_")
                ),
                "compare_type": False,
            },
        )
        return [diff for diff in compare_metadata(context, Base.metadata)]
