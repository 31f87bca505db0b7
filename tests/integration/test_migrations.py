"""The migrations build exactly the reference schema, on both databases."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Engine

from outbox_relay.shared import db
from outbox_relay.shared.schema import metadata


def test_migrations_match_reference_schema(engine: Engine) -> None:
    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"version_table": db.VERSION_TABLE})
        diff = compare_metadata(context, metadata)
    assert diff == []
    db.check_schema(engine)


def test_consumer_leases_migration_goes_down_and_up(engine: Engine) -> None:
    """0003 adds the consumer lease tables to a database at 0002 (and takes them away)."""
    from alembic import command

    with engine.begin() as conn:
        command.downgrade(db._alembic_config(conn), "0002")
    assert {"outbox_consumer_leases", "outbox_consumer_nodes"}.isdisjoint(db.table_names(engine))
    with engine.connect() as conn:
        assert db.database_revision(conn) == "0002"
    assert db.upgrade(engine) == db.code_head()
    assert {"outbox_consumer_leases", "outbox_consumer_nodes"} <= set(db.table_names(engine))
    test_migrations_match_reference_schema(engine)


def test_retention_migration_registers_the_streams_already_delivered_to(engine: Engine) -> None:
    """0004 makes every stream the outbox delivered to known (trim floor 0-0), so repair
    checks and trims never scan the outbox for them; it goes down and up cleanly."""
    from alembic import command
    from sqlalchemy import insert, select

    from outbox_relay.shared.schema import outbox, stream_trims

    with engine.begin() as conn:
        command.downgrade(db._alembic_config(conn), "0003")
    assert "outbox_stream_trims" not in db.table_names(engine)
    row = {"stream": "s", "type": "t", "source": "x", "payload": "{}", "headers": "{}",
           "created_at_ms": 1, "available_at_ms": 1}
    with engine.begin() as conn:
        conn.execute(insert(outbox), [
            {**row, "event_id": "a", "partition": 0, "entry_id": "1700000000000-1",
             "delivered_at_ms": 2},
            {**row, "event_id": "b", "partition": 0, "entry_id": "1700000000000-2",
             "delivered_at_ms": 2},
            {**row, "event_id": "c", "partition": 1, "entry_id": None,
             "delivered_at_ms": None},  # never delivered: not a known stream
        ])
    assert db.upgrade(engine) == db.code_head()
    with engine.connect() as conn:
        known = conn.execute(select(stream_trims.c.stream, stream_trims.c.partition,
                                    stream_trims.c.floor_entry_id)).all()
    assert [tuple(r) for r in known] == [("s", 0, "0-0")]
    test_migrations_match_reference_schema(engine)
