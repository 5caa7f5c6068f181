"""Workers' batch parameter per task (a study lacking it is refused at creation)

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-05 22:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Apply this revision: one nullable column, nothing existing changes."""
    with op.batch_alter_table("vramtune_workers", schema=None) as batch_op:
        batch_op.add_column(sa.Column("batch_params", sa.JSON(), nullable=True))


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("vramtune_workers", schema=None) as batch_op:
        batch_op.drop_column("batch_params")
