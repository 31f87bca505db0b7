"""The reference schema (SQLAlchemy Core), identical on SQLite and PostgreSQL.

Times are integer epoch milliseconds (``*_ms``): comparisons are exact and portable, and no
driver guesses at time zones. Alembic migrations in ``shared/migrations`` build exactly this
schema; a test compares the two.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    text,
)

# SQLite only autoincrements an INTEGER PRIMARY KEY; PostgreSQL gets a BIGINT identity.
SeqType = BigInteger().with_variant(Integer(), "sqlite")

metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "pk": "pk_%(table_name)s",
    }
)

outbox = Table(
    "outbox_events",
    metadata,
    Column("seq", SeqType, primary_key=True, autoincrement=True),
    Column("event_id", String(512), nullable=False, unique=True),
    Column("stream", String(64), nullable=False),
    Column("partition", Integer, nullable=False),
    Column("aggregate_type", String(128)),
    Column("aggregate_id", String(256)),
    Column("revision", BigInteger),
    Column("type", String(256), nullable=False),
    Column("source", String(256), nullable=False),
    Column("payload", Text, nullable=False),
    Column("headers", Text, nullable=False),
    Column("created_at_ms", BigInteger, nullable=False),
    Column("available_at_ms", BigInteger, nullable=False),
    Column("attempts", Integer, nullable=False, server_default=text("0")),
    Column("entry_id", String(48)),
    Column("delivered_at_ms", BigInteger),
    Column("last_error", String(64)),
    Index(
        "ix_outbox_events_pending",
        "partition",
        "seq",
        postgresql_where=text("delivered_at_ms IS NULL"),
        sqlite_where=text("delivered_at_ms IS NULL"),
    ),
    # Partial: only rows with an entry id (given when the relay marks a row delivered); every
    # lookup by entry id names one (migration 0009 says why).
    Index(
        "ix_outbox_events_stream_entry",
        "stream",
        "partition",
        "entry_id",
        postgresql_where=text("entry_id IS NOT NULL"),
        sqlite_where=text("entry_id IS NOT NULL"),
    ),
    Index(
        "ix_outbox_events_delivered",
        "delivered_at_ms",
        postgresql_where=text("delivered_at_ms IS NOT NULL"),
        sqlite_where=text("delivered_at_ms IS NOT NULL"),
    ),
    sqlite_autoincrement=True,
)

inbox = Table(
    "outbox_inbox",
    metadata,
    Column("group_name", String(64), nullable=False),
    Column("event_id", String(512), nullable=False),
    Column("event_type", String(256)),
    Column("aggregate_type", String(128)),
    Column("aggregate_id", String(256)),
    Column("revision", BigInteger),
    Column("stream_key", String(256), nullable=False),
    Column("entry_id", String(48), nullable=False),
    Column("outcome", String(16), nullable=False),
    Column("reason", String(64)),
    Column("duplicates", Integer, nullable=False, server_default=text("0")),
    Column("created_at_ms", BigInteger, nullable=False),
    # shared.envelope.fingerprint of the event the receipt settled (NULL: written before 0007).
    Column("fingerprint", String(64)),
    PrimaryKeyConstraint("group_name", "event_id"),
    Index("ix_outbox_inbox_created", "created_at_ms"),
)

inbox_heads = Table(
    "outbox_inbox_heads",
    metadata,
    Column("group_name", String(64), nullable=False),
    Column("aggregate_type", String(128), nullable=False),
    Column("aggregate_id", String(256), nullable=False),
    Column("revision", BigInteger, nullable=False),
    # When the head last moved (retention prunes heads of aggregates quiet for long).
    Column("updated_at_ms", BigInteger, nullable=False, server_default=text("0")),
    PrimaryKeyConstraint("group_name", "aggregate_type", "aggregate_id"),
    Index("ix_outbox_inbox_heads_updated", "updated_at_ms"),
)

consumer_retries = Table(
    "outbox_consumer_retries",
    metadata,
    # One row per group and event whose handler failed and is retried (consumer/retry.py):
    # the durable next attempt time survives a restart and a takeover by another consumer.
    # Deleted when the event is applied or dead-lettered.
    Column("group_name", String(64), nullable=False),
    Column("event_id", String(512), nullable=False),
    Column("stream_key", String(256), nullable=False),
    Column("entry_id", String(48), nullable=False),
    Column("attempts", Integer, nullable=False),
    Column("first_failed_at_ms", BigInteger, nullable=False),
    Column("next_attempt_at_ms", BigInteger, nullable=False),
    Column("last_error", String(64)),
    Column("updated_at_ms", BigInteger, nullable=False),
    PrimaryKeyConstraint("group_name", "event_id"),
    Index("ix_outbox_consumer_retries_next", "group_name", "next_attempt_at_ms"),
)

relay_leases = Table(
    "outbox_relay_leases",
    metadata,
    Column("partition", Integer, primary_key=True, autoincrement=False),
    Column("owner", String(128)),
    Column("epoch", BigInteger, nullable=False),
    Column("expires_at_ms", BigInteger, nullable=False),
    Column("last_entry_id", String(48), nullable=False),
    # Taken, unsettled batches as JSON ``[[first seq, last seq, ms], ...]`` (relay/outgoing.py).
    Column("inflight", Text, nullable=False, server_default=text("'[]'")),
)

relay_nodes = Table(
    "outbox_relay_nodes",
    metadata,
    Column("node_id", String(128), primary_key=True),
    Column("expires_at_ms", BigInteger, nullable=False),
)

consumer_leases = Table(
    "outbox_consumer_leases",
    metadata,
    # One row per consumer group and partition stream: the one consumer that reads it, and the
    # fencing epoch its claim transactions re-check (consumer/ownership.py).
    Column("group_name", String(64), nullable=False),
    Column("stream", String(64), nullable=False),
    Column("partition", Integer, nullable=False, autoincrement=False),
    Column("owner", String(128)),
    Column("epoch", BigInteger, nullable=False),
    Column("expires_at_ms", BigInteger, nullable=False),
    PrimaryKeyConstraint("group_name", "stream", "partition"),
)

consumer_nodes = Table(
    "outbox_consumer_nodes",
    metadata,
    # The live consumers of each group (heartbeats), for the fair share of partition streams.
    Column("group_name", String(64), nullable=False),
    Column("consumer", String(128), nullable=False),
    Column("expires_at_ms", BigInteger, nullable=False),
    PrimaryKeyConstraint("group_name", "consumer"),
)

stream_trims = Table(
    "outbox_stream_trims",
    metadata,
    # Per partition stream: every entry below ``floor_entry_id`` was trimmed on purpose (all
    # groups had acknowledged it). Raised after the XTRIM; repair refills only at or above it.
    Column("stream", String(64), nullable=False),
    Column("partition", Integer, nullable=False, autoincrement=False),
    Column("floor_entry_id", String(48), nullable=False),
    Column("trimmed", BigInteger, nullable=False, server_default=text("0")),
    Column("updated_at_ms", BigInteger, nullable=False),
    PrimaryKeyConstraint("stream", "partition"),
)

stream_groups = Table(
    "outbox_stream_groups",
    metadata,
    # The consumer groups the relay's trims have seen on each partition stream. A known group
    # missing from the stream (Redis lost it; its consumers have not recreated it yet) holds
    # the trim: its position is unknown, so nothing more may go (relay/trim.py).
    # ``missing_since_ms``: when a trim first found it gone (NULL while present).
    Column("stream", String(64), nullable=False),
    Column("partition", Integer, nullable=False, autoincrement=False),
    Column("group_name", String(64), nullable=False),
    Column("seen_at_ms", BigInteger, nullable=False),
    Column("missing_since_ms", BigInteger),
    PrimaryKeyConstraint("stream", "partition", "group_name"),
)

streams = Table(
    "outbox_streams",
    metadata,
    # Each stream's partition count, recorded by its first write (shared/partition_counts.py):
    # a component configured with another count would strand events, so it is refused.
    Column("stream", String(64), nullable=False),
    Column("partitions", Integer, nullable=False),
    Column("created_at_ms", BigInteger, nullable=False),
    PrimaryKeyConstraint("stream"),
)

console_actions = Table(
    "outbox_console_actions",
    metadata,
    # The operator console's log of mutations (console/action_log.py): one row per replay or
    # purge request, written before the action runs (who, when, what) and completed after it
    # (how many matched and changed, outcomes by kind); ``finished_at_ms`` NULL: it never
    # finished (the server stopped mid-way). Read-only through the console; kept until deleted.
    Column("seq", SeqType, primary_key=True, autoincrement=True),
    Column("at_ms", BigInteger, nullable=False),
    Column("caller", String(64), nullable=False),
    Column("action", String(16), nullable=False),  # replay | purge
    Column("target", Text, nullable=False),  # JSON: {"ids": [...]} or {"filter": {...}}
    Column("matched", Integer),
    Column("changed", Integer),
    Column("outcomes", Text),  # JSON: {"applied": 2, "already_replayed": 1}
    Column("finished_at_ms", BigInteger),
    sqlite_autoincrement=True,
)

console_action_letters = Table(
    "outbox_console_action_letters",
    metadata,
    # What one console action did to each letter it touched, so a later request for a letter
    # that is gone can say what became of it (already replayed or purged, by whom, when).
    Column("action_seq", BigInteger, nullable=False),
    Column("letter_id", String(160), nullable=False),
    Column("outcome", String(32), nullable=False),
    Column("detail", String(500), nullable=False, server_default=text("''")),
    PrimaryKeyConstraint("action_seq", "letter_id"),
    Index("ix_outbox_console_action_letters_letter", "letter_id"),
)
