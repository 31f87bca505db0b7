"""``enqueue_many`` (a list of events in one multi-row insert) and producers with
``notify=False``, on both databases: all or nothing, duplicates, order through a relay, and a
running relay finding rows nobody announced."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import redis
from sqlalchemy import Engine, select, text
from sqlalchemy.orm import Session

from outbox_relay.producer import Producer, statements
from outbox_relay.relay.daemon import Relay
from outbox_relay.shared import db, keys
from outbox_relay.shared.errors import ConfigError, DuplicateEventError, InvalidEventError
from outbox_relay.shared.schema import outbox
from tests.helpers import (
    PARTITIONS,
    STREAM,
    assert_all_marked,
    assert_each_once,
    outbox_rows,
    partition_of,
    relay_settings,
    stream_entries,
    undelivered,
    wait_until,
)

pytestmark = pytest.mark.integration


def events(aggregates: int, revisions: int, first: int = 1) -> list[dict[str, Any]]:
    """Revisions ``first..`` of ``aggregates`` aggregates, interleaved, as keyword mappings."""
    return [{"type": "thing.happened", "stream": STREAM, "data": {"r": r},
             "aggregate_type": "thing", "aggregate_id": f"agg-{a}", "revision": r}
            for r in range(first, first + revisions) for a in range(aggregates)]


def event_ids(engine: Engine) -> list[str]:
    """Every row's event id in ``seq`` order."""
    return [r.event_id for r in outbox_rows(engine)]


def mark(conn: Any, note: str) -> None:
    """A business write of the caller's transaction (an outbox row of another stream)."""
    Producer(partitions=PARTITIONS).enqueue(conn, type="note", stream="notes", event_id=note)


# --- enqueue_many ------------------------------------------------------------------------------


@pytest.mark.parametrize("notify", [True, False])
def test_a_list_is_inserted_in_list_order_and_its_ids_returned(
    engine: Engine, notify: bool
) -> None:
    producer = Producer(source="svc", partitions=PARTITIONS, notify=notify)
    batch = events(3, 4)
    with engine.begin() as conn:
        ids = producer.enqueue_many(conn, batch)
    assert ids == [f"{e['aggregate_id']}:thing.happened:{e['revision']}" for e in batch]
    assert event_ids(engine) == ids  # seq follows the list
    rows = outbox_rows(engine)
    assert {r.source for r in rows} == {"svc"}
    assert [r.partition for r in rows] == [partition_of(e["aggregate_id"]) for e in batch]
    assert [r.payload for r in rows] == [f'{{"r":{e["revision"]}}}' for e in batch]


def test_an_empty_list_writes_nothing(engine: Engine) -> None:
    with engine.begin() as conn:
        assert Producer().enqueue_many(conn, []) == []
    assert event_ids(engine) == []


def test_rollback_takes_the_whole_list_back(engine: Engine) -> None:
    with engine.connect() as conn:
        tx = conn.begin()
        Producer(partitions=PARTITIONS).enqueue_many(conn, events(2, 3))
        assert len(event_ids_in(conn)) == 6  # visible inside
        tx.rollback()
    assert event_ids(engine) == []


def event_ids_in(conn: Any) -> list[str]:
    return list(conn.execute(select(outbox.c.event_id).order_by(outbox.c.seq)).scalars())


def test_an_id_twice_in_the_list_inserts_nothing_and_keeps_the_transaction(
    engine: Engine,
) -> None:
    producer = Producer(partitions=PARTITIONS)
    batch = [*events(2, 2), events(2, 2)[1]]  # agg-1's revision 1 again at the end
    with engine.begin() as conn:
        mark(conn, "before")
        with pytest.raises(DuplicateEventError) as info:
            producer.enqueue_many(conn, batch)
        assert info.value.code == "duplicate_event"
        assert "agg-1:thing.happened:1" in str(info.value)
        mark(conn, "after")
    assert event_ids(engine) == ["before", "after"]


@pytest.mark.parametrize("rows_per_statement", [statements.ROWS_PER_STATEMENT, 2])
def test_an_id_already_in_the_table_inserts_nothing_and_keeps_the_transaction(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, rows_per_statement: int
) -> None:
    """A duplicate anywhere (with 2 rows a statement: in the last of several statements)
    takes back the rows inserted before it was seen; the caller's other writes stay."""
    monkeypatch.setattr(statements, "ROWS_PER_STATEMENT", rows_per_statement)
    producer = Producer(partitions=PARTITIONS)
    with engine.begin() as conn:
        producer.enqueue_many(conn, events(1, 1, first=3))  # agg-0 revision 3
    with engine.begin() as conn:
        mark(conn, "before")
        with pytest.raises(DuplicateEventError) as info:
            producer.enqueue_many(conn, events(1, 3))  # revisions 1, 2, 3
        assert "agg-0:thing.happened:3" in str(info.value)
        assert event_ids_in(conn) == ["agg-0:thing.happened:3", "before"]
        assert producer.enqueue_many(conn, events(1, 2)) == [  # still usable
            "agg-0:thing.happened:1", "agg-0:thing.happened:2"]
    assert event_ids(engine) == ["agg-0:thing.happened:3", "before", "agg-0:thing.happened:1",
                                 "agg-0:thing.happened:2"]


