"""Relay leases remember their claimed, unsettled batches (``inflight``).

The relay no longer writes an entry id on every claimed row: a batch's ids are derived from
``<batch ms>-<seq>``, and the lease row records each unsettled batch as ``[first seq, last seq,
ms]`` so that a retry, by this relay or the next owner, appends the same rows under the same
ids. Rows get their ``entry_id`` once, when they are marked delivered.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("outbox_relay_leases") as batch:
        batch.add_column(
            sa.Column("inflight", sa.Text, nullable=False, server_default=sa.text("'[]'"))
        )


def downgrade() -> None:
    with op.batch_alter_table("outbox_relay_leases") as batch:
        batch.drop_column("inflight")
