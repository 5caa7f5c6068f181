"""Token expiry, workers bound to the token that registered them, and the audit log

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03 14:20:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Apply this revision: existing tokens never expire, existing workers are bound to none."""
    with op.batch_alter_table("vramtune_tokens", schema=None) as batch_op:
        batch_op.add_column(sa.Column("expires_at", sa.DateTime(), nullable=True))
    with op.batch_alter_table("vramtune_workers", schema=None) as batch_op:
        batch_op.add_column(sa.Column("token_id", sa.Integer(), nullable=True))
        batch_op.create_index("ix_vramtune_workers_token", ["token_id", "stopped"], unique=False)
    op.create_table(
        "vramtune_audit",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("at", sa.DateTime(), nullable=False),
        sa.Column("event", sa.String(length=64), nullable=False),
        sa.Column("token_id", sa.Integer(), nullable=True),
        sa.Column("actor", sa.String(length=128), nullable=False),
        sa.Column("target", sa.String(length=256), nullable=False),
        sa.Column("detail", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("vramtune_audit", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_vramtune_audit_at"), ["at"], unique=False)


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("vramtune_audit", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_vramtune_audit_at"))
    op.drop_table("vramtune_audit")
    with op.batch_alter_table("vramtune_workers", schema=None) as batch_op:
        batch_op.drop_index("ix_vramtune_workers_token")
        batch_op.drop_column("token_id")
    with op.batch_alter_table("vramtune_tokens", schema=None) as batch_op:
        batch_op.drop_column("expires_at")
