"""The outbox's stream-entry index is partial (migration 0009), and every lookup by entry id
can still use it: a lookup whose filter does not imply ``entry_id IS NOT NULL`` would
silently scan the outbox instead (the planner may not use a partial index it cannot prove
applies). Checked by the plans of the statements the lookups actually send."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from alembic import command
from sqlalchemy import Engine, event, insert, text

from outbox_relay.consumer import lost
from outbox_relay.consumer.streams import Entry
from outbox_relay.relay import repair_store
from outbox_relay.shared import db, keys
from outbox_relay.shared.schema import outbox, stream_trims

INDEX = "ix_outbox_events_stream_entry"
PREFIX = "ix-test"


def _index_sql(engine: Engine) -> str:
    with engine.connect() as conn:
        if db.is_postgres(engine):
            found = conn.execute(text(
                "SELECT indexdef FROM pg_indexes WHERE indexname = :n "
                "AND schemaname = current_schema()"), {"n": INDEX}).scalar_one()
        else:
            found = conn.execute(text(
                "SELECT sql FROM sqlite_master WHERE type = 'index' AND name = :n"),
                {"n": INDEX}).scalar_one()
    return str(found)


def test_the_index_is_partial_and_the_migration_goes_down_and_up(engine: Engine) -> None:
    assert "entry_id IS NOT NULL" in _index_sql(engine)
    with engine.begin() as conn:
        command.downgrade(db.CORE.config(conn), "0008")
    assert "IS NOT NULL" not in _index_sql(engine)  # the full index of 0001
    assert db.upgrade(engine) == db.code_head()
    assert "entry_id IS NOT NULL" in _index_sql(engine)


def _seed(engine: Engine) -> None:
    row = {"stream": "orders", "partition": 0, "type": "t", "source": "x", "payload": "{}",
           "headers": "{}", "created_at_ms": 1, "available_at_ms": 1}
    with engine.begin() as conn:
        conn.execute(insert(outbox), [
            {**row, "event_id": f"e{i}", "entry_id": f"1700000000000-{i}" if i < 50 else None,
             "delivered_at_ms": 2 if i < 50 else None}
            for i in range(1, 100)
        ])
        conn.execute(insert(stream_trims), [{"stream": "orders", "partition": 0,
                                             "floor_entry_id": "0-0", "updated_at_ms": 1}])


@contextmanager
def _captured(engine: Engine) -> Iterator[list[tuple[str, Any]]]:
    """Every statement (with its parameters) sent to the outbox table while inside."""
    sent: list[tuple[str, Any]] = []

    def capture(conn: Any, cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if "outbox_events" in statement and "entry_id" in statement:
            sent.append((statement, parameters))

    event.listen(engine, "before_cursor_execute", capture)
    try:
        yield sent
    finally:
        event.remove(engine, "before_cursor_execute", capture)


def _plan(engine: Engine, statement: str, parameters: Any) -> str:
    """The plan of ``statement``; on PostgreSQL with sequential scans priced out, so a plan
    that still scans says the index could not be used at all (not that it was not worth it
    on a small table)."""
    with engine.connect() as conn:
        raw = conn.connection.driver_connection
        assert raw is not None
        cursor = raw.cursor()
        if db.is_postgres(engine):
            cursor.execute("SET LOCAL enable_seqscan = off")
            cursor.execute("SET LOCAL enable_bitmapscan = off")
            cursor.execute("EXPLAIN " + statement, parameters)
        else:
            cursor.execute("EXPLAIN QUERY PLAN " + statement, parameters)
        plan = "\n".join(str(r) for r in cursor.fetchall())
        conn.rollback()
    return plan


def test_every_lookup_by_entry_id_can_use_the_partial_index(engine: Engine) -> None:
    _seed(engine)
    key = keys.stream_key(PREFIX, "orders", 0)
    with _captured(engine) as sent:
        assert repair_store.delivered_counts(engine, [0]) == {("orders", 0): 49}
        assert repair_store.newest_delivered_id(engine, "orders", 0) == "1700000000000-49"
        assert len(repair_store.delivered_rows(engine, "orders", 0)) == 49
        assert repair_store.accounted_ids(
            engine, "orders", 0, ["1700000000000-3", "1700000000000-77"]) == {
            "1700000000000-3"}
        with engine.connect() as conn:
            found = lost._outbox_fields(conn, PREFIX, [
                Entry(key, "1700000000000-7", None), Entry(key, "1700000000000-8", None)])
        assert {entry_id for _, entry_id in found} == {"1700000000000-7", "1700000000000-8"}
    assert len(sent) >= 6  # the count, the newest id's two, the rows, the ids, the fields
    for statement, parameters in sent:
        plan = _plan(engine, statement, parameters)
        assert INDEX in plan, f"{statement}\n{plan}"
