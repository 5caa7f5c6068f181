"""Row writes without the ORM's unit of work, for the hot paths of the worker protocol.

At 4 workers the ORM's flush (change tracking, sorting, one UPDATE built per dirty object) was
the largest layer of the server's CPU (bench/results/service_profile.md, round 6). Here a
row's columns are written by an UPDATE built once per table, whose cache key SQLAlchemy then
memoizes (as vramtune.service.fleet.leases._FENCE), and an insert by an INSERT built once per table.

``set_columns`` keeps the loaded object in step without making it dirty
(``set_committed_value``): later reads in the transaction see the new values and the flush at
commit writes nothing for them. A change the ORM still tracks on the same column is cancelled
by it (the value written here stands); other columns the ORM tracks are flushed as usual.
These are Core statements: the session does not autoflush before them.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from sqlalchemy import Insert, Table, Update, and_, bindparam, insert, inspect, update
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value

from vramtune.service.db.tables import Base

_KEY = "where_"  # the primary key's parameters: never a column's name


def table_of(model: type[Base]) -> Table:
    """The model's table, for Core statements built on it."""
    table = model.__table__
    assert isinstance(table, Table)
    return table


@cache
def _update_of(table: Table) -> Update:
    """``UPDATE table SET <the parameters' columns> WHERE <primary key>``, built once."""
    keys = [column == bindparam(_KEY + column.key) for column in table.primary_key]
    return update(table).where(and_(*keys))


@cache
def _insert_of(table: Table) -> Insert:
    """``INSERT INTO table``, built once."""
    return insert(table)


def set_columns(session: Session, row: Base, **values: Any) -> None:
    """Write ``values`` (column name: value) to the loaded row, and to the object as committed."""
    if not inspect(row).persistent:
        raise ValueError(f"set_columns writes rows loaded from the database, not {row!r}")
    table = table_of(type(row))
    keys = {_KEY + column.key: getattr(row, column.key) for column in table.primary_key}
    session.execute(_update_of(table), {**keys, **values})
    for name, value in values.items():
        set_committed_value(row, name, value)


def insert_row(session: Session, model: type[Base], **values: Any) -> None:
    """Insert one row of ``model`` (its columns by name); no object is created."""
    session.execute(_insert_of(table_of(model)), values)
