"""The rungs each worker's tasks can use (issue 43)

``vramtune_workers.rungs``: per task, the rungs of the plan ladder its plans can use on the
worker's card, as the worker registers them; the dashboard's advice suggests no other. NULL for
workers registered before it (unknown: every rung may be advised).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-07 05:20:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Apply this revision: one nullable column."""
    with op.batch_alter_table("vramtune_workers", schema=None) as batch_op:
        batch_op.add_column(sa.Column("rungs", sa.JSON(), nullable=True))


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("vramtune_workers", schema=None) as batch_op:
        batch_op.drop_column("rungs")
