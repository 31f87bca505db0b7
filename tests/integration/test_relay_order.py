"""Order per aggregate in every stream: a row never reaches its stream after a later row of
the same aggregate, whatever happens — a late commit (PostgreSQL), a refused append, a delayed
row, a producer clock that is off, a fenced-out relay, a lost reply. Each test checks every
event is in its stream exactly once and each aggregate's events are in seq order there."""

from __future__ import annotations

import json
import threading
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
import redis
from sqlalchemy import Connection, Engine

from outbox_relay.producer import Producer
from outbox_relay.relay import append, store
from outbox_relay.relay.daemon import Relay
from outbox_relay.relay.leases import acquire_leases
from outbox_relay.shared import db, keys
from outbox_relay.shared.db import is_postgres
from outbox_relay.shared.errors import LeaseLostError, UnavailableError
from outbox_relay.shared.redis_conn import connect_redis
from tests.conftest import REDIS_URL
from tests.helpers import (
    PARTITIONS,
    STREAM,
    TTL,
    LostReply,
    assert_each_once,
    enqueue_events,
    expire_lease,
    outbox_rows,
    partition_of,
    private_redis,
    relay_settings,
    stream_entries,
    undelivered,
    wait_until,
)

pytestmark = pytest.mark.integration

PRODUCER = Producer(source="tests", partitions=PARTITIONS)


def assert_in_order_once(engine: Engine, client: redis.Redis, prefix: str,
                         streams: tuple[str, ...] = (STREAM,)) -> None:
    """Every outbox row is in its stream exactly once, and per (stream key, aggregate) the
    stream holds the events in seq order."""
    expected: dict[tuple[str, int, str], list[str]] = defaultdict(list)
    for row in outbox_rows(engine):  # seq order
        expected[(row.stream, row.partition, row.aggregate_id or row.event_id)].append(
            row.event_id)
    found: dict[tuple[str, int, str], list[str]] = defaultdict(list)
    for stream in streams:
        for p, _entry_id, fields in stream_entries(client, prefix, stream=stream):
            found[(stream, p, fields.get("aggregateid", fields["id"]))].append(fields["id"])
    assert found == expected


def add(conn: Connection, aggregate: str, revision: int, *, stream: str = STREAM,
        delay_ms: int = 0) -> str:
    kind = "thing.happened" if stream == STREAM else f"thing.{stream}"
    return PRODUCER.enqueue(conn, type=kind, stream=stream, data={"r": revision},
                            aggregate_type="thing", aggregate_id=aggregate, revision=revision,
                            delay_ms=delay_ms)


def aggregates_in(partition: int, n: int, prefix: str = "agg") -> list[str]:
    """``n`` aggregate ids the producer maps to ``partition``."""
    out: list[str] = []
    i = 0
    while len(out) < n:
        if partition_of(f"{prefix}-{i}") == partition:
            out.append(f"{prefix}-{i}")
        i += 1
    return out


# --- late commits (PostgreSQL: seq order is not commit order) -------------------------------


