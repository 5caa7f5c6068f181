"""A lease's start time and a step-time observation's worker (issue 30)

``vramtune_leases.started_at`` marks the lease whose trial a worker has ``start``ed: a result
for a lease that never started is refused (409) instead of told to Optuna.
``vramtune_step_times.worker_id`` lets the step-time fit weigh workers equally and wait for a
quorum of them, as the memory calibration already does.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-06 13:10:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Apply this revision: two nullable columns. Leases granted before it count as started
    (at their grant): a trial running across the upgrade keeps its result; step-time rows keep
    NULL."""
    with op.batch_alter_table("vramtune_leases", schema=None) as batch_op:
        batch_op.add_column(sa.Column("started_at", sa.DateTime(), nullable=True))
    op.execute("UPDATE vramtune_leases SET started_at = created_at")
    with op.batch_alter_table("vramtune_step_times", schema=None) as batch_op:
        batch_op.add_column(sa.Column("worker_id", sa.Integer(), nullable=True))


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("vramtune_step_times", schema=None) as batch_op:
        batch_op.drop_column("worker_id")
    with op.batch_alter_table("vramtune_leases", schema=None) as batch_op:
        batch_op.drop_column("started_at")
