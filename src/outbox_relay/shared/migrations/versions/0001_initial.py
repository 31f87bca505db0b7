"""Initial schema: outbox events, inbox, inbox heads, relay leases and nodes.

Before 0.1.0 this migration also created ``outbox_runs``; that table now belongs to the runs
component and its own migrations (``runs/migrations``), which adopt a table created here.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

SeqType = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "outbox_events",
        sa.Column("seq", SeqType, nullable=False, autoincrement=True),
        sa.Column("event_id", sa.String(512), nullable=False),
        sa.Column("stream", sa.String(64), nullable=False),
        sa.Column("partition", sa.Integer, nullable=False),
        sa.Column("aggregate_type", sa.String(128)),
        sa.Column("aggregate_id", sa.String(256)),
        sa.Column("revision", sa.BigInteger),
        sa.Column("type", sa.String(256), nullable=False),
        sa.Column("source", sa.String(256), nullable=False),
        sa.Column("payload", sa.Text, nullable=False),
        sa.Column("headers", sa.Text, nullable=False),
        sa.Column("created_at_ms", sa.BigInteger, nullable=False),
        sa.Column("available_at_ms", sa.BigInteger, nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("entry_id", sa.String(48)),
        sa.Column("delivered_at_ms", sa.BigInteger),
        sa.Column("last_error", sa.String(64)),
        sa.PrimaryKeyConstraint("seq", name="pk_outbox_events"),
        sa.UniqueConstraint("event_id", name="uq_outbox_events_event_id"),
        sqlite_autoincrement=True,
    )
    op.create_index(
        "ix_outbox_events_pending",
        "outbox_events",
        ["partition", "seq"],
        postgresql_where=sa.text("delivered_at_ms IS NULL"),
        sqlite_where=sa.text("delivered_at_ms IS NULL"),
    )
    op.create_index(
        "ix_outbox_events_stream_entry", "outbox_events", ["stream", "partition", "entry_id"]
    )
    op.create_table(
        "outbox_inbox",
        sa.Column("group_name", sa.String(64), nullable=False),
        sa.Column("event_id", sa.String(512), nullable=False),
        sa.Column("event_type", sa.String(256)),
        sa.Column("aggregate_type", sa.String(128)),
        sa.Column("aggregate_id", sa.String(256)),
        sa.Column("revision", sa.BigInteger),
        sa.Column("stream_key", sa.String(256), nullable=False),
        sa.Column("entry_id", sa.String(48), nullable=False),
        sa.Column("outcome", sa.String(16), nullable=False),
        sa.Column("reason", sa.String(64)),
        sa.Column("duplicates", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("created_at_ms", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("group_name", "event_id", name="pk_outbox_inbox"),
    )
    op.create_table(
        "outbox_inbox_heads",
        sa.Column("group_name", sa.String(64), nullable=False),
        sa.Column("aggregate_type", sa.String(128), nullable=False),
        sa.Column("aggregate_id", sa.String(256), nullable=False),
        sa.Column("revision", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint(
            "group_name", "aggregate_type", "aggregate_id", name="pk_outbox_inbox_heads"
        ),
    )
    op.create_table(
        "outbox_relay_leases",
        sa.Column("partition", sa.Integer, nullable=False, autoincrement=False),
        sa.Column("owner", sa.String(128)),
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("expires_at_ms", sa.BigInteger, nullable=False),
        sa.Column("last_entry_id", sa.String(48), nullable=False),
        sa.PrimaryKeyConstraint("partition", name="pk_outbox_relay_leases"),
    )
    op.create_table(
        "outbox_relay_nodes",
        sa.Column("node_id", sa.String(128), nullable=False),
        sa.Column("expires_at_ms", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("node_id", name="pk_outbox_relay_nodes"),
    )


def downgrade() -> None:
    for table in (
        "outbox_relay_nodes",
        "outbox_relay_leases",
        "outbox_inbox_heads",
        "outbox_inbox",
        "outbox_events",
    ):
        op.drop_table(table)
