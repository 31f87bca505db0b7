"""The relay against the real Redis and both databases: exactly one stream entry per committed
event, whatever crashes, timeouts, takeovers and gaps happen in between."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any, cast

import pytest
import redis
from sqlalchemy import Engine, event, update

from outbox_relay.producer import Producer
from outbox_relay.relay import append, outgoing, store
from outbox_relay.relay.daemon import Relay
from outbox_relay.relay.leases import acquire_leases, release_leases
from outbox_relay.shared import keys
from outbox_relay.shared.db import now_ms
from outbox_relay.shared.envelope import Event
from outbox_relay.shared.errors import LeaseLostError, UnavailableError
from outbox_relay.shared.redis_conn import connect_redis
from outbox_relay.shared.schema import outbox, relay_leases
from tests.conftest import REDIS_URL
from tests.helpers import (
    PARTITIONS,
    STREAM,
    TTL,
    LostReply,
    assert_all_marked,
    assert_each_once,
    enqueue_events,
    expire_lease,
    lease_owners,
    let_die,
    outbox_rows,
    partition_of,
    private_redis,
    relay_settings,
    stream_entries,
    undelivered,
    wait_until,
)

pytestmark = pytest.mark.integration

def test_every_committed_event_appears_once_with_its_entry_id(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    ids = enqueue_events(engine, 40)
    with engine.connect() as conn:  # a rolled-back event is never relayed
        tx = conn.begin()
        Producer(partitions=PARTITIONS).enqueue(conn, type="never", stream=STREAM)
        tx.rollback()
    stats = Relay(relay_settings(key_prefix), engine, redis_client).run(until_idle=True)

    assert stats.delivered == 40 and stats.already_present == 0
    assert_each_once(redis_client, key_prefix, ids)
    assert_all_marked(engine, redis_client, key_prefix)
    rows = {r.event_id: r for r in outbox_rows(engine)}
    for partition, _entry_id, fields in stream_entries(redis_client, key_prefix):
        event = Event.from_fields(fields)
        row = rows[event.id]
        assert fields["specversion"] == "1.0"
        assert (event.type, event.source, event.subject) == ("thing.happened", "tests",
                                                             row.aggregate_id)
        assert (event.aggregatetype, event.aggregateid, event.revision) == (
            "thing", row.aggregate_id, row.revision)
        assert event.data == {"i": ids.index(event.id)}
        assert partition == row.partition == partition_of(row.aggregate_id)
    assert set(lease_owners(engine).values()) == {None}  # released on exit


def test_delayed_events_wait_for_their_time(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    with engine.begin() as conn:
        Producer(partitions=PARTITIONS).enqueue(conn, type="later", stream=STREAM,
                                                 delay_ms=3_600_000)
    ids = enqueue_events(engine, 3)
    Relay(relay_settings(key_prefix), engine, redis_client).run(until_idle=True)
    assert_each_once(redis_client, key_prefix, ids)
    assert undelivered(engine) == 1


def test_events_of_one_aggregate_keep_revision_order_in_one_partition(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    enqueue_events(engine, 36, aggregates=3)
    stats = Relay(relay_settings(key_prefix, batch_size=5), engine, redis_client).run(
        until_idle=True
    )
    assert stats.delivered == 36
    for n in range(3):
        aggregate = f"agg-{n}"
        mine = [(p, f) for p, _id, f in stream_entries(redis_client, key_prefix)
                if f["aggregateid"] == aggregate]
        assert {p for p, _f in mine} == {partition_of(aggregate)}
        assert [int(f["revision"]) for _p, f in mine] == list(range(1, 13))


def test_a_chained_settle_takes_the_next_rows_of_an_aggregate_whose_earlier_ones_it_marks(
    engine: Engine,
) -> None:
    """Settling batch 1 while batch 2 is in flight takes batch 3 in the same transaction: an
    aggregate's rows in batch 3 are taken, not held back behind batch 1's, which the same
    transaction marks."""
    enqueue_events(engine, 30, aggregates=1)  # one aggregate, one partition, seq order
    partition = outbox_rows(engine)[0].partition
    epoch = acquire_leases(engine, "a", PARTITIONS, 10_000)[partition]
    first = store.take_batch(engine, partition, "a", epoch, 10, 10_000)
    second = store.take_batch(engine, partition, "a", epoch, 10, 10_000,
                              after_seq=first[-1].seq, inflight=[r.seq for r in first])
    assert len(first) == len(second) == 10

    third = store.settle(engine, partition, "a", epoch, 10_000,
                         delivered=[(r.seq, r.entry_id) for r in first], gaps=[], failed=[],
                         take_after=second[-1].seq, batch_size=10,
                         inflight=[r.seq for r in second])

    rows = outbox_rows(engine)
    assert [r.seq for r in third] == [r.seq for r in rows[20:]]
    assert all(r.delivered_at_ms is not None for r in rows[:10])
    assert all(r.delivered_at_ms is None for r in rows[10:])


def test_a_chained_settle_fenced_out_marks_and_takes_nothing(engine: Engine) -> None:
    enqueue_events(engine, 30, aggregates=1)
    partition = outbox_rows(engine)[0].partition
    epoch = acquire_leases(engine, "a", PARTITIONS, 10_000)[partition]
    first = store.take_batch(engine, partition, "a", epoch, 10, 10_000)
    second = store.take_batch(engine, partition, "a", epoch, 10, 10_000,
                              after_seq=first[-1].seq, inflight=[r.seq for r in first])
    expire_lease(engine, partition)
    assert partition in acquire_leases(engine, "b", PARTITIONS, 10_000)
    before = outbox_rows(engine)

    with pytest.raises(LeaseLostError):
        store.settle(engine, partition, "a", epoch, 10_000,
                     delivered=[(r.seq, r.entry_id) for r in first], gaps=[], failed=[],
                     take_after=second[-1].seq, batch_size=10,
                     inflight=[r.seq for r in second])

    assert outbox_rows(engine) == before


def test_two_relays_split_partitions_and_never_publish_twice(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    # Leases are re-balanced every TTL/3; a TTL far above one round keeps the split stable.
    a = Relay(relay_settings(key_prefix, node_id="a", lease_ttl_ms=3000), engine, redis_client)
    b = Relay(relay_settings(key_prefix, node_id="b", lease_ttl_ms=3000), engine, redis_client)

    def split() -> bool:
        a.run_once()
        b.run_once()
        return set(a.leases).isdisjoint(b.leases) and len(a.leases) == len(b.leases) == 2

    wait_until(split, what="the two relays to share the partitions")
    assert set(a.leases) | set(b.leases) == set(range(PARTITIONS))
    ids = enqueue_events(engine, 80)
    wait_until(lambda: (a.run_once(), b.run_once()) and undelivered(engine) == 0,
               what="every event to be delivered")

    assert a.stats.lease_losses == b.stats.lease_losses == 0
    per_partition = Counter(partition_of(f"agg-{i % 8}") for i in range(80))
    assert a.stats.delivered == sum(per_partition[p] for p in a.leases)
    assert b.stats.delivered == sum(per_partition[p] for p in b.leases)
    assert a.stats.delivered + b.stats.delivered == 80
    assert_each_once(redis_client, key_prefix, ids)
    assert_all_marked(engine, redis_client, key_prefix)


def test_concurrent_relays_with_a_concurrent_producer(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    relays = [
        Relay(relay_settings(key_prefix, node_id=name, lease_ttl_ms=1000, batch_size=7),
              engine, connect_redis(REDIS_URL))
        for name in ("a", "b")
    ]
    threads = [threading.Thread(target=r.run, daemon=True) for r in relays]
    for t in threads:
        t.start()
    ids: list[str] = []
    try:
        for start in range(0, 120, 10):
            ids += enqueue_events(engine, 10, first=start)
        wait_until(lambda: undelivered(engine) == 0, what="every event to be delivered")
    finally:
        for r in relays:
            r.stop()
        for t in threads:
            t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert sum(r.stats.delivered for r in relays) == 120
    assert_each_once(redis_client, key_prefix, ids)
    assert_all_marked(engine, redis_client, key_prefix)


@pytest.mark.parametrize("appended", ["all", "half"])
def test_relay_killed_between_xadd_and_mark(
    engine: Engine, redis_client: redis.Redis, key_prefix: str, appended: str
) -> None:
    ids = enqueue_events(engine, 24)
    leases = acquire_leases(engine, "doomed", PARTITIONS, TTL)
    landed = 0
    for partition, epoch in leases.items():
        rows = store.take_batch(engine, partition, "doomed", epoch, 100, TTL)
        if appended == "half":
            rows = rows[: len(rows) // 2]
        verdicts = append.append(redis_client, key_prefix, rows, epoch)
        landed += len(verdicts.delivered)
    # ... and the process dies here: no settle; its heartbeat and leases run out.
    let_die(engine, "doomed")
    assert undelivered(engine) == 24

    stats = Relay(relay_settings(key_prefix, node_id="fresh"), engine, redis_client).run(
        until_idle=True
    )
    assert stats.already_present == landed == (24 if appended == "all" else 12)
    assert stats.delivered == 24
    assert_each_once(redis_client, key_prefix, ids)
    assert_all_marked(engine, redis_client, key_prefix)


def test_timeout_with_unknown_outcome_causes_no_duplicate(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    ids = enqueue_events(engine, 10, aggregates=1)
    client = cast(redis.Redis, LostReply(redis_client))
    stats = Relay(relay_settings(key_prefix), engine, client).run(until_idle=True)
    assert stats.unknown_outcomes == 10
    assert stats.already_present == 10 and stats.delivered == 10
    assert_each_once(redis_client, key_prefix, ids)
    assert_all_marked(engine, redis_client, key_prefix)
    assert {r.attempts for r in outbox_rows(engine)} == {2}


@pytest.mark.parametrize("lost", [1, 2, 3])
def test_lost_reply_in_the_pipelined_chain_causes_no_duplicate(
    engine: Engine, redis_client: redis.Redis, key_prefix: str, lost: int
) -> None:
    """Batches of 5 chain (claim of the next overlapping the current append, settle of one
    claiming the one after); the ``lost``-th append's reply is lost while others are claimed
    and recorded: every recorded batch is retried under its ids, in order, exactly once."""
    ids = enqueue_events(engine, 40, aggregates=1)
    client = cast(redis.Redis, LostReply(redis_client, n=0))
    relay = Relay(relay_settings(key_prefix, batch_size=5), engine, client)
    real_evalsha = client.evalsha
    calls = 0

    def evalsha(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        cast(LostReply, client).remaining = 1 if calls == lost else 0
        return real_evalsha(*args)

    client.evalsha = evalsha  # type: ignore[method-assign,assignment]
    with pytest.raises(UnavailableError):
        relay.run_once()
    assert undelivered(engine) > 0
    stats = relay.run(until_idle=True)
    assert stats.unknown_outcomes == 5 and stats.already_present >= 5
    assert_each_once(redis_client, key_prefix, ids)
    assert_all_marked(engine, redis_client, key_prefix)
    order = [f["id"] for _p, _id, f in stream_entries(redis_client, key_prefix)]
    assert order == ids  # one aggregate, one partition: the stream keeps the commit order


def test_stalled_redis_timeout_causes_no_duplicate(
    engine: Engine, key_prefix: str, tmp_path: Path
) -> None:
    with private_redis(tmp_path / "redis") as url:
        client = connect_redis(url, timeout_s=0.2)
        relay = Relay(relay_settings(key_prefix, redis_url=url), engine, client)
        relay.run_once()  # takes the leases while there is nothing to deliver
        client.script_load(append.SCRIPT)  # as after any earlier append; the connection is
        # open before Redis stalls
        ids = enqueue_events(engine, 10, aggregates=1)
        stall = redis.Redis.from_url(url).connection_pool.get_connection()
        stall.send_command("DEBUG", "SLEEP", "1")  # no reply awaited: Redis stops answering
        probe = redis.Redis.from_url(url, socket_timeout=0.05)

        def stalled() -> bool:
            try:
                probe.ping()
                return False
            except redis.TimeoutError:
                return True

        wait_until(stalled, what="Redis to stall")
        with pytest.raises(UnavailableError):
            relay.run_once()  # XADDs sent, no reply within the socket timeout
        assert {r.last_error for r in outbox_rows(engine)} == {"unknown_outcome"}
        checker = redis.Redis.from_url(url, socket_timeout=5)
        key = keys.stream_key(key_prefix, STREAM, partition_of("agg-0"))
        wait_until(lambda: checker.xlen(key) == 10, what="the timed-out XADDs to land")

        stats = relay.run(until_idle=True)
        assert stats.already_present == 10
        assert_each_once(checker, key_prefix, ids)
        assert_all_marked(engine, checker, key_prefix)
        for c in (client, probe, checker):
            c.close()
        stall.disconnect()


@pytest.mark.parametrize("late_xadd", ["before_takeover_append", "after_takeover_mark"])
def test_fenced_out_relay_cannot_mark_and_its_late_xadd_does_not_duplicate(
    engine: Engine, redis_client: redis.Redis, key_prefix: str, late_xadd: str
) -> None:
    ids = enqueue_events(engine, 12, aggregates=1)
    partition = partition_of("agg-0")
    old = acquire_leases(engine, "old", PARTITIONS, TTL)
    stale_rows = store.take_batch(engine, partition, "old", old[partition], 100, TTL)
    assert len(stale_rows) == 12
    expire_lease(engine, partition)  # "old" stalls past its lease
    new = acquire_leases(engine, "new", PARTITIONS, TTL)
    assert new[partition] == old[partition] + 1
    fresh_rows = store.take_batch(engine, partition, "new", new[partition], 100, TTL)
    assert [r.entry_id for r in fresh_rows] == [r.entry_id for r in stale_rows]

    if late_xadd == "before_takeover_append":
        append.append(redis_client, key_prefix, stale_rows, old[partition])
    verdicts = append.append(redis_client, key_prefix, fresh_rows, new[partition])
    assert verdicts.already == (12 if late_xadd == "before_takeover_append" else 0)
    store.settle(engine, partition, "new", new[partition], TTL,
                 delivered=verdicts.delivered, gaps=verdicts.gaps, failed=verdicts.failed)
    if late_xadd == "after_takeover_mark":  # the fence in Redis refuses it outright
        with pytest.raises(LeaseLostError):
            append.append(redis_client, key_prefix, stale_rows, old[partition])
    with pytest.raises(LeaseLostError) as info:
        store.settle(engine, partition, "old", old[partition], TTL,
                     delivered=[(r.seq, r.entry_id) for r in stale_rows], gaps=[], failed=[])
    assert info.value.code == "lease_lost"
    with pytest.raises(LeaseLostError):
        store.take_batch(engine, partition, "old", old[partition], 100, TTL)
    stale_relay = Relay(relay_settings(key_prefix, node_id="old"), engine, redis_client)
    with pytest.raises(LeaseLostError):
        stale_relay.relay_partition(partition, old[partition])

    assert_each_once(redis_client, key_prefix, ids)
    assert_all_marked(engine, redis_client, key_prefix)


@pytest.mark.parametrize("taker", ["new", "old"])
def test_a_settle_fenced_out_changes_no_row_of_its_batch_and_the_others_commit(
    engine: Engine, redis_client: redis.Redis, key_prefix: str, taker: str
) -> None:
    """A round settles two partitions' batches in one transaction; one was taken over
    meanwhile (by another relay, or won back by this same node under a new epoch after it
    stalled past its lease): its settle under the old epoch is refused and leaves every row of
    its batch as it was (no id, attempt, time or error written) while the other partition's
    rows are marked, in the same commit. On PostgreSQL the fence and the mark are one
    statement (relay/store.py ``_fenced_mark``): this is what gates its mark on its fence."""
    enqueue_events(engine, 24, aggregates=8)
    old = acquire_leases(engine, "old", PARTITIONS, TTL)
    stolen, kept = 1, 2
    batches = {p: store.take_batch(engine, p, "old", old[p], 100, TTL) for p in (stolen, kept)}
    verdicts = {p: append.append(redis_client, key_prefix, rows, old[p])
                for p, rows in batches.items()}
    assert all(v.delivered for v in verdicts.values())
    expire_lease(engine, stolen)
    won = acquire_leases(engine, taker, PARTITIONS, TTL)
    assert won[stolen] == old[stolen] + 1
    assert taker == "old" or list(won) == [stolen]
    before = [r for r in outbox_rows(engine) if r.partition == stolen]

    lost, taken = store.settle_batches(engine, "old", TTL, [
        store.Settlement(p, old[p], verdicts[p].delivered, [], []) for p in (stolen, kept)],
        take=frozenset({stolen, kept}), batch_size=100)

    assert lost == [stolen] and taken == {}  # nothing left to take in either
    assert [r for r in outbox_rows(engine) if r.partition == stolen] == before
    assert before and all(r.delivered_at_ms is None and r.attempts == 0 for r in before)
    marked = [r for r in outbox_rows(engine) if r.partition == kept]
    assert marked and all(r.delivered_at_ms is not None for r in marked)


def claim_three(engine: Engine) -> tuple[list[str], int, int, list[outgoing.OutboxRow]]:
    """Enqueue three events of one aggregate and claim them as relay "a": (ids, partition,
    epoch, rows)."""
    ids = enqueue_events(engine, 3, aggregates=1)
    partition = partition_of("agg-0")
    leases = acquire_leases(engine, "a", PARTITIONS, TTL)
    rows = store.take_batch(engine, partition, "a", leases[partition], 100, TTL)
    return ids, partition, leases[partition], rows


def test_ordering_gap_is_republished_at_the_top_once(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    ids, _partition, epoch, (first, middle, last) = claim_three(engine)
    # A relay of an earlier version (pipelined XADDs that did not stop at a refusal) had the
    # middle XADD refused while its neighbours landed, and died before it settled: the retry
    # of the recorded batch finds the top past the middle's id. (Today's append stops at the
    # first refusal of a stream, so it never leaves such a hole itself.)
    append.append(redis_client, key_prefix, [first], epoch)
    append.append(redis_client, key_prefix, [last], epoch)
    let_die(engine, "a")

    stats = Relay(relay_settings(key_prefix, node_id="b"), engine, redis_client).run(
        until_idle=True
    )
    assert stats.ordering_gaps == 1 and stats.already_present == 2 and stats.delivered == 3
    assert_each_once(redis_client, key_prefix, ids)
    assert_all_marked(engine, redis_client, key_prefix)
    order = [f["id"] for _p, _id, f in stream_entries(redis_client, key_prefix)]
    assert order == [first.event_id, last.event_id, middle.event_id]
    republished = next(r for r in outbox_rows(engine) if r.seq == middle.seq)
    assert republished.entry_id != middle.entry_id and republished.last_error is None
    assert append.entry_ids.greater(republished.entry_id, last.entry_id)


def test_rows_claimed_by_an_earlier_version_are_retried_under_their_own_ids(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    """Before the 0002 migration the relay wrote each claimed row's id on the row; a row left
    so (appended, never marked) must be retried under that id, ahead of newer rows."""
    ids = enqueue_events(engine, 4, aggregates=1)
    partition = partition_of("agg-0")
    rows = sorted(outbox_rows(engine), key=lambda r: r.seq)
    old_ms = now_ms() - 60_000
    with engine.begin() as conn:
        for k, row in enumerate(rows[:2]):  # claimed by the old relay, under "<ms>-<k>"
            conn.execute(update(outbox).where(outbox.c.seq == row.seq)
                         .values(entry_id=f"{old_ms}-{k}"))
    key = keys.stream_key(key_prefix, STREAM, partition)
    redis_client.xadd(key, {"id": ids[1]}, id=f"{old_ms}-1")  # the old relay's XADD landed

    stats = Relay(relay_settings(key_prefix), engine, redis_client).run(until_idle=True)
    assert stats.already_present == 1 and stats.delivered == 4 and stats.ordering_gaps == 1
    assert_each_once(redis_client, key_prefix, ids)
    assert_all_marked(engine, redis_client, key_prefix)
    marked = {r.seq: r.entry_id for r in outbox_rows(engine)}
    assert marked[rows[1].seq] == f"{old_ms}-1"


def test_refused_append_stops_its_stream_and_later_rows_wait_in_order(
    engine: Engine, key_prefix: str, tmp_path: Path
) -> None:
    """Redis refuses revision 2 (out of memory): revision 3, claimed in the same batch, must
    not overtake it; both go out behind it, in order, once Redis accepts writes again."""
    with private_redis(tmp_path / "redis") as url:
        client = connect_redis(url)

        def relay() -> Relay:
            return Relay(relay_settings(key_prefix, redis_url=url), engine, client)

        ids = enqueue_events(engine, 1, aggregates=1)
        relay().run(until_idle=True)
        ids += enqueue_events(engine, 2, aggregates=1, first=1)
        client.config_set("maxmemory", 1)  # noeviction: every write is refused with OOM
        stats = relay().run(until_idle=True)
        assert (stats.failed, stats.not_appended, stats.delivered) == (1, 1, 0)
        assert [f["id"] for _p, _i, f in stream_entries(client, key_prefix)] == ids[:1]
        rows = outbox_rows(engine)
        assert [r.last_error for r in rows] == [None, "redis_oom", None]
        assert undelivered(engine) == 2

        client.config_set("maxmemory", 0)
        stats = relay().run(until_idle=True)
        assert stats.ordering_gaps == 0 and stats.delivered == 2  # fresh ids: no gap round trip
        assert_each_once(client, key_prefix, ids)
        assert_all_marked(engine, client, key_prefix)
        order = [f["id"] for _p, _id, f in stream_entries(client, key_prefix)]
        assert order == ids  # [rev1, rev2, rev3]
        client.close()


def test_gap_behind_a_foreign_top_far_ahead_is_republished_once_above_it(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    ids = enqueue_events(engine, 2, aggregates=1)
    partition = partition_of("agg-0")
    key = keys.stream_key(key_prefix, STREAM, partition)
    # Someone (a clock far ahead, another writer) left the stream's last id in the future;
    # deleting that entry does not lower the id Redis compares explicit ids against.
    future = f"{now_ms() + 3_600_000}-0"
    redis_client.xadd(key, {"foreign": "1"}, id=future)
    redis_client.xdel(key, future)

    stats = Relay(relay_settings(key_prefix, node_id="a"), engine, redis_client).run(
        until_idle=True
    )
    # the first gap stops the stream's batch: both go out above the top, in order, no hot loop
    assert (stats.ordering_gaps, stats.not_appended, stats.delivered) == (1, 1, 2)
    assert [f["id"] for _p, _id, f in stream_entries(redis_client, key_prefix)] == ids
    assert_each_once(redis_client, key_prefix, ids)
    assert_all_marked(engine, redis_client, key_prefix)
    for row in outbox_rows(engine):
        assert append.entry_ids.greater(row.entry_id, future)


def test_sigterm_stops_the_relay_command_cleanly(
    engine: Engine, database_url: str, redis_client: redis.Redis, key_prefix: str
) -> None:
    ids = enqueue_events(engine, 5)
    env = {**os.environ, "OUTBOX_DATABASE_URL": database_url, "OUTBOX_REDIS_URL": REDIS_URL,
           "OUTBOX_KEY_PREFIX": key_prefix, "OUTBOX_PARTITIONS": str(PARTITIONS),
           "OUTBOX_POLL_MAX_MS": "50", "OUTBOX_NODE_ID": "sigterm-test"}
    proc = subprocess.Popen([sys.executable, "-m", "outbox_relay", "relay"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: undelivered(engine) == 0 or proc.poll() is not None,
                   what="the relay to deliver")
        assert proc.poll() is None, proc.communicate()
        assert set(lease_owners(engine).values()) == {"sigterm-test"}
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert b"Traceback" not in err
    assert set(lease_owners(engine).values()) == {None}
    assert_each_once(redis_client, key_prefix, ids)


def test_relays_started_together_split_the_partitions_under_until_idle(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    """Relay A took every partition before B registered. An ``--until-idle`` B must not call
    the outbox idle while A holds partitions with rows to send: it waits, takes its share when
    A's next lease round gives it up, takes the rest when A stops, and exits once all is sent."""
    ids = enqueue_events(engine, 40)  # 8 aggregates over the 4 partitions
    a = acquire_leases(engine, "relay-a", PARTITIONS, 60_000)
    assert sorted(a) == list(range(PARTITIONS))  # alone: all four
    b = Relay(relay_settings(key_prefix, node_id="relay-b"), engine, redis_client)
    done: list[object] = []
    thread = threading.Thread(target=lambda: done.append(b.run(until_idle=True)), daemon=True)
    thread.start()
    try:
        wait_until(lambda: b.stats.rounds >= 3 or not thread.is_alive(),
                   what="relay B's rounds while A holds all")
        assert thread.is_alive(), "relay B called the outbox idle while A holds its rows"
        assert not b.leases and undelivered(engine) == 40
        a = acquire_leases(engine, "relay-a", PARTITIONS, 60_000)
        assert len(a) == PARTITIONS // 2  # two live relays: A keeps its fair share
        mine = set(range(PARTITIONS)) - set(a)
        wait_until(lambda: set(b.leases) == mine, what="relay B taking the freed partitions")
        wait_until(lambda: all(r.delivered_at_ms is not None for r in outbox_rows(engine)
                               if r.partition in mine), what="B's partitions sent")
        assert thread.is_alive() and undelivered(engine) > 0  # A's rows: still waiting
        release_leases(engine, "relay-a", a)  # A stops
        thread.join(timeout=30)
        assert not thread.is_alive() and done
    finally:
        b.stop()
        thread.join(timeout=10)
    assert undelivered(engine) == 0
    assert_each_once(redis_client, key_prefix, ids)


def test_release_locks_lease_rows_in_partition_order_as_acquire_does(engine: Engine) -> None:
    """Leases won as {kept..., taken...} (say 2, 3, then 0) are released in partition order:
    a release walking them as won could wait on row 0 held by an acquiring relay that waits on
    row 2 (``acquire_leases`` locks in partition order), a deadlock."""
    held = acquire_leases(engine, "relay-a", PARTITIONS, 60_000)
    won = {p: held[p] for p in (2, 3, 0, 1)}  # the order _rebalance can produce
    released: list[int] = []

    def on_execute(_conn: Any, clause: Any, *_args: Any) -> None:
        if getattr(clause, "table", None) is relay_leases and clause.is_update:
            released.extend(v for k, v in clause.compile().params.items()
                            if k.startswith("partition"))

    event.listen(engine, "before_execute", on_execute)
    try:
        release_leases(engine, "relay-a", won)
    finally:
        event.remove(engine, "before_execute", on_execute)
    assert released == [0, 1, 2, 3]
    assert set(lease_owners(engine).values()) == {None}
