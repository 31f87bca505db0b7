"""Bounded growth: what retention and acknowledgement-aware trimming need (issue #10).

* ``outbox_stream_trims``: one row per (stream, partition) the relay delivered to (so repair
  checks and trims find their streams without scanning the outbox), with the id below which
  the relay trimmed the stream on purpose (every group had acknowledged it; ``0-0``: never
  trimmed). Raised after each ``XTRIM``; a repair refills only rows at or above it, so it
  never re-adds what was trimmed.
* ``ix_outbox_events_delivered``: delivered rows by delivery time, for pruning (partial: the
  undelivered rows are never pruned and never in it).
* ``ix_outbox_inbox_created``: receipts by age, for pruning.
* ``outbox_inbox_heads.updated_at_ms`` (+ index): when an aggregate's head last moved, for
  pruning heads of aggregates that went quiet. Existing rows get 0 (prunable at once after the
  retention check, which is what an unknown age means for a head nothing updates any more).

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "outbox_stream_trims",
        sa.Column("stream", sa.String(64), nullable=False),
        sa.Column("partition", sa.Integer, nullable=False, autoincrement=False),
        sa.Column("floor_entry_id", sa.String(48), nullable=False),
        sa.Column("trimmed", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("updated_at_ms", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("stream", "partition", name="pk_outbox_stream_trims"),
    )
    # Every stream delivered to so far becomes known (floor 0-0: never trimmed); from now on
    # each settle registers the streams it marks rows of, so nothing scans the outbox for them.
    op.execute(
        "INSERT INTO outbox_stream_trims (stream, partition, floor_entry_id, trimmed, "
        "updated_at_ms) SELECT DISTINCT stream, partition, '0-0', 0, 0 FROM outbox_events "
        "WHERE entry_id IS NOT NULL"
    )
    op.create_index(
        "ix_outbox_events_delivered",
        "outbox_events",
        ["delivered_at_ms"],
        postgresql_where=sa.text("delivered_at_ms IS NOT NULL"),
        sqlite_where=sa.text("delivered_at_ms IS NOT NULL"),
    )
    op.create_index("ix_outbox_inbox_created", "outbox_inbox", ["created_at_ms"])
    with op.batch_alter_table("outbox_inbox_heads") as batch:
        batch.add_column(
            sa.Column("updated_at_ms", sa.BigInteger, nullable=False, server_default=sa.text("0"))
        )
    op.create_index("ix_outbox_inbox_heads_updated", "outbox_inbox_heads", ["updated_at_ms"])


def downgrade() -> None:
    op.drop_index("ix_outbox_inbox_heads_updated", table_name="outbox_inbox_heads")
    with op.batch_alter_table("outbox_inbox_heads") as batch:
        batch.drop_column("updated_at_ms")
    op.drop_index("ix_outbox_inbox_created", table_name="outbox_inbox")
    op.drop_index("ix_outbox_events_delivered", table_name="outbox_events")
    op.drop_table("outbox_stream_trims")
