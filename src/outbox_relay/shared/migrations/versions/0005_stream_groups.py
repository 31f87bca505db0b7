"""Known consumer groups per partition stream, so a trim never outruns a lost group (issue #10).

``outbox_stream_groups``: every group a relay trim has seen on a (stream, partition). When Redis
loses its data, each group comes back only when its own consumers recreate it; a trim that
looked only at the groups present would trim what a group still missing had not read. A known
group that is missing holds the stream's trim until it is back, or until it has been missing
longer than ``OUTBOX_CONSUMER_IDLE_S`` (then it is forgotten, with a warning).

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "outbox_stream_groups",
        sa.Column("stream", sa.String(64), nullable=False),
        sa.Column("partition", sa.Integer, nullable=False, autoincrement=False),
        sa.Column("group_name", sa.String(64), nullable=False),
        sa.Column("seen_at_ms", sa.BigInteger, nullable=False),
        sa.Column("missing_since_ms", sa.BigInteger),
        sa.PrimaryKeyConstraint("stream", "partition", "group_name",
                                name="pk_outbox_stream_groups"),
    )


def downgrade() -> None:
    op.drop_table("outbox_stream_groups")
