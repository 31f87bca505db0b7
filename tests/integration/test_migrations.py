"""The migrations build exactly the reference schema, on both databases."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Engine

from outbox_relay.shared import db
from outbox_relay.shared.schema import metadata

RUNS_TABLES = {"outbox_runs", "outbox_runs_schema_version"}  # the runs component's history


def test_migrations_match_reference_schema(engine: Engine) -> None:
    def core(obj: object, name: str | None, type_: str, *_: object) -> bool:
        table = name if type_ == "table" else getattr(getattr(obj, "table", None), "name", None)
        return table not in RUNS_TABLES

    with engine.connect() as conn:
        context = MigrationContext.configure(
            conn, opts={"version_table": db.VERSION_TABLE, "include_object": core})
        diff = compare_metadata(context, metadata)
    assert diff == []
    db.check_schema(engine)


def test_consumer_leases_migration_goes_down_and_up(engine: Engine) -> None:
    """0003 adds the consumer lease tables to a database at 0002 (and takes them away)."""
    from alembic import command

    with engine.begin() as conn:
        command.downgrade(db.CORE.config(conn), "0002")
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
        command.downgrade(db.CORE.config(conn), "0003")
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


def test_runs_tables_exist_only_when_asked_for_and_match_their_reference(engine: Engine) -> None:
    """The core migrations create no runs table; ``upgrade --runs`` (its own history and
    version table) creates exactly the runs component's reference schema."""
    from outbox_relay.runs import schema as runs_schema
    from outbox_relay.shared.errors import SchemaNotReadyError

    assert "outbox_runs" not in db.table_names(engine)
    assert not runs_schema.in_use(engine)
    try:
        runs_schema.check_schema(engine)
        raise AssertionError("a database without runs tables passed the runs check")
    except SchemaNotReadyError as err:
        assert "outbox db upgrade --runs" in err.message
    assert runs_schema.upgrade(engine) == runs_schema.MIGRATIONS.code_head()
    assert runs_schema.in_use(engine) and "outbox_runs" in db.table_names(engine)
    assert _runs_diff(engine) == []
    runs_schema.check_schema(engine)
    test_migrations_match_reference_schema(engine)  # the core's history is untouched


def test_a_runs_table_from_an_earlier_build_is_adopted(engine: Engine) -> None:
    """Development builds of 0.1.0 created ``outbox_runs`` in the core's first migration: the
    runs history adopts that table (its rows kept) and adds the sweeper's index."""
    import json

    from sqlalchemy import func, insert, select, text

    from outbox_relay.runs import schema as runs_schema
    from outbox_relay.runs.store import RunStore

    with engine.begin() as conn:  # the table as the earlier 0001 made it, with a run in it
        conn.execute(text(
            "CREATE TABLE outbox_runs (id VARCHAR(128) NOT NULL, revision BIGINT NOT NULL, "
            "status VARCHAR(32) NOT NULL, record TEXT NOT NULL, lease_owner VARCHAR(128), "
            "lease_expires_at_ms BIGINT, attempts INTEGER DEFAULT '0' NOT NULL, "
            "created_at_ms BIGINT NOT NULL, updated_at_ms BIGINT NOT NULL, "
            "CONSTRAINT pk_outbox_runs PRIMARY KEY (id))"))
        conn.execute(text("CREATE INDEX ix_outbox_runs_status_lease ON outbox_runs "
                          "(status, lease_expires_at_ms)"))
        conn.execute(insert(runs_schema.runs).values(
            id="old", revision=1, status="queued", record='{"revision":1}', attempts=0,
            created_at_ms=1, updated_at_ms=1))
        waiting = {"revision": 3, "status": "needs_input", "asked_by": "analyzing_jd",
                   "questions": [{"interaction_id": "q", "prompt": "?", "stage": None}]}
        conn.execute(insert(runs_schema.runs).values(
            id="waiting", revision=3, status="needs_input", record=json.dumps(waiting),
            attempts=0, created_at_ms=1, updated_at_ms=1))
    runs_schema.upgrade(engine)
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(runs_schema.runs)).scalar() == 2
    with engine.begin() as conn:  # answerable by the HTTP API's store (no pipeline)
        answered = RunStore().submit_answer(conn, "waiting", "q", "yes", "k1").row
    assert (answered.status, answered.revision) == ("matching_evidence", 4)
    assert _runs_diff(engine) == []


def _runs_diff(engine: Engine) -> list[object]:
    """The runs reference schema against the database, on ``outbox_runs`` only (the core's
    tables belong to the other history)."""
    from outbox_relay.runs import schema as runs_schema

    def ours(obj: object, name: str | None, type_: str, *_: object) -> bool:
        table = name if type_ == "table" else getattr(getattr(obj, "table", None), "name", None)
        return table == "outbox_runs"

    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={
            "version_table": runs_schema.MIGRATIONS.version_table, "include_object": ours})
        return list(compare_metadata(context, runs_schema.metadata))
