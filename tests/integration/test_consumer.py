"""The consumer against the real Redis and both databases: each event applied at most once per
group, bad entries dead-lettered with a reason, nothing lost between claim and ACK; and the
whole pipeline end to end."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import redis
from sqlalchemy import Engine

from outbox_relay.consumer import streams
from outbox_relay.consumer.daemon import Consumer
from outbox_relay.relay.daemon import Relay
from outbox_relay.shared import keys
from outbox_relay.shared.errors import UnavailableError
from tests.helpers import (
    GROUP,
    PARTITIONS,
    STREAM,
    Recorder,
    dead_letters,
    effect_counts,
    enqueue_events,
    event,
    key_of,
    make_consumer,
    outbox_rows,
    pending_total,
    receipt_rows,
    relay_settings,
    stream_entries,
    wait_until,
    xadd_event,
)

pytestmark = pytest.mark.integration


def run_until(consumer: Consumer, condition: Callable[[], object], what: str) -> None:
    """Run consumer rounds until ``condition`` holds (with a deadline)."""
    wait_until(lambda: consumer.run_once() >= 0 and condition(), what=what)


def test_duplicate_delivery_has_exactly_one_effect(
    effects_engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    recorder = Recorder()
    consumer = make_consumer(effects_engine, redis_client, key_prefix, recorder)
    ev = event("agg-1", 1)
    xadd_event(redis_client, key_prefix, ev)
    xadd_event(redis_client, key_prefix, ev)  # the same event under a second entry id
    assert consumer.run_once() == 2
    xadd_event(redis_client, key_prefix, ev)  # and once more, in a later batch
    assert consumer.run_once() == 1

    assert effect_counts(effects_engine) == {ev.id: 1}
    assert recorder.calls == {ev.id: 1}
    assert (consumer.stats.applied, consumer.stats.duplicates) == (1, 2)
    receipt = receipt_rows(effects_engine)[ev.id]
    assert (receipt.outcome, receipt.duplicates) == ("applied", 2)
    assert pending_total(redis_client, key_prefix) == 0


def test_an_older_revision_is_dead_lettered_out_of_order_never_skipped(
    effects_engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    # Was test_stale_revision_is_skipped (receipt ``stale``, no letter): a silent loss.
    recorder = Recorder()
    consumer = make_consumer(effects_engine, redis_client, key_prefix, recorder)
    newer, older, newest = event("agg-1", 2), event("agg-1", 1), event("agg-1", 3)
    xadd_event(redis_client, key_prefix, newer)
    consumer.run_once()
    older_entry = xadd_event(redis_client, key_prefix, older)
    consumer.run_once()
    xadd_event(redis_client, key_prefix, newest)
    consumer.run_once()

    assert recorder.calls == {newer.id: 1, newest.id: 1}
    got = receipt_rows(effects_engine)
    assert {i: (r.outcome, r.reason) for i, r in got.items()} == {
        newer.id: ("applied", None), older.id: ("dead", "out_of_order"),
        newest.id: ("applied", None)}
    (letter,) = dead_letters(redis_client, key_prefix, keys.partition_for("agg-1", PARTITIONS))
    assert letter[b"dlq.reason"] == b"out_of_order"
    assert (letter[b"dlq.revision"], letter[b"dlq.head"]) == (b"1", b"2")
    assert letter[b"dlq.entry_id"] == older_entry.encode()
    assert (consumer.stats.out_of_order, consumer.stats.dead) == (1, 1)
    assert pending_total(redis_client, key_prefix) == 0


def valid_raw() -> dict[bytes, bytes]:
    return {k.encode(): v.encode() for k, v in event("agg-2", 1).to_fields().items()}


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ({b"specversion": b"1.0", b"id": b"only-an-id"}, "missing_field"),
        ({**valid_raw(), b"data": b"{not json"}, "bad_json"),
        ({**valid_raw(), b"specversion": b"0.3"}, "bad_specversion"),
        ({**valid_raw(), b"source": b"\xff\xfe not utf-8"}, "bad_encoding"),
    ],
    ids=["missing-fields", "bad-json", "wrong-specversion", "not-utf8"],
)
def test_invalid_entries_go_to_the_partitions_dead_letters(
    effects_engine: Engine, redis_client: redis.Redis, key_prefix: str,
    raw: dict[bytes, bytes], reason: str,
) -> None:
    recorder = Recorder()
    consumer = make_consumer(effects_engine, redis_client, key_prefix, recorder)
    partition = 2
    key = keys.stream_key(key_prefix, STREAM, partition)
    entry_id = redis_client.xadd(key, raw)  # type: ignore[arg-type]
    consumer.run_once()

    (letter,) = dead_letters(redis_client, key_prefix, partition)
    assert letter[b"dlq.reason"] == reason.encode()
    assert letter[b"dlq.stream"] == key.encode()
    assert letter[b"dlq.entry_id"] == entry_id
    assert letter[b"dlq.group"] == GROUP.encode()
    assert {k: letter[k] for k in raw} == raw  # the original fields, byte for byte
    assert consumer.stats.invalid == 1
    assert pending_total(redis_client, key_prefix) == 0
    assert recorder.calls == {} and receipt_rows(effects_engine) == {}
    for other in range(PARTITIONS):
        if other != partition:
            assert dead_letters(redis_client, key_prefix, other) == []


def test_unknown_event_type_is_dead_lettered(
    effects_engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    recorder = Recorder()
    consumer = make_consumer(effects_engine, redis_client, key_prefix, recorder)
    ev = event("agg-3", 1, type="nobody.handles.this")
    xadd_event(redis_client, key_prefix, ev)
    consumer.run_once()

    (letter,) = dead_letters(redis_client, key_prefix, keys.partition_for("agg-3", PARTITIONS))
    assert letter[b"dlq.reason"] == b"unknown_type"
    assert letter[b"id"] == ev.id.encode()
    receipt = receipt_rows(effects_engine)[ev.id]
    assert (receipt.outcome, receipt.reason) == ("dead", "unknown_type")
    assert recorder.calls == {}
    assert pending_total(redis_client, key_prefix) == 0


def test_failing_handler_rolls_back_alone_is_retried_then_dead_lettered(
    effects_engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    bad = event("agg-bad", 1)
    recorder = Recorder(fails=lambda ev, _n: ev.id == bad.id)
    consumer = make_consumer(effects_engine, redis_client, key_prefix, recorder)
    good = [event("agg-good-1", 1), event("agg-good-2", 1)]
    for ev in (good[0], bad, good[1]):
        xadd_event(redis_client, key_prefix, ev)
    assert consumer.run_once() == 3  # one batch, one claim transaction

    # The batch's other entries committed; the failing one wrote nothing and stays pending.
    assert effect_counts(effects_engine) == {good[0].id: 1, good[1].id: 1}
    assert set(receipt_rows(effects_engine)) == {good[0].id, good[1].id}
    assert consumer.stats.failed == 1
    assert pending_total(redis_client, key_prefix) == 1

    bad_partition = keys.partition_for("agg-bad", PARTITIONS)
    run_until(consumer, lambda: dead_letters(redis_client, key_prefix, bad_partition),
              "the failing entry to be dead-lettered")
    (letter,) = dead_letters(redis_client, key_prefix, bad_partition)
    assert letter[b"dlq.reason"] == b"max_deliveries"
    assert int(letter[b"dlq.deliveries"]) == 4
    assert recorder.calls[bad.id] == 3  # max_deliveries attempts, then no more
    assert consumer.stats.autoclaimed >= 3
    receipt = receipt_rows(effects_engine)[bad.id]
    assert (receipt.outcome, receipt.reason) == ("dead", "max_deliveries")
    assert bad.id not in effect_counts(effects_engine)
    assert pending_total(redis_client, key_prefix) == 0


def test_failed_entry_is_retried_through_autoclaim(
    effects_engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    recorder = Recorder(fails=lambda _ev, n: n == 1)
    consumer = make_consumer(effects_engine, redis_client, key_prefix, recorder)
    ev = event("agg-1", 1)
    xadd_event(redis_client, key_prefix, ev)
    run_until(consumer, lambda: consumer.stats.applied == 1, "the retry to succeed")
    assert consumer.stats.autoclaimed == 1 and consumer.stats.failed == 1
    assert recorder.calls == {ev.id: 2}
    assert effect_counts(effects_engine) == {ev.id: 1}
    assert pending_total(redis_client, key_prefix) == 0


def test_dead_consumers_pending_entries_are_taken_over(
    effects_engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    evs = [event(f"agg-{i}", 1) for i in range(6)]
    for ev in evs:
        xadd_event(redis_client, key_prefix, ev)
    stream_keys = streams.partition_keys(key_prefix, [STREAM], PARTITIONS)
    streams.ensure_groups(redis_client, stream_keys, GROUP)
    taken = streams.read(redis_client, dict.fromkeys(stream_keys, ">"), GROUP, "dead-one",
                         count=100, block_ms=None)
    assert len(taken) == 6  # ... and "dead-one" dies without claiming or acking

    recorder = Recorder()
    survivor = make_consumer(effects_engine, redis_client, key_prefix, recorder, consumer="c2")
    run_until(survivor, lambda: survivor.stats.applied == 6, "the survivor to take over")
    assert survivor.stats.autoclaimed == 6
    assert effect_counts(effects_engine) == {ev.id: 1 for ev in evs}
    assert pending_total(redis_client, key_prefix) == 0


def test_consumer_killed_between_claim_commit_and_ack(
    effects_engine: Engine, redis_client: redis.Redis, key_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    evs = [event(f"agg-{i}", 1) for i in range(5)]
    for ev in evs:
        xadd_event(redis_client, key_prefix, ev)
    recorder = Recorder()
    first = make_consumer(effects_engine, redis_client, key_prefix, recorder)

    def crash(*_args: Any) -> None:
        raise UnavailableError("the process died before XACK")

    monkeypatch.setattr(streams, "ack", crash)
    with pytest.raises(UnavailableError):
        first.run_once()
    monkeypatch.undo()
    assert effect_counts(effects_engine) == {ev.id: 1 for ev in evs}  # the claim committed
    assert pending_total(redis_client, key_prefix) == 5

    restarted = make_consumer(effects_engine, redis_client, key_prefix, recorder)
    assert restarted.drain_pending() == 5
    assert restarted.stats.duplicates == 5 and restarted.stats.applied == 0
    assert effect_counts(effects_engine) == {ev.id: 1 for ev in evs}
    assert recorder.calls == {ev.id: 1 for ev in evs}
    assert {r.duplicates for r in receipt_rows(effects_engine).values()} == {1}
    assert pending_total(redis_client, key_prefix) == 0


def test_a_new_group_reads_the_stream_from_its_start(
    effects_engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    evs = [event(f"agg-{i}", 1) for i in range(5)]
    for ev in evs:
        xadd_event(redis_client, key_prefix, ev)
    assert all(redis_client.xinfo_groups(key_of(key_prefix, ev.aggregateid or "")) == []
               for ev in evs)
    recorder = Recorder()
    consumer = make_consumer(effects_engine, redis_client, key_prefix, recorder)
    while consumer.stats.read < 5:
        assert consumer.run_once() > 0
    assert effect_counts(effects_engine) == {ev.id: 1 for ev in evs}


def test_end_to_end_200_events_over_4_partitions(
    effects_engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    engine = effects_engine
    relay = Relay(relay_settings(key_prefix), engine, redis_client)
    recorder = Recorder()
    consumer = make_consumer(engine, redis_client, key_prefix, recorder, batch_size=50)
    threads = [threading.Thread(target=relay.run, daemon=True),
               threading.Thread(target=consumer.run, daemon=True)]
    for t in threads:
        t.start()
    ids: list[str] = []
    try:
        for start in range(0, 200, 25):
            ids += enqueue_events(engine, 25, aggregates=20, first=start)
        wait_until(lambda: len(receipt_rows(engine)) == 200, timeout=60,
                   what="every event to be consumed")
    finally:
        relay.stop()
        consumer.stop()
        for t in threads:
            t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)

    entries = stream_entries(redis_client, key_prefix)
    assert Counter(f["id"] for _p, _e, f in entries) == Counter(ids)
    assert {p for p, _e, _f in entries} == set(range(PARTITIONS))
    assert all(r.delivered_at_ms is not None for r in outbox_rows(engine))
    got = receipt_rows(engine)
    assert set(got) == set(ids)
    assert {r.outcome for r in got.values()} == {"applied"}
    assert effect_counts(engine) == Counter(ids)
    assert pending_total(redis_client, key_prefix) == 0
    assert all(dead_letters(redis_client, key_prefix, p) == [] for p in range(PARTITIONS))


def test_backpressure_leaves_new_entries_in_the_stream_until_released(
    effects_engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    recorder = Recorder()
    busy = [True]
    recorder.handlers.pause_when(lambda: busy[0])
    consumer = make_consumer(effects_engine, redis_client, key_prefix, recorder)
    ev = event("agg-1", 1)
    xadd_event(redis_client, key_prefix, ev)
    assert consumer.run_once() == 0  # paused: nothing read, nothing pending for us
    assert recorder.calls == {} and pending_total(redis_client, key_prefix) == 0
    busy[0] = False
    run_until(consumer, lambda: recorder.calls.get(ev.id) == 1, "the entry to be handled")
    assert effect_counts(effects_engine) == {ev.id: 1}
