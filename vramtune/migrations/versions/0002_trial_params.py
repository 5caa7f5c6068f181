"""Trial params on vramtune's trial row, so a lease needs no read of Optuna's tables

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02 14:20:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Apply this revision: rows from before it keep NULL and are read from Optuna."""
    with op.batch_alter_table("vramtune_trials", schema=None) as batch_op:
        batch_op.add_column(sa.Column("params", sa.JSON(), nullable=True))


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("vramtune_trials", schema=None) as batch_op:
        batch_op.drop_column("params")
