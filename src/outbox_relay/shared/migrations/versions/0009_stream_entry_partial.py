"""The outbox's stream-entry index holds only rows with an entry id (issue #24).

``ix_outbox_events_stream_entry`` (stream, partition, entry id) serves the lookups by entry id
(repair, refills, lost entries): every one of them names an entry id. A row gets its id when
the relay marks it delivered (rows an earlier relay version took may hold one while pending);
until then it has none. As a full index it also held every such row under a NULL id: a
producer's insert added an entry nobody reads, and the relay's mark, which gives the row its
id, had to move it (on SQLite a delete and an insert per row: 0.4 of the mark's 1.9 ms per 500
rows, bench/PERFORMANCE.md). As a partial index (``WHERE entry_id IS NOT NULL``) an insert
leaves it alone and the mark only adds.

On PostgreSQL the new index is built under a temporary name before the old one is dropped:
the build blocks writes to the outbox (producers wait; seconds per million rows with an id)
but not reads, and the drop and rename at the end hold the table for a moment only. On a
large outbox prune delivered rows first, or upgrade in a quiet moment.

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
_BUILDING = "ix_outbox_events_stream_entry_0009"
_COLUMNS = ["stream", "partition", "entry_id"]


def _replace(where: sa.TextClause | None) -> None:
    """Swap the index for one with ``where`` (None: a full index)."""
    if op.get_bind().dialect.name != "postgresql":  # SQLite cannot rename an index
        op.drop_index(_NAME, table_name="outbox_events")
        op.create_index(_NAME, "outbox_events", _COLUMNS, sqlite_where=where)
        return
    op.create_index(_BUILDING, "outbox_events", _COLUMNS, postgresql_where=where)
    op.drop_index(_NAME, table_name="outbox_events")
    op.execute(f"ALTER INDEX {_BUILDING} RENAME TO {_NAME}")


def upgrade() -> None:
    _replace(sa.text("entry_id IS NOT NULL"))


def downgrade() -> None:
    _replace(None)
