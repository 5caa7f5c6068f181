"""A trust boundary for shared knowledge: the scope predictions and observations count in

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-05 22:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_OLD_KEY = ["task", "card_model", "torch_version", "shape_hash", "plan_key"]


def _scope() -> sa.Column[str]:
    return sa.Column("scope", sa.String(length=32), server_default="fleet", nullable=False)


def upgrade() -> None:
    """Apply this revision: observations made so far stay fleet-wide; shared predictions are
    dropped, because any token could write them under any shape (a cache: workers trace again);
    workers registered before it run one trial at a time (slots 1).
    """
    op.execute("DELETE FROM vramtune_predictions")
    with op.batch_alter_table("vramtune_predictions", schema=None) as batch_op:
        batch_op.add_column(_scope())
        batch_op.drop_index("ux_vramtune_predictions_key")
        batch_op.create_index("ux_vramtune_predictions_key", ["scope", *_OLD_KEY], unique=True)
    for table in ("vramtune_memory_observations", "vramtune_step_times"):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(_scope())
    with op.batch_alter_table("vramtune_workers", schema=None) as batch_op:
        batch_op.add_column(sa.Column("slots", sa.Integer(), server_default="1", nullable=False))


def downgrade() -> None:
    """Revert this revision (study-scoped predictions go: the old key cannot hold them)."""
    with op.batch_alter_table("vramtune_workers", schema=None) as batch_op:
        batch_op.drop_column("slots")
    for table in ("vramtune_step_times", "vramtune_memory_observations"):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_column("scope")
    op.execute("DELETE FROM vramtune_predictions WHERE scope <> 'fleet'")
    with op.batch_alter_table("vramtune_predictions", schema=None) as batch_op:
        batch_op.drop_index("ux_vramtune_predictions_key")
        batch_op.create_index("ux_vramtune_predictions_key", _OLD_KEY, unique=True)
        batch_op.drop_column("scope")
