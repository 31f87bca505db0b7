"""Producer side on both databases: enqueue in the caller's transaction, the run store, and the
schema guard every component relies on."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import Connection, Engine, func, select, text, update
from sqlalchemy.orm import Session

from outbox_relay.cli import demo_app as jobs
from outbox_relay.producer import Producer
from outbox_relay.runs.schema import runs
from outbox_relay.runs.store import RunStore
from outbox_relay.shared import db
from outbox_relay.shared.errors import (
    ConflictError,
    CorruptRecordError,
    DuplicateEventError,
    InvalidEventError,
    NotFoundError,
    SchemaNotReadyError,
    SchemaTooNewError,
)
from outbox_relay.shared.schema import outbox

pytestmark = pytest.mark.integration

NEXT = jobs.PIPELINE.stages[0]  # the first move a queued run may make
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def count(conn: Connection | Engine, table: Any) -> int:
    if isinstance(conn, Engine):
        with conn.connect() as c:
            return count(c, table)
    return int(conn.execute(select(func.count()).select_from(table)).scalar_one())


def enqueue_one(producer: Producer, conn: Connection | Session, revision: int = 1) -> str:
    return producer.enqueue(
        conn, type="thing.happened", stream="things", data={"n": revision},
        aggregate_type="thing", aggregate_id="thing-1", revision=revision,
    )


# --- enqueue -------------------------------------------------------------------------------


@pytest.mark.usefixtures("runs_tables")
def test_rollback_leaves_neither_run_nor_outbox_row(engine: Engine) -> None:
    with engine.connect() as conn:
        tx = conn.begin()
        RunStore(pipeline=jobs.PIPELINE).create(conn, "run-1", {"request": {}})
        enqueue_one(Producer(), conn, 7)
        assert count(conn, runs) == 1 and count(conn, outbox) == 2  # visible inside
        tx.rollback()
    assert count(engine, runs) == 0
    assert count(engine, outbox) == 0


@pytest.mark.usefixtures("runs_tables")
def test_commit_leaves_both_rows(engine: Engine) -> None:
    with engine.begin() as conn:
        RunStore(pipeline=jobs.PIPELINE).create(conn, "run-1", {"request": {"x": 1}})
    with engine.connect() as conn:
        row = conn.execute(select(outbox)).one()
        assert count(conn, runs) == 1
    assert row.event_id == "run-1:run.created:1"
    assert (row.stream, row.aggregate_type, row.aggregate_id, row.revision) == (
        "runs", "run", "run-1", 1)
    assert row.delivered_at_ms is None and row.entry_id is None


def test_enqueued_row_carries_the_event(engine: Engine) -> None:
    producer = Producer(source="svc", partitions=4)
    with engine.begin() as conn:
        event_id = producer.enqueue(
            conn, type="thing.happened", stream="things", data={"k": ["v", 1]},
            aggregate_type="thing", aggregate_id="thing-9", revision=3, traceparent=TRACEPARENT,
            delay_ms=60_000,
        )
    with engine.connect() as conn:
        row = conn.execute(select(outbox)).one()
    assert event_id == row.event_id == "thing-9:thing.happened:3"
    assert row.source == "svc"
    assert row.payload == '{"k":["v",1]}'
    assert TRACEPARENT in row.headers
    # available_at: the database's clock + delay; created_at: the producer's (same host here)
    assert abs(row.available_at_ms - row.created_at_ms - 60_000) < 1_000
    assert 0 <= row.partition < 4


def test_events_without_aggregate_get_distinct_random_ids(engine: Engine) -> None:
    with engine.begin() as conn:
        ids = {Producer().enqueue(conn, type="ping", stream="things") for _ in range(3)}
    assert len(ids) == 3
    assert count(engine, outbox) == 3


@pytest.mark.usefixtures("runs_tables")
def test_duplicate_enqueue_keeps_the_transaction_usable(engine: Engine) -> None:
    producer = Producer()
    with engine.connect() as conn:
        tx = conn.begin()
        enqueue_one(producer, conn, 1)
        with pytest.raises(DuplicateEventError) as info:
            enqueue_one(producer, conn, 1)
        assert info.value.code == "duplicate_event"
        # On PostgreSQL a failed statement would abort the transaction: it must not have.
        enqueue_one(producer, conn, 2)
        RunStore(pipeline=jobs.PIPELINE).create(conn, "run-after-duplicate", {})
        tx.commit()
    with engine.connect() as conn:
        ids = sorted(r[0] for r in conn.execute(select(outbox.c.event_id)))
    assert ids == ["run-after-duplicate:run.created:1", "thing-1:thing.happened:1",
                   "thing-1:thing.happened:2"]


def test_duplicate_of_a_committed_event_in_a_later_transaction(engine: Engine) -> None:
    producer = Producer()
    with engine.begin() as conn:
        enqueue_one(producer, conn, 1)
    with engine.begin() as conn:
        with pytest.raises(DuplicateEventError):
            enqueue_one(producer, conn, 1)
        enqueue_one(producer, conn, 2)
    assert count(engine, outbox) == 2


@pytest.mark.parametrize(
    ("changes", "code"),
    [
        ({"type": "bad type"}, "bad_type"),
        ({"type": ""}, "bad_type"),
        ({"stream": "bad:stream"}, "bad_stream"),
        ({"stream": "x" * 65}, "bad_stream"),
        ({"aggregate_id": "a" * 257}, "bad_field"),
        ({"aggregate_type": "nul\x00"}, "bad_field"),
        ({"revision": 2**63}, "bad_revision"),
        ({"data": "\ud800"}, "bad_encoding"),
        ({"data": object()}, "bad_json"),
        ({"data": {"x": float("nan")}}, "bad_json"),
        ({"data": "x" * 200}, "data_too_large"),
        ({"traceparent": "not-a-trace"}, "bad_field"),
        ({"revision": -1}, "bad_revision"),
        ({"revision": "3"}, "bad_revision"),
        ({"delay_ms": -5}, "bad_field"),
        ({"event_id": ""}, "bad_field"),
        ({"event_id": "e" * 513}, "bad_field"),
    ],
)
def test_invalid_events_are_refused_with_their_code(
    engine: Engine, changes: dict[str, Any], code: str
) -> None:
    producer = Producer(max_data_bytes=100)
    event: dict[str, Any] = {"type": "thing.happened", "stream": "things", "data": {"ok": 1},
                             "aggregate_id": "thing-1", "revision": 1, **changes}
    with engine.begin() as conn:
        with pytest.raises(InvalidEventError) as info:
            producer.enqueue(conn, **event)
        assert info.value.code == code
        enqueue_one(producer, conn, 5)  # the transaction is still usable
    assert count(engine, outbox) == 1


def test_enqueue_through_a_session(engine: Engine) -> None:
    producer = Producer()
    with Session(engine) as session, session.begin():
        enqueue_one(producer, session, 1)
        with pytest.raises(DuplicateEventError):
            enqueue_one(producer, session, 1)
    with Session(engine) as session:
        session.begin()
        enqueue_one(producer, session, 2)
        session.rollback()
    with engine.connect() as conn:
        assert conn.execute(select(outbox.c.event_id)).scalars().all() == [
            "thing-1:thing.happened:1"]


# --- run store -----------------------------------------------------------------------------


@pytest.mark.usefixtures("runs_tables")
def test_create_writes_the_run_and_its_event_together(engine: Engine) -> None:
    store = RunStore(pipeline=jobs.PIPELINE)
    with engine.begin() as conn:
        created = store.create(conn, "run-1", {"request": {"q": "hi"}})
    assert (created.revision, created.status) == (1, "queued")
    with engine.connect() as conn:
        stored = store.get(conn, "run-1")
        assert conn.execute(select(outbox.c.event_id)).scalars().all() == ["run-1:run.created:1"]
    assert stored.record == {"request": {"q": "hi"}, "revision": 1, "status": "queued"}


@pytest.mark.usefixtures("runs_tables")
def test_create_of_an_existing_run_is_a_conflict_and_keeps_the_transaction(
    engine: Engine,
) -> None:
    store = RunStore(pipeline=jobs.PIPELINE)
    with engine.begin() as conn:
        store.create(conn, "run-1", {})
        with pytest.raises(ConflictError) as info:
            store.create(conn, "run-1", {})
        assert info.value.code == "conflict"
        store.create(conn, "run-2", {})
    assert count(engine, runs) == 2
    assert count(engine, outbox) == 2


@pytest.mark.usefixtures("runs_tables")
def test_compare_and_set_advances_and_enqueues(engine: Engine) -> None:
    store = RunStore(pipeline=jobs.PIPELINE)
    with engine.begin() as conn:
        store.create(conn, "run-1", {"request": {}})
    with engine.begin() as conn:
        row = store.compare_and_set(conn, "run-1", 1, {"request": {}, "stage": 1},
                                    status=NEXT, event="run.resume", lease_owner="w1",
                                    lease_expires_at_ms=123, attempts=1)
    assert (row.revision, row.status, row.record["stage"]) == (2, NEXT, 1)
    assert (row.lease_owner, row.lease_expires_at_ms, row.attempts) == ("w1", 123, 1)
    with engine.connect() as conn:
        ids = sorted(conn.execute(select(outbox.c.event_id)).scalars())
    assert ids == ["run-1:run.created:1", "run-1:run.resume:2"]


@pytest.mark.usefixtures("runs_tables")
def test_compare_and_set_with_a_wrong_revision_is_a_conflict(engine: Engine) -> None:
    store = RunStore(pipeline=jobs.PIPELINE)
    with engine.begin() as conn:
        store.create(conn, "run-1", {})
    with engine.begin() as conn:
        for stale in (0, 2):
            with pytest.raises(ConflictError) as info:
                store.compare_and_set(conn, "run-1", stale, {}, status=NEXT, event="x")
            assert info.value.code == "conflict"
        assert store.get(conn, "run-1").revision == 1
    assert count(engine, outbox) == 1  # no event for a write that did not happen


@pytest.mark.usefixtures("runs_tables")
def test_compare_and_set_of_a_missing_run_is_not_found(engine: Engine) -> None:
    with engine.begin() as conn, pytest.raises(NotFoundError) as info:
        RunStore(pipeline=jobs.PIPELINE).compare_and_set(conn, "nope", 1, {}, status=NEXT)
    assert info.value.code == "not_found"
    with engine.connect() as conn, pytest.raises(NotFoundError):
        RunStore(pipeline=jobs.PIPELINE).get(conn, "nope")


@pytest.mark.parametrize(
    "record", ['{"revision":2,"status":"queued"}', '{"status":"queued"}', "not json", "[1]"]
)
@pytest.mark.usefixtures("runs_tables")
def test_a_record_that_disagrees_with_its_row_is_corrupt(engine: Engine, record: str) -> None:
    store = RunStore(pipeline=jobs.PIPELINE)
    with engine.begin() as conn:
        store.create(conn, "run-1", {})
        conn.execute(update(runs).where(runs.c.id == "run-1").values(record=record))
    with engine.connect() as conn, pytest.raises(CorruptRecordError) as info:
        store.get(conn, "run-1")
    assert info.value.code == "corrupt_record"


# --- schema guard --------------------------------------------------------------------------


def test_an_unmigrated_database_is_not_ready(database_url: str) -> None:
    engine = db.make_engine(database_url)
    try:
        with pytest.raises(SchemaNotReadyError) as info:
            db.check_schema(engine)
        assert info.value.code == "schema_not_ready"
        assert db.upgrade(engine) == db.code_head()
        db.check_schema(engine)
        assert db.upgrade(engine) == db.code_head()  # idempotent
    finally:
        engine.dispose()


def test_a_database_from_a_newer_release_is_refused(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(text(f"UPDATE {db.VERSION_TABLE} SET version_num = 'ffff_from_future'"))
    with pytest.raises(SchemaTooNewError) as info:
        db.check_schema(engine)
    assert info.value.code == "schema_too_new"
    with pytest.raises(SchemaTooNewError):
        db.upgrade(engine)
    with engine.connect() as conn:  # upgrade did not touch it
        assert db.database_revision(conn) == "ffff_from_future"
