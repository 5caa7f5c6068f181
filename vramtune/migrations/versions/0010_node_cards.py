"""Node workers' card count and a trial's world size need (multi-GPU trials, issue 31)

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-06 03:20:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Apply this revision: two columns defaulting to one card, one rank; nothing else changes."""
    with op.batch_alter_table("vramtune_workers", schema=None) as batch_op:
        batch_op.add_column(sa.Column("cards", sa.Integer(), nullable=False, server_default="1"))
    with op.batch_alter_table("vramtune_trials", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("min_world_size", sa.Integer(), nullable=False, server_default="1")
        )


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("vramtune_trials", schema=None) as batch_op:
        batch_op.drop_column("min_world_size")
    with op.batch_alter_table("vramtune_workers", schema=None) as batch_op:
        batch_op.drop_column("cards")
