"""The torture's ground truth: what was enqueued, marked delivered, received and pruned.

With retention on, the daemons delete on purpose what the checker used to read: delivered
outbox rows (``OUTBOX_RETENTION_DELIVERED``), inbox receipts and heads
(``OUTBOX_RETENTION_INBOX``), and stream entries every group acknowledged (the relay's trim).
So the harness installs, right after the migrations and before any daemon starts, database
triggers that copy every change of those tables into tables the daemons never touch:

- ``torture_ledger``: one row per outbox event, written by an ``INSERT`` trigger on
  ``outbox_events`` (id, seq, stream, partition, type, aggregate, revision; ``enqueued`` counts
  the inserts of that id: above 1 an id was reused after its row was pruned). An ``UPDATE``
  trigger copies ``entry_id`` and ``delivered_at_ms`` when a row is marked delivered (or its
  delivered entry id changes) and counts it in ``marks`` (1 for a healthy event). A ``DELETE``
  trigger stamps ``pruned_at_ms`` (the database's clock).
- ``torture_receipt_ledger``: one row per ``(group, event id)`` receipt; ``entry_id`` is the
  stream entry the group first received the event from (never changed; ``last_entry_id`` that
  of the latest insert), ``outcome``/``reason``/
  ``duplicates``/``created_at_ms`` follow the receipt's updates, ``inserts`` counts its inserts
  (above 1: the receipt was pruned and the event came back). The ``DELETE`` trigger stamps
  ``pruned_at_ms`` and ``floor_at_prune``: the trim floor of the event's partition stream at
  that moment (floors only rise, so the check against it is never laxer than the pruner's).
- ``torture_pruned_heads``: every aggregate head the consumers deleted.

The triggers run inside the daemons' own transactions, so the ledger commits with the change it
records or not at all, whoever made it and however it died. Triggers exist in both dialects
(PL/pgSQL functions on PostgreSQL, ``CREATE TRIGGER … BEGIN … END`` on SQLite).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    Engine,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    exists,
    func,
    select,
)

from outbox_relay.shared.db import is_postgres
from outbox_relay.shared.schema import inbox, inbox_heads, outbox, stream_trims

metadata = MetaData()

events = Table(
    "torture_ledger",
    metadata,
    Column("event_id", String(512), primary_key=True),
    Column("seq", BigInteger, nullable=False),
    Column("stream", String(64), nullable=False),
    Column("partition", Integer, nullable=False),
    Column("type", String(256), nullable=False),
    Column("aggregate_type", String(128)),
    Column("aggregate_id", String(256)),
    Column("revision", BigInteger),
    Column("enqueued", Integer, nullable=False),
    Column("entry_id", String(48)),
    Column("delivered_at_ms", BigInteger),
    Column("marks", Integer, nullable=False),
    Column("pruned_at_ms", BigInteger),
)

receipts = Table(
    "torture_receipt_ledger",
    metadata,
    Column("group_name", String(64), nullable=False),
    Column("event_id", String(512), nullable=False),
    Column("stream_key", String(256), nullable=False),
    Column("entry_id", String(48), nullable=False),
    Column("last_entry_id", String(48)),  # of the latest insert (a recreated receipt's)
    Column("outcome", String(16), nullable=False),
    Column("reason", String(64)),
    Column("duplicates", Integer, nullable=False),
    Column("created_at_ms", BigInteger, nullable=False),
    Column("inserts", Integer, nullable=False),
    Column("pruned_at_ms", BigInteger),
    Column("floor_at_prune", String(48)),
    PrimaryKeyConstraint("group_name", "event_id"),
)

pruned_heads = Table(
    "torture_pruned_heads",
    metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True,
           autoincrement=True),
    Column("group_name", String(64), nullable=False),
    Column("aggregate_type", String(128), nullable=False),
    Column("aggregate_id", String(256), nullable=False),
    Column("revision", BigInteger, nullable=False),
    Column("pruned_at_ms", BigInteger, nullable=False),
)

_EVENT_COLUMNS = "event_id, seq, stream, partition, type, aggregate_type, aggregate_id, revision"
_NEW_EVENT = ", ".join(f"NEW.{c.strip()}" for c in _EVENT_COLUMNS.split(","))
_RECEIPT_COLUMNS = "group_name, event_id, stream_key, entry_id, outcome, reason, duplicates, " \
    "created_at_ms"
_NEW_RECEIPT = ", ".join(f"NEW.{c.strip()}" for c in _RECEIPT_COLUMNS.split(","))
_FLOOR_OF_OLD = (
    "(SELECT t.floor_entry_id FROM outbox_stream_trims t JOIN torture_ledger l "
    "ON t.stream = l.stream AND t.partition = l.partition WHERE l.event_id = OLD.event_id)"
)
_MARKED = ("NEW.delivered_at_ms IS NOT NULL AND (OLD.delivered_at_ms IS NULL OR "
           "OLD.entry_id IS DISTINCT FROM NEW.entry_id)")

# (trigger name, table, timing clause, WHEN condition or "", body statements). The bodies are
# written once; NOW_MS is replaced by each dialect's clock.
_TRIGGERS: list[tuple[str, str, str, str, list[str]]] = [
    ("torture_ledger_enqueued", "outbox_events", "AFTER INSERT", "", [
        f"INSERT INTO torture_ledger ({_EVENT_COLUMNS}, enqueued, marks) "
        f"VALUES ({_NEW_EVENT}, 0, 0) ON CONFLICT (event_id) DO NOTHING",
        "UPDATE torture_ledger SET enqueued = enqueued + 1 WHERE event_id = NEW.event_id",
    ]),
    ("torture_ledger_marked", "outbox_events", "AFTER UPDATE", _MARKED, [
        "UPDATE torture_ledger SET entry_id = NEW.entry_id, "
        "delivered_at_ms = NEW.delivered_at_ms, marks = marks + 1 "
        "WHERE event_id = NEW.event_id",
    ]),
    ("torture_ledger_pruned", "outbox_events", "AFTER DELETE", "", [
        "UPDATE torture_ledger SET pruned_at_ms = NOW_MS WHERE event_id = OLD.event_id",
    ]),
    ("torture_receipt_inserted", "outbox_inbox", "AFTER INSERT", "", [
        f"INSERT INTO torture_receipt_ledger ({_RECEIPT_COLUMNS}, inserts) "
        f"VALUES ({_NEW_RECEIPT}, 0) ON CONFLICT (group_name, event_id) DO NOTHING",
        "UPDATE torture_receipt_ledger SET inserts = inserts + 1, outcome = NEW.outcome, "
        "last_entry_id = NEW.entry_id, "
        "reason = NEW.reason, duplicates = NEW.duplicates, created_at_ms = NEW.created_at_ms "
        "WHERE group_name = NEW.group_name AND event_id = NEW.event_id",
    ]),
    ("torture_receipt_updated", "outbox_inbox", "AFTER UPDATE", "", [
        "UPDATE torture_receipt_ledger SET outcome = NEW.outcome, reason = NEW.reason, "
        "duplicates = NEW.duplicates, created_at_ms = NEW.created_at_ms "
        "WHERE group_name = NEW.group_name AND event_id = NEW.event_id",
    ]),
    ("torture_receipt_pruned", "outbox_inbox", "AFTER DELETE", "", [
        f"UPDATE torture_receipt_ledger SET pruned_at_ms = NOW_MS, "
        f"floor_at_prune = {_FLOOR_OF_OLD} "
        "WHERE group_name = OLD.group_name AND event_id = OLD.event_id",
    ]),
    ("torture_head_pruned", "outbox_inbox_heads", "AFTER DELETE", "", [
        "INSERT INTO torture_pruned_heads (group_name, aggregate_type, aggregate_id, revision, "
        "pruned_at_ms) VALUES (OLD.group_name, OLD.aggregate_type, OLD.aggregate_id, "
        "OLD.revision, NOW_MS)",
    ]),
]

_PG_NOW_MS = "CAST(floor(extract(epoch FROM clock_timestamp()) * 1000) AS BIGINT)"
_SQLITE_NOW_MS = "CAST(round((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)"


def trigger_ddl(postgres: bool) -> list[str]:
    """The statements that create every ledger trigger (idempotent) in one dialect."""
    ddl = []
    for name, table, timing, when, body in _TRIGGERS:
        if postgres:
            statements = "".join(f"  {s.replace('NOW_MS', _PG_NOW_MS)};\n" for s in body)
            ddl.append(f"CREATE OR REPLACE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql "
                       f"AS $fn$\nBEGIN\n{statements}  RETURN NULL;\nEND\n$fn$")
            condition = f" WHEN ({when})" if when else ""
            ddl.append(f"CREATE OR REPLACE TRIGGER {name} {timing} ON {table} FOR EACH ROW"
                       f"{condition} EXECUTE FUNCTION {name}()")
        else:
            statements = "".join(f"  {s.replace('NOW_MS', _SQLITE_NOW_MS)};\n" for s in body)
            condition = f" WHEN {when.replace('IS DISTINCT FROM', 'IS NOT')}" if when else ""
            ddl.append(f"CREATE TRIGGER IF NOT EXISTS {name} {timing} ON {table} FOR EACH ROW"
                       f"{condition}\nBEGIN\n{statements}END")
    return ddl


def install(engine: Engine) -> None:
    """Create the ledger tables and triggers (idempotent). Call after the migrations and before
    anything writes an outbox row: the ledger only knows what happened after it."""
    metadata.create_all(engine)
    with engine.begin() as conn:
        for statement in trigger_ddl(is_postgres(engine)):
            conn.exec_driver_sql(statement)


def unreceived(engine: Engine, group: str, stream: str | None = None) -> int:
    """Events of the ledger (of ``stream``, or all) that ``group`` has never had a receipt for
    (pruned receipts count as had)."""
    where = [~exists().where(receipts.c.group_name == group,
                             receipts.c.event_id == events.c.event_id)]
    if stream is not None:
        where.append(events.c.stream == stream)
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(events).where(*where))
                   .scalar_one())


def received(engine: Engine, group: str) -> int:
    """Events ``group`` has had a receipt for (pruned receipts count)."""
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(receipts)
                                .where(receipts.c.group_name == group)).scalar_one())


def sizes(engine: Engine) -> dict[str, int]:
    """Row counts of the daemons' tables next to the ledger's: what retention removed."""
    with engine.connect() as conn:
        def count(table: Any, *where: Any) -> int:
            return int(conn.execute(select(func.count()).select_from(table).where(*where))
                       .scalar_one())

        trimmed = conn.execute(select(func.coalesce(func.sum(stream_trims.c.trimmed), 0)))
        return {
            "outbox_rows": count(outbox),
            "ledger_events": count(events),
            "outbox_rows_pruned": count(events, events.c.pruned_at_ms.is_not(None)),
            "inbox_receipts": count(inbox),
            "ledger_receipts": count(receipts),
            "receipts_pruned": count(receipts, receipts.c.pruned_at_ms.is_not(None)),
            "inbox_heads": count(inbox_heads),
            "heads_pruned": count(pruned_heads),
            "trim_floors": count(stream_trims),
            "trimmed_recorded": int(trimmed.scalar_one()),
        }
