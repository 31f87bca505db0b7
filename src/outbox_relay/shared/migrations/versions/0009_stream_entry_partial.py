"""The outbox's stream-entry index holds delivered rows only (issue #24).

``ix_outbox_events_stream_entry`` (stream, partition, entry id) serves the lookups by entry id
(repair, trims, lost entries): every one of them names an entry id, and only a delivered row
has one. As a full index it also held every undelivered row under a NULL id: a producer's
insert added an entry nobody reads, and the relay's mark, which gives the row its id, had to
move it (on SQLite a delete and an insert per row: 0.4 of the mark's 1.9 ms per 500 rows,
bench/PERFORMANCE.md). As a partial index (``WHERE entry_id IS NOT NULL``) an insert leaves it
alone and the mark only adds.

On PostgreSQL ``CREATE INDEX`` blocks writes to the outbox while it builds (seconds per
million delivered rows); prune delivered rows first on a large outbox, or upgrade in a quiet
moment.

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

_NAME = "ix_outbox_events_stream_entry"
_COLUMNS = ["stream", "partition", "entry_id"]


def upgrade() -> None:
    op.drop_index(_NAME, table_name="outbox_events")
    where = sa.text("entry_id IS NOT NULL")
    op.create_index(_NAME, "outbox_events", _COLUMNS,
                    postgresql_where=where, sqlite_where=where)


def downgrade() -> None:
    op.drop_index(_NAME, table_name="outbox_events")
    op.create_index(_NAME, "outbox_events", _COLUMNS)