def test_a_list_longer_than_one_statement_is_inserted_whole_and_in_order(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(statements, "ROWS_PER_STATEMENT", 4)
    batch = events(3, 3)  # 9 events: statements of 4, 4 and 1 rows
    with engine.begin() as conn:
        ids = Producer(partitions=PARTITIONS).enqueue_many(conn, batch)
    assert len(ids) == 9 and event_ids(engine) == ids


def test_an_invalid_event_anywhere_sends_nothing(engine: Engine) -> None:
    batch = [*events(1, 2), {"type": "bad type", "stream": STREAM}]
    with engine.begin() as conn:
        with pytest.raises(InvalidEventError) as info:
            Producer(partitions=PARTITIONS).enqueue_many(conn, batch)
        assert info.value.code == "bad_type"
        mark(conn, "after")
    assert event_ids(engine) == ["after"]


def test_a_stream_written_with_another_partition_count_is_refused(engine: Engine) -> None:
    with engine.begin() as conn:
        Producer(partitions=PARTITIONS).enqueue_many(conn, events(1, 1))
    with engine.begin() as conn, pytest.raises(ConfigError):
        Producer(partitions=PARTITIONS * 2).enqueue_many(conn, events(1, 1, first=2))
    assert event_ids(engine) == ["agg-0:thing.happened:1"]


def test_enqueue_many_through_a_session(engine: Engine) -> None:
    with Session(engine) as session, session.begin():
        ids = Producer(partitions=PARTITIONS).enqueue_many(session, events(2, 1))
    assert event_ids(engine) == ids


def test_enqueue_many_async_commits_and_refuses_duplicates(
    engine: Engine, database_url: str
) -> None:
    producer = Producer(partitions=PARTITIONS)

    async def main() -> None:
        aengine = db.make_async_engine(database_url)
        try:
            async with aengine.begin() as conn:
                await producer.enqueue_many_async(conn, events(2, 2))
                with pytest.raises(DuplicateEventError):
                    await producer.enqueue_many_async(conn, events(2, 1, first=2))
                await producer.enqueue_many_async(conn, events(2, 1, first=3))  # usable
        finally:
            await aengine.dispose()

    asyncio.run(main())
    assert event_ids(engine) == [
        "agg-0:thing.happened:1", "agg-1:thing.happened:1", "agg-0:thing.happened:2",
        "agg-1:thing.happened:2", "agg-0:thing.happened:3", "agg-1:thing.happened:3"]


# --- through the relay ------------------------------------------------------------------------


def test_the_relay_delivers_a_list_in_order(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    producer = Producer(partitions=PARTITIONS)
    with engine.begin() as conn:
        ids = producer.enqueue_many(conn, events(6, 5))
    stats = Relay(relay_settings(key_prefix), engine, redis_client).run(until_idle=True)
    assert stats.delivered == 30
    assert_each_once(redis_client, key_prefix, ids)
    assert_all_marked(engine, redis_client, key_prefix)
    for partition in range(PARTITIONS):
        streamed = [f["id"] for p, _e, f in stream_entries(redis_client, key_prefix)
                    if p == partition]
        assert streamed == [i for i in ids if partition_of(i.split(":")[0]) == partition]


@pytest.mark.parametrize("notify", [False, True])
def test_a_running_relay_delivers_what_a_producer_wrote(
    engine: Engine, redis_client: redis.Redis, key_prefix: str, notify: bool
) -> None:
    """On PostgreSQL the relay listens: rows without a notification are found by its polls."""
    producer = Producer(partitions=PARTITIONS, key_prefix=key_prefix, notify=notify)
    relay = Relay(relay_settings(key_prefix, poll_max_ms=200), engine, redis_client)
    thread = threading.Thread(target=relay.run, daemon=True)
    thread.start()
    ids: list[str] = []
    try:
        for first in range(1, 7):
            with engine.begin() as conn:
                ids.append(producer.enqueue(conn, type="thing.happened", stream=STREAM,
                                            aggregate_id="single", revision=first))
                ids += producer.enqueue_many(conn, events(3, 1, first=first))
            wait_until(lambda: undelivered(engine) == 0, what="the relay to deliver")
    finally:
        relay.stop()
        thread.join(timeout=30)
    assert not thread.is_alive()
    assert_each_once(redis_client, key_prefix, ids)
    assert_all_marked(engine, redis_client, key_prefix)


# --- notifications (PostgreSQL) ---------------------------------------------------------------


@pytest.mark.postgresql
def test_notifications_name_each_partition_once_and_none_without_notify(
    engine: Engine, key_prefix: str
) -> None:
    if engine.dialect.name != "postgresql":
        pytest.skip("SQLite has no notifications")
    channel = keys.notify_channel(key_prefix)
    quiet = Producer(partitions=PARTITIONS, key_prefix=key_prefix, notify=False)
    loud = Producer(partitions=PARTITIONS, key_prefix=key_prefix)
    batch = events(8, 2)
    with engine.connect() as listener:
        listener = listener.execution_options(isolation_level="AUTOCOMMIT")
        listener.exec_driver_sql(f'LISTEN "{channel}"')
        with engine.begin() as conn:
            quiet.enqueue_many(conn, batch)
            quiet.enqueue(conn, type="thing.happened", stream=STREAM)
        with engine.begin() as conn:
            loud.enqueue_many(conn, events(8, 2, first=3))
        with engine.begin() as conn:
            conn.execute(text("SELECT pg_notify(:c, 'end')"), {"c": channel})
        driver = listener.connection.driver_connection
        assert driver is not None
        payloads: list[str] = []
        while "end" not in payloads:
            got = [n.payload for n in driver.notifies(timeout=20.0, stop_after=1)]
            assert got, f"no notification within 20 s after {payloads}"
            payloads += got
    partitions = {partition_of(e["aggregate_id"]) for e in batch}
    assert sorted(payloads[:-1]) == sorted(str(p) for p in partitions)
