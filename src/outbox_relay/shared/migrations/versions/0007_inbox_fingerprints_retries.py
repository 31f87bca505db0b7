"""Inbox fingerprints and durable retries (issue #22).

``outbox_inbox.fingerprint``: a hash of the event a receipt settled
(:func:`shared.envelope.fingerprint`), so a redelivered id carrying other data is told from a
true duplicate (``conflicting_duplicate``). Receipts written before this revision keep NULL:
they are compared with nothing (a delivery of their id is a ``duplicate``, as before).

``outbox_consumer_retries``: per group and event, a failing handler's attempts and its durable
next attempt time (consumer/retry.py).

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("outbox_inbox") as batch:
        batch.add_column(sa.Column("fingerprint", sa.String(64)))
    op.create_table(
        "outbox_consumer_retries",
        sa.Column("group_name", sa.String(64), nullable=False),
        sa.Column("event_id", sa.String(512), nullable=False),
        sa.Column("stream_key", sa.String(256), nullable=False),
        sa.Column("entry_id", sa.String(48), nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("first_failed_at_ms", sa.BigInteger, nullable=False),
        sa.Column("next_attempt_at_ms", sa.BigInteger, nullable=False),
        sa.Column("last_error", sa.String(64)),
        sa.Column("updated_at_ms", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("group_name", "event_id", name="pk_outbox_consumer_retries"),
    )
    op.create_index("ix_outbox_consumer_retries_next", "outbox_consumer_retries",
                    ["group_name", "next_attempt_at_ms"])


def downgrade() -> None:
    op.drop_index("ix_outbox_consumer_retries_next", "outbox_consumer_retries")
    op.drop_table("outbox_consumer_retries")
    with op.batch_alter_table("outbox_inbox") as batch:
        batch.drop_column("fingerprint")
