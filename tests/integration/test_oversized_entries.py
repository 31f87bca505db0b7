"""Entries a careless or hostile writer adds to a partition stream, on both databases and the
real Redis (issue 28, finding 6): one larger than the read limit is dead-lettered as
``oversized`` from its size without ever reaching the consumer's memory, is acknowledged, and
the partition keeps flowing; one whose data holds ``1e999`` is dead-lettered
(``non_finite_number``), never applied as ``inf``."""

from __future__ import annotations

import threading
import time
import tracemalloc
from typing import Any

import pytest
import redis
from sqlalchemy import Connection, Engine

from outbox_relay.consumer import dead_letters as dead_letters_
from outbox_relay.consumer import streams
from outbox_relay.consumer.daemon import Consumer
from outbox_relay.consumer.handlers import Handlers
from outbox_relay.shared import keys
from outbox_relay.shared.envelope import Event
from tests.helpers import (
    GROUP,
    STREAM,
    consumer_settings,
    dead_letters,
    event,
    key_of,
    partition_of,
    pending_total,
    wait_until,
    xadd_event,
)

pytestmark = pytest.mark.integration

BIG = 8 * 1024 * 1024  # far above the 1 MiB limit; the consumer must never hold it


def applying(seen: dict[str, Any]) -> Handlers:
    def apply(_conn: Connection, ev: Event) -> None:
        seen[ev.id] = ev.data

    handlers = Handlers()
    handlers.register("thing.happened", apply)
    return handlers