def test_a_late_commit_below_the_chain_holds_back_the_next_revision(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    """Revision 1's transaction takes a seq, stays open while a backlog commits and the relay
    claims past that seq, then commits; revision 2 commits after it. The chained claim (rows
    after the batch in flight) must hold revision 2 back until revision 1 has gone out."""
    if not is_postgres(engine):
        pytest.skip("SQLite has one writer: no transaction commits below rows committed after")
    partition = partition_of("late")
    others = aggregates_in(partition, 4)
    with engine.connect() as held:
        tx = held.begin()
        add(held, "late", 1)
        with engine.begin() as conn:
            for i in range(20):
                add(conn, others[i % 4], i // 4 + 1)
        epoch = acquire_leases(engine, "a", PARTITIONS, TTL)[partition]
        first = store.take_batch(engine, partition, "a", epoch, 5, TTL)
        assert len(first) == 5 and all(r.aggregate_id != "late" for r in first)
        tx.commit()
    with engine.begin() as conn:
        add(conn, "late", 2)
    after = max(r.seq for r in first)
    second = store.take_batch(engine, partition, "a", epoch, 100, TTL, after_seq=after,
                         inflight=[r.seq for r in first])
    assert [r.aggregate_id for r in second].count("late") == 0  # revision 2 waits
    assert len(second) == 15

    Relay(relay_settings(key_prefix, node_id="a"), engine, redis_client).run(until_idle=True)
    assert undelivered(engine) == 0
    assert_in_order_once(engine, redis_client, key_prefix)


def test_a_row_committed_late_inside_a_recorded_batch_never_overtakes_on_its_retry(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    """A relay takes a batch and dies before appending it (the lease row records the batch as
    seq ranges). A producer transaction open during the take held revisions 1 and 2 of an
    aggregate, with revision 2's seq inside the recorded range and revision 1's below it;
    it commits after the take. The retry finds revision 2 in the range: appended under the
    recorded id it would land before revision 1, which goes out later under a newer id (a
    PostgreSQL torture run found a chained stream's revision 132 ahead of 128 this way).
    Revision 2 must wait for revision 1: every event once, each aggregate in order."""
    if not is_postgres(engine):
        pytest.skip("SQLite has one writer: no transaction commits below rows committed after")
    partition = partition_of("late")
    [other] = aggregates_in(partition, 1, prefix="other")
    with engine.connect() as held:
        tx = held.begin()
        add(held, "late", 1)  # the lowest seq, outside the range the take records
        with engine.begin() as conn:
            add(conn, other, 1)  # the range starts here
        add(held, "late", 2)  # a seq inside the range, not committed at the take
        with engine.begin() as conn:
            add(conn, other, 2)  # the range ends here
        epoch = acquire_leases(engine, "a", PARTITIONS, TTL)[partition]
        taken = store.take_batch(engine, partition, "a", epoch, 100, TTL)
        assert [r.aggregate_id for r in taken] == [other, other]  # and the relay dies here
        tx.commit()

    Relay(relay_settings(key_prefix, node_id="a"), engine, redis_client).run(until_idle=True)
    assert undelivered(engine) == 0
    assert_in_order_once(engine, redis_client, key_prefix)


class CommitDuring:
    """A client that, just before appending the first batch of a partition reaching a seq,
    runs an action (commits a held producer transaction): so the commit happens while the
    relay chains through that partition, a few batches before its end."""

    def __init__(self, real: redis.Redis, prefix: str) -> None:
        self.real, self.prefix = real, prefix
        self.triggers: list[tuple[int, int, Callable[[], None]]] = []
        self.fired = 0

    def evalsha(self, *args: Any) -> Any:
        parsed = keys.parse_stream_key(self.prefix, args[2].decode() if isinstance(
            args[2], bytes) else args[2])
        top = max(int(entry[0].partition("-")[2]) for entry in json.loads(args[5]))
        for trigger in list(self.triggers):
            partition, seq, action = trigger
            if parsed is not None and parsed[1] == partition and top >= seq:
                self.triggers.remove(trigger)
                action()
                self.fired += 1
        return self.real.evalsha(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def test_late_commits_during_a_backlog_drain_never_reorder(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    """The relay drains a backlog of 3,000 rows in chained batches of 10. Five producer
    transactions each hold revision 1 of an aggregate under a seq below the backlog; each
    commits while the relay chains through its partition, a few batches before the end, and
    revision 2 commits right after: the chain reaches revision 2 with revision 1 below it."""
    if not is_postgres(engine):
        pytest.skip("SQLite has one writer: no transaction commits below rows committed after")
    late = [f"late-{k}" for k in range(5)]
    held = [engine.connect() for _ in late]
    txs = [conn.begin() for conn in held]
    for conn, aggregate in zip(held, late, strict=True):
        add(conn, aggregate, 1)
    enqueue_events(engine, 3000, aggregates=30)
    backlog: dict[int, list[int]] = defaultdict(list)
    for row in outbox_rows(engine):
        backlog[row.partition].append(row.seq)
    client = CommitDuring(connect_redis(REDIS_URL), key_prefix)
    per_partition: Counter[int] = Counter()
    for conn, tx, aggregate in zip(held, txs, late, strict=True):
        partition = partition_of(aggregate)
        per_partition[partition] += 1
        at = backlog[partition][-40 * per_partition[partition]]

        def commit(conn: Connection = conn, tx: Any = tx, aggregate: str = aggregate) -> None:
            tx.commit()
            conn.close()
            with engine.begin() as c:
                add(c, aggregate, 2)

        client.triggers.append((partition, at, commit))
    r = Relay(relay_settings(key_prefix, batch_size=10, lease_ttl_ms=30_000), engine,
              cast(redis.Redis, client))
    thread = threading.Thread(target=r.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: client.fired == 5 and undelivered(engine) == 0, timeout=60,
                   what="the backlog and the late revisions to be delivered")
    finally:
        r.stop()
        thread.join(timeout=30)
        for conn in held:
            conn.close()
    assert r.stats.delivered == 3010
    assert_in_order_once(engine, redis_client, key_prefix)


def test_a_chained_claim_holds_back_behind_many_rows_left_below_it(
    engine: Engine, key_prefix: str
) -> None:
    """100 rows of 100 aggregates are left behind below the chain (not in flight: say their
    append failed), more than one read returns: a chained claim reads past them, holds back
    the next revision of each and claims only rows of other aggregates, never one below."""
    partition = partition_of("b-0")
    left, fresh = aggregates_in(partition, 100, "b"), aggregates_in(partition, 10, "c")
    with engine.begin() as conn:
        for aggregate in left:
            add(conn, aggregate, 1)
    epoch = acquire_leases(engine, "a", PARTITIONS, TTL)[partition]
    below = store.take_batch(engine, partition, "a", epoch, 100, TTL)
    assert len(below) == 100
    with engine.begin() as conn:
        for aggregate, other in zip(left[:10], fresh, strict=True):
            add(conn, aggregate, 2)
            add(conn, other, 1)
    rows = store.take_batch(engine, partition, "a", epoch, 5, TTL,
                       after_seq=max(r.seq for r in below), inflight=[])
    assert [r.aggregate_id for r in rows] == fresh[:5]


# --- delayed rows and clocks --------------------------------------------------------------


def test_a_delayed_revision_holds_back_the_next_even_from_a_producer_clock_2s_fast(
    engine: Engine, redis_client: redis.Redis, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Revision 1 comes from a host whose clock is 2 s fast, delayed 1.5 s; revision 2 from a
    host with the right time, undelayed. ``available_at`` comes from the database clock, and
    the delayed revision 1 holds revision 2 back; another aggregate is not held."""
    real_now = db.now_ms
    monkeypatch.setattr("outbox_relay.producer.enqueue.now_ms", lambda: real_now() + 2000)
    before = real_now()
    with engine.begin() as conn:
        add(conn, "d", 1, delay_ms=1500)
    monkeypatch.undo()
    other = aggregates_in(partition_of("d"), 1, prefix="other")[0]
    with engine.begin() as conn:
        add(conn, "d", 2)
        add(conn, other, 1)
    first = next(r for r in outbox_rows(engine) if r.revision == 1 and r.aggregate_id == "d")
    assert first.created_at_ms >= before + 2000  # the CloudEvents time: the producer's clock
    assert before + 1500 <= first.available_at_ms <= real_now() + 1500  # the database's clock

    r = Relay(relay_settings(key_prefix), engine, redis_client)
    r.run_once()
    in_stream = [f["id"] for _p, _id, f in stream_entries(redis_client, key_prefix)]
    assert in_stream == [f"{other}:thing.happened:1"]  # d's revision 2 waits for revision 1
    assert undelivered(engine) == 2
    wait_until(lambda: r.run_once() is not None and undelivered(engine) == 0,
               what="the delayed revision to go out")
    assert_in_order_once(engine, redis_client, key_prefix)


# --- refused appends ------------------------------------------------------------------------


def test_a_refused_stream_stops_mid_batch_and_the_rest_of_the_batch_lands(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    """One partition's batch interleaves two streams; the key of stream ``other`` holds a
    string (WRONGTYPE). ``runs`` lands whole; ``other`` stops at its first row and the rest
    wait, then go out in order once the key is fixed."""
    with engine.begin() as conn:
        for revision in range(1, 5):
            add(conn, "agg-0", revision)
            add(conn, "agg-0", revision, stream="other")
    other_key = keys.stream_key(key_prefix, "other", partition_of("agg-0"))
    redis_client.set(other_key, "not a stream")

    stats = Relay(relay_settings(key_prefix), engine, redis_client).run(until_idle=True)
    assert (stats.delivered, stats.failed, stats.not_appended) == (4, 1, 3)
    rows = {(r.stream, r.revision): r for r in outbox_rows(engine)}
    assert rows[("other", 1)].last_error == "redis_wrongtype"
    assert undelivered(engine) == 4

    redis_client.delete(other_key)
    stats = Relay(relay_settings(key_prefix), engine, redis_client).run(until_idle=True)
    assert stats.delivered == 4 and stats.ordering_gaps == 0
    assert_in_order_once(engine, redis_client, key_prefix, streams=(STREAM, "other"))


class RefuseOnce:
    """A client whose ``n``-th append runs while the private Redis is out of memory (a real
    OOM refusal), every other append with memory to spare."""

    def __init__(self, real: redis.Redis, n: int) -> None:
        self.real, self.n, self.calls = real, n, 0

    def evalsha(self, *args: Any) -> Any:
        self.calls += 1
        if self.calls != self.n:
            return self.real.evalsha(*args)
        self.real.config_set("maxmemory", 1)
        try:
            return self.real.evalsha(*args)
        finally:
            self.real.config_set("maxmemory", 0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def test_a_refusal_in_the_chain_keeps_the_next_batch_out(
    engine: Engine, key_prefix: str, tmp_path: Path
) -> None:
    """Batches of 5 of one aggregate chain: the second is refused (OOM) while the third,
    already claimed and recorded, would be accepted. The third must not be appended: the
    round ends, and the next claims again from the refused row, in order."""
    ids = enqueue_events(engine, 40, aggregates=1)
    with private_redis(tmp_path / "redis") as url:
        real = connect_redis(url)
        real.script_load(append.SCRIPT)  # so that no call is a NOSCRIPT round trip
        client = cast(redis.Redis, RefuseOnce(real, 2))
        r = Relay(relay_settings(key_prefix, redis_url=url, batch_size=5), engine, client)
        r.run_once()
        assert r.stats.failed == 1 and r.stats.not_appended == 4
        in_stream = [f["id"] for _p, _id, f in stream_entries(real, key_prefix)]
        assert in_stream == ids[:5]
        wait_until(lambda: r.run_once() is not None and undelivered(engine) == 0,
                   what="every event to be delivered")
        assert r.stats.ordering_gaps == 0
        assert [f["id"] for _p, _id, f in stream_entries(real, key_prefix)] == ids
        assert_in_order_once(engine, real, key_prefix)
        real.close()


# --- fencing and unknown outcomes -------------------------------------------------------------


def test_a_fenced_out_relay_cannot_append_at_all(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    """The old owner's rows would land above the stream's top (no id check stops them): the
    fence key, raised by the new owner's append, refuses the whole call."""
    enqueue_events(engine, 4, aggregates=1)
    partition = partition_of("agg-0")
    old = acquire_leases(engine, "old", PARTITIONS, TTL)[partition]
    rows = store.take_batch(engine, partition, "old", old, 100, TTL)
    expire_lease(engine, partition)
    new = acquire_leases(engine, "new", PARTITIONS, TTL)[partition]
    assert new == old + 1
    verdicts = append.append(redis_client, key_prefix, rows[:1], new)
    assert len(verdicts.delivered) == 1
    key = keys.stream_key(key_prefix, STREAM, partition)
    with pytest.raises(LeaseLostError):
        append.append(redis_client, key_prefix, rows[1:], old)
    assert redis_client.xlen(key) == 1
    assert redis_client.get(keys.fence_key(key_prefix, STREAM, partition)) == str(new).encode()


def test_a_lost_reply_with_held_rows_is_retried_exactly_once_in_order(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    """Revision 1 of aggregate ``d`` is delayed: its later revisions are held back out of the
    batch, which then splits into runs on the lease row. The batch's reply is lost; its retry
    takes exactly the claimed rows (never the held ones), and everything ends once, in order."""
    partition = partition_of("d")
    others = aggregates_in(partition, 2)
    with engine.begin() as conn:
        add(conn, "d", 1, delay_ms=1000)
        for revision in range(1, 6):
            add(conn, others[0], revision)
            add(conn, "d", revision + 1)
            add(conn, others[1], revision)
    client = cast(redis.Redis, LostReply(redis_client, n=1))
    r = Relay(relay_settings(key_prefix, batch_size=4), engine, client)
    with pytest.raises(UnavailableError):
        r.run_once()
    assert r.stats.unknown_outcomes == 4
    wait_until(lambda: r.run_once() is not None and undelivered(engine) == 0,
               what="every event to be delivered")
    assert r.stats.already_present >= 1
    assert_in_order_once(engine, redis_client, key_prefix)
    assert_each_once(redis_client, key_prefix, [row.event_id for row in outbox_rows(engine)])


# --- broker data loss -----------------------------------------------------------------------


def test_a_stream_that_lost_data_takes_no_new_entry_before_it_is_refilled(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    """Redis loses a stream (a restart without persistence) after revisions 1-3 were
    delivered, and a consumer's ``XGROUP CREATE … MKSTREAM`` recreates it empty. Revision 4
    must not be appended into the empty stream before the refill of 1-3 (a group reading from
    0 would apply 4 before 3): the append script refuses it (``BEHIND``), the relay repairs
    the stream first, and the stream ends 1, 2, 3, 4, each once."""
    with engine.begin() as conn:
        for rev in (1, 2, 3):
            add(conn, "lossy", rev)
    r = Relay(relay_settings(key_prefix, batch_size=2), engine, redis_client)
    wait_until(lambda: r.run_once() is not None and undelivered(engine) == 0,
               what="revisions 1-3 to go out")
    key = keys.stream_key(key_prefix, STREAM, partition_of("lossy"))
    assert r.repairer.floors.get(key)  # the newest delivered id is known to the relay
    redis_client.delete(key, keys.fence_key(key_prefix, STREAM, partition_of("lossy")))
    redis_client.xgroup_create(key, "g", id="0", mkstream=True)
    with engine.begin() as conn:
        add(conn, "lossy", 4)
    r.repairer._next_check = float("inf")  # no scheduled check: only the refusal may trigger it
    with pytest.raises(UnavailableError) as refused:
        r.run_once()
    assert refused.value.code == "stream_behind"
    assert redis_client.xlen(key) == 0  # nothing was appended above the hole
    rev4 = next(r for r in outbox_rows(engine) if r.revision == 4)
    assert rev4.last_error == "stream_behind"  # what `outbox status` shows meanwhile
    wait_until(lambda: r.run_once() is not None and undelivered(engine) == 0,
               what="the refill, then revision 4")
    assert [f["revision"] for _p, _id, f in stream_entries(redis_client, key_prefix)] == [
        "1", "2", "3", "4"]
    assert_in_order_once(engine, redis_client, key_prefix)
    group = redis_client.xreadgroup("g", "c", {key: ">"})
    assert [fields[b"revision"] for _id, fields in group[0][1]] == [b"1", b"2", b"3", b"4"]


def test_thousands_of_scheduled_rows_at_the_head_do_not_stall_what_is_ready_behind_them(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    """8,000 rows delayed by an hour sit at the head of a partition (reminders, timeouts), each
    a blocker of its own aggregate; rows of other aggregates committed after them are ready
    now. The claim reads past the scheduled rows (its reads grow) and relays the ready ones;
    the scheduled rows stay pending."""
    part = partition_of("now-0")
    later = aggregates_in(part, 8000, prefix="later")
    ready = aggregates_in(part, 3, prefix="now")
    with engine.begin() as conn:
        for agg in later:
            add(conn, agg, 1, delay_ms=3_600_000)
        for agg in ready:
            add(conn, agg, 1)
    r = Relay(relay_settings(key_prefix), engine, redis_client)
    r.run_once()
    in_stream = [f["aggregateid"] for _p, _id, f in stream_entries(redis_client, key_prefix)]
    assert in_stream == ready
    assert undelivered(engine) == 8000
