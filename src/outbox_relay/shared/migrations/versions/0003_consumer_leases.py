"""Consumer leases: one owner per consumer group and partition stream.

Two consumers of one group reading the same partition stream could apply an aggregate's
revision N+1 while N sat in the pending list of a consumer that died (issue #9). Consumers now
lease partition streams the way relays lease partitions: a row per group and partition with an
owner and a fencing epoch the claim transaction re-checks, and a heartbeat row per consumer for
the fair share.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "outbox_consumer_leases",
        sa.Column("group_name", sa.String(64), nullable=False),
        sa.Column("stream", sa.String(64), nullable=False),
        sa.Column("partition", sa.Integer, nullable=False, autoincrement=False),
        sa.Column("owner", sa.String(128)),
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("expires_at_ms", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint(
            "group_name", "stream", "partition", name="pk_outbox_consumer_leases"
        ),
    )
    op.create_table(
        "outbox_consumer_nodes",
        sa.Column("group_name", sa.String(64), nullable=False),
        sa.Column("consumer", sa.String(128), nullable=False),
        sa.Column("expires_at_ms", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("group_name", "consumer", name="pk_outbox_consumer_nodes"),
    )


def downgrade() -> None:
    op.drop_table("outbox_consumer_nodes")
    op.drop_table("outbox_consumer_leases")