def test_an_oversized_entry_is_dead_lettered_unread_and_the_partition_flows(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    seen: dict[str, Any] = {}
    consumer = Consumer(consumer_settings(key_prefix), engine, redis_client, applying(seen))
    consumer.run_once()  # groups made, leases taken, the first pending pass done
    before = event("a-1", 1, data={"n": 1})
    xadd_event(redis_client, key_prefix, before)
    huge = {**event("a-1", 2, data="x").to_fields(), "data": '"' + "x" * BIG + '"'}
    huge_id = redis_client.xadd(key_of(key_prefix, "a-1"), huge)  # type: ignore[arg-type]
    after = event("a-1", 3, data={"n": 3})
    xadd_event(redis_client, key_prefix, after)

    tracemalloc.start()
    try:
        wait_until(lambda: consumer.run_once() >= 0 and after.id in seen,
                   what="the entry after the oversized one applied")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < BIG // 4, f"the consumer held {peak} bytes at its peak"
    assert seen == {before.id: {"n": 1}, after.id: {"n": 3}}  # in order, nothing halted
    assert pending_total(redis_client, key_prefix) == 0  # the oversized entry is acknowledged
    [letter] = dead_letters(redis_client, key_prefix, partition_of("a-1"))
    assert letter[b"dlq.reason"] == b"oversized"
    assert letter[b"dlq.entry_id"] == huge_id
    assert int(letter[b"dlq.size"]) == sum(len(k) + len(v) for k, v in huge.items())
    assert b"data" not in letter and len(b"".join(letter.values())) < 2048  # a small record
    assert consumer.stats.invalid == 1
    # Replay has nothing to apply: the letter stays, and says why.
    [listed] = dead_letters_.list_letters(redis_client, key_prefix, stream=STREAM)
    result = dead_letters_.replay(redis_client, engine, listed, applying(seen), group=GROUP)
    assert (result.outcome, result.removed) == ("invalid", False)
    assert result.detail.startswith("oversized: the entry was never read")


def test_a_blocked_read_gets_an_oversized_entry_as_its_size(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    key = keys.stream_key(key_prefix, STREAM, 0)
    streams.ensure_groups(redis_client, [key], GROUP)
    got: list[list[streams.Entry]] = []
    started = time.monotonic()
    reader = threading.Thread(target=lambda: got.append(streams.read(
        redis_client, {key: ">"}, GROUP, "c1", count=10, block_ms=5_000)))
    reader.start()
    time.sleep(0.2)  # the reader is waiting; the entry arrives meanwhile
    redis_client.xadd(key, {"data": "y" * (2 * 1024 * 1024)})
    reader.join(timeout=10)
    assert time.monotonic() - started < 2  # answered as the entry came, not at block_ms
    [[entry]] = got
    assert isinstance(entry.fields, streams.OversizedFields)
    assert entry.fields.size == len("data") + 2 * 1024 * 1024 and not entry.fields
    # Nothing new: the read waits block_ms, then answers nothing.
    started = time.monotonic()
    assert streams.read(redis_client, {key: ">"}, GROUP, "c1", count=10, block_ms=300) == []
    assert 0.3 <= time.monotonic() - started < 2
    # Entries at the limit are read whole; pending re-reads are bounded too.
    redis_client.xadd(key, {"data": "z" * 100})
    [small] = streams.read(redis_client, {key: ">"}, GROUP, "c1", count=10, block_ms=None,
                           max_entry_bytes=104)
    assert small.fields == {b"data": b"z" * 100}
    again = streams.read(redis_client, {key: "0"}, GROUP, "c1", count=10, block_ms=None,
                         max_entry_bytes=103)
    assert [type(e.fields) for e in again] == [streams.OversizedFields] * 2
    assert [e.deliveries for e in again] == [2, 2]


@pytest.mark.parametrize("data", ['{"total": 1e999}', '{"total": -1e999}', '{"total": NaN}',
                                  "Infinity"])
def test_non_finite_numbers_in_data_are_dead_lettered_never_applied(
    engine: Engine, redis_client: redis.Redis, key_prefix: str, data: str
) -> None:
    seen: dict[str, Any] = {}
    consumer = Consumer(consumer_settings(key_prefix), engine, redis_client, applying(seen))
    bad = {**event("n-1", 1).to_fields(), "data": data}
    redis_client.xadd(key_of(key_prefix, "n-1"), bad)  # type: ignore[arg-type]
    good = event("n-1", 2, data={"total": 2})
    xadd_event(redis_client, key_prefix, good)
    wait_until(lambda: consumer.run_once() >= 0 and good.id in seen,
               what="the next event applied")
    assert seen == {good.id: {"total": 2}}  # never applied as inf or nan
    [letter] = dead_letters(redis_client, key_prefix, partition_of("n-1"))
    assert letter[b"dlq.reason"] == b"non_finite_number"
    assert letter[b"data"] == data.encode()  # the evidence, as written
    assert pending_total(redis_client, key_prefix) == 0


def test_plain_reads_when_bounded_reads_is_off_still_dead_letter_a_large_entry(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    """``OUTBOX_BOUNDED_READS=false``: a plain blocking ``XREADGROUP`` (no script), so a new
    entry wakes a waiting read at once; an entry over the limit is then read whole, but it is
    still dead-lettered (``data_too_large``), acknowledged, and the partition flows."""
    seen: dict[str, Any] = {}
    settings = consumer_settings(key_prefix, bounded_reads=False, max_data_bytes=1024)
    consumer = Consumer(settings, engine, redis_client, applying(seen))
    assert consumer._entry_limit is None
    consumer.run_once()
    big = event("b-1", 1, data="x" * 4096)
    after = event("b-1", 2, data={"n": 2})
    xadd_event(redis_client, key_prefix, big)
    xadd_event(redis_client, key_prefix, after)
    wait_until(lambda: consumer.run_once() >= 0 and after.id in seen, what="the next event")
    assert seen == {after.id: {"n": 2}}
    assert pending_total(redis_client, key_prefix) == 0
    [letter] = dead_letters(redis_client, key_prefix, partition_of("b-1"))
    assert letter[b"dlq.reason"] == b"data_too_large" and b"data" in letter
    # The plain read blocks inside Redis and answers when an entry arrives.
    key = keys.stream_key(key_prefix, STREAM, 0)
    streams.ensure_groups(redis_client, [key], GROUP)
    got: list[list[streams.Entry]] = []
    reader = threading.Thread(target=lambda: got.append(streams.read(
        redis_client, {key: ">"}, GROUP, "c9", count=10, block_ms=5_000,
        max_entry_bytes=None)))
    started = time.monotonic()
    reader.start()
    redis_client.xadd(key, {"data": "y" * 10})
    reader.join(timeout=10)
    assert time.monotonic() - started < 2
    [[entry]] = got
    assert entry.fields == {b"data": b"y" * 10}
