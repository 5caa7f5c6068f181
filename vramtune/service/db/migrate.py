"""Schema upgrades: Optuna's tables by Optuna, vramtune's by Alembic from migrations/."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import URL, Engine, inspect

from vramtune.service.db.engine import engine_kwargs

VERSION_TABLE = "vramtune_alembic_version"


class NotMigrated(RuntimeError):
    """The database lacks vramtune's tables or has an older revision of them."""


# Alembic logs every connection it inspects at INFO; the CLI reports the outcome itself.
logging.getLogger("alembic.runtime.migration").setLevel(logging.WARNING)


def migrations_dir() -> str:
    """Where the installed migrations/ package lives (a plain folder, also in editable installs)."""
    spec = importlib.util.find_spec("vramtune.migrations")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the migrations package is not installed")
    return str(next(iter(spec.submodule_search_locations)))


def alembic_config(engine: Engine | None = None) -> Config:
    """An Alembic config for the packaged migrations/, no alembic.ini needed."""
    config = Config()
    config.set_main_option("script_location", migrations_dir())
    config.attributes["engine"] = engine
    return config


def head_revision() -> str | None:
    """The newest revision in migrations/."""
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def current_revision(engine: Engine) -> str | None:
    """vramtune's revision in the database, None when its version table is missing."""
    with engine.connect() as connection:
        if not inspect(connection).has_table(VERSION_TABLE):
            return None
        context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
        return context.get_current_revision()


def upgrade_optuna(url: str) -> None:
    """Create or upgrade Optuna's own tables (Optuna migrates them, never us)."""
    from optuna.storages import RDBStorage

    storage = RDBStorage(url, engine_kwargs=engine_kwargs(url), skip_compatibility_check=True)
    try:
        storage.upgrade()
    finally:
        storage.engine.dispose()


def upgrade(engine: Engine) -> None:
    """Bring both Optuna's and vramtune's tables to their newest schema."""
    upgrade_optuna(engine.url.render_as_string(hide_password=False))
    command.upgrade(alembic_config(engine), "head")


def missing_sqlite_file(url: URL) -> Path | None:
    """The file of a SQLite URL when it does not exist; None for a file that does, an
    in-memory database, a ``file:`` URI or another backend."""
    if url.get_backend_name() != "sqlite" or url.query.get("uri") == "true":
        return None
    if url.database in (None, "", ":memory:"):
        return None
    path = Path(url.database)
    return None if path.exists() else path


def require_migrated(engine: Engine) -> None:
    """Raise NotMigrated, naming the command to run, unless vramtune's tables are at head.

    A SQLite file that does not exist is not created: connecting would leave an empty database
    behind a command that refused to use it.
    """
    url = engine.url.render_as_string(hide_password=True)
    missing = missing_sqlite_file(engine.url)
    if missing is not None:
        raise NotMigrated(
            f"database {url} is not migrated (no file at {missing}): "
            "run `vramtune db upgrade --database-url URL`"
        )
    current = current_revision(engine)
    head = head_revision()
    if current == head:
        return
    found = "no vramtune tables" if current is None else f"revision {current}, head is {head}"
    raise NotMigrated(
        f"database {url} is not migrated ({found}): run `vramtune db upgrade --database-url URL`"
    )
