"""Each stream's partition count, recorded at its first write (issue #11).

``outbox_streams``: a producer, relay or consumer configured with another ``OUTBOX_PARTITIONS``
than the stream's first writer would strand events in silence; every component now compares
its count with this row and refuses a mismatch (shared/partition_counts.py). Existing streams
get their row at their next write (the count they were written with cannot be known from the
rows alone).

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "outbox_streams",
        sa.Column("stream", sa.String(64), nullable=False),
        sa.Column("partitions", sa.Integer, nullable=False),
        sa.Column("created_at_ms", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("stream", name="pk_outbox_streams"),
    )


def downgrade() -> None:
    op.drop_table("outbox_streams")
