"""Predictions shared across the fleet, and the shape keys each worker shares them by

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03 14:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Apply this revision: workers registered before it share no predictions (NULL)."""
    op.create_table(
        "vramtune_predictions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("task", sa.String(length=128), nullable=False),
        sa.Column("card_model", sa.String(length=256), nullable=False),
        sa.Column("torch_version", sa.String(length=64), nullable=False),
        sa.Column("shape_hash", sa.String(length=64), nullable=False),
        sa.Column("plan_key", sa.String(length=64), nullable=False),
        sa.Column("shape", sa.JSON(), nullable=False),
        sa.Column("plan", sa.JSON(), nullable=False),
        sa.Column("prediction", sa.JSON(), nullable=False),
        sa.Column("peak_bytes", sa.BigInteger(), nullable=False),
        sa.Column("worker_id", sa.Integer(), nullable=True),
        sa.Column("trial_id", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("vramtune_predictions", schema=None) as batch_op:
        batch_op.create_index(
            "ux_vramtune_predictions_key",
            ["task", "card_model", "torch_version", "shape_hash", "plan_key"],
            unique=True,
        )
    with op.batch_alter_table("vramtune_workers", schema=None) as batch_op:
        batch_op.add_column(sa.Column("shape_params", sa.JSON(), nullable=True))


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("vramtune_workers", schema=None) as batch_op:
        batch_op.drop_column("shape_params")
    with op.batch_alter_table("vramtune_predictions", schema=None) as batch_op:
        batch_op.drop_index("ux_vramtune_predictions_key")
    op.drop_table("vramtune_predictions")
