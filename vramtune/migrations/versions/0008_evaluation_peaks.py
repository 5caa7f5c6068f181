"""Training-step and evaluation peaks apart, predicted and measured (issue 29)

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-06 03:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = (
    "predicted_training",
    "predicted_evaluation",
    "measured_training",
    "measured_evaluation",
)


def upgrade() -> None:
    """Apply this revision: four nullable columns, nothing existing changes."""
    with op.batch_alter_table("vramtune_memory_observations", schema=None) as batch_op:
        for name in COLUMNS:
            batch_op.add_column(sa.Column(name, sa.BigInteger(), nullable=True))


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("vramtune_memory_observations", schema=None) as batch_op:
        for name in reversed(COLUMNS):
            batch_op.drop_column(name)
