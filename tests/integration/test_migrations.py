"""The migrations build exactly the reference schema, on both databases."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Engine

from shared import db
from shared.schema import metadata


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
