"""The run store's table, ``outbox_runs``.

A database migrated by an earlier 0.1.0 development build already has this table (the core's
first migration created it then): it is adopted (and gets the sweeper's index), not created
again.

Revision ID: r0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "r0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    inspector = sa.inspect(op.get_bind())
    indexes: set[str | None] = set()
    if inspector.has_table("outbox_runs"):
        indexes = {i["name"] for i in inspector.get_indexes("outbox_runs")}
    else:
        _create_table()
    if "ix_outbox_runs_lease_expires_at_ms" not in indexes:
        op.create_index("ix_outbox_runs_lease_expires_at_ms", "outbox_runs",
                        ["lease_expires_at_ms"])


def _create_table() -> None:
    op.create_table(
        "outbox_runs",
        sa.Column("id", sa.String(128), nullable=False),
        sa.Column("revision", sa.BigInteger, nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("record", sa.Text, nullable=False),
        sa.Column("lease_owner", sa.String(128)),
        sa.Column("lease_expires_at_ms", sa.BigInteger),
        sa.Column("attempts", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("created_at_ms", sa.BigInteger, nullable=False),
        sa.Column("updated_at_ms", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_outbox_runs"),
    )
    op.create_index(
        "ix_outbox_runs_status_lease", "outbox_runs", ["status", "lease_expires_at_ms"]
    )


def downgrade() -> None:
    op.drop_table("outbox_runs")
