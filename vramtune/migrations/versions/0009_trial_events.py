"""Each trial's story: one event row per call that changed it (leased, planned, routed...)

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-06 03:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Apply this revision: a new table, nothing existing changes."""
    op.create_table(
        "vramtune_trial_events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("trial_id", sa.Integer(), nullable=False),
        sa.Column("at", sa.DateTime(), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("detail", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(
        "ix_vramtune_trial_events_trial", "vramtune_trial_events", ["trial_id", "id"], unique=False
    )


def downgrade() -> None:
    """Revert this revision."""
    op.drop_index("ix_vramtune_trial_events_trial", table_name="vramtune_trial_events")
    op.drop_table("vramtune_trial_events")
