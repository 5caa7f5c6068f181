"""The step-time model's observations: each run's time per optimizer step and its features

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03 14:20:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Apply this revision: a new table, nothing existing changes."""
    op.create_table(
        "vramtune_step_times",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("trial_id", sa.Integer(), nullable=False),
        sa.Column("card_model", sa.String(length=256), nullable=False),
        sa.Column("task", sa.String(length=128), nullable=False),
        sa.Column("features", sa.JSON(), nullable=False),
        sa.Column("predicted_step_s", sa.Float(), nullable=True),
        sa.Column("measured_step_s", sa.Float(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("vramtune_step_times", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_vramtune_step_times_trial_id"), ["trial_id"], unique=False
        )
        batch_op.create_index("ix_vramtune_step_times_key", ["card_model", "task"], unique=False)


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("vramtune_step_times", schema=None) as batch_op:
        batch_op.drop_index("ix_vramtune_step_times_key")
        batch_op.drop_index(batch_op.f("ix_vramtune_step_times_trial_id"))
    op.drop_table("vramtune_step_times")
