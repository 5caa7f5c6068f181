"""Alembic environment: run by vramtune.service.db.migrate with the engine in config.attributes."""

from __future__ import annotations

from typing import Any

from alembic import context
from sqlalchemy import create_engine

from vramtune.service.db.migrate import VERSION_TABLE
from vramtune.service.db.tables import Base

config = context.config


def include_name(name: str | None, type_: str, _parents: Any) -> bool:
    """Autogenerate sees vramtune's tables only; Optuna's are Optuna's to migrate."""
    if type_ == "table":
        return name is not None and name.startswith("vramtune_")
    return True


def _configure(**kwargs: Any) -> None:
    context.configure(
        target_metadata=Base.metadata,
        version_table=VERSION_TABLE,
        include_name=include_name,
        render_as_batch=True,  # SQLite alters tables by copying them
        **kwargs,
    )


def run_offline() -> None:
    """Emit SQL for `alembic upgrade --sql`."""
    _configure(url=config.get_main_option("sqlalchemy.url"), literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    """Migrate over a connection of the given engine (or one built from sqlalchemy.url)."""
    engine = config.attributes.get("engine")
    if engine is None:
        engine = create_engine(config.get_main_option("sqlalchemy.url") or "")
    with engine.connect() as connection:
        sqlite = connection.dialect.name == "sqlite"
        if sqlite:
            # Batch mode copies a table and drops the old one; with foreign keys on, SQLite
            # refuses to drop a table that rows still reference (vramtune_leases ->
            # vramtune_workers). SQLite's own recipe for table rebuilds: keys off around the
            # change (the pragma is ignored inside a transaction, so before it), checked after.
            connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
            connection.commit()  # end SQLAlchemy's autobegun transaction: Alembic owns its own
        _configure(connection=connection)
        with context.begin_transaction():
            context.run_migrations()
        if sqlite:
            connection.exec_driver_sql("PRAGMA foreign_keys=ON")
            broken = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
            if broken:
                raise RuntimeError(f"migration left rows whose keys point nowhere: {broken}")


if context.is_offline_mode():
    run_offline()
else:
    run_online()
