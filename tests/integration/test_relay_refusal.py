"""Issue 28, finding 2: one foreign ``XADD`` must not halt a partition, and a refused append
must not spin. Real Redis, both databases.

* A foreign entry above every id the relay assigned (the maximum id, an id far in the future)
  is moved by the relay's repair to the dead-letter stream (``foreign_entry``, with its id and
  fields); the stream's last id goes back to the relay's entries, groups that read past it are
  set back, and new events are delivered (and applied) within a bounded wait.
* An append Redis refuses (an ACL without write access to the stream, out of memory) makes
  that stream back off alone: its attempt count grows only when its wait is over, one WARNING
  per change of state, other streams of the same partition keep flowing, and once the refusal
  is lifted everything arrives once and in order.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis
from prometheus_client import CollectorRegistry
from sqlalchemy import Engine, update

from outbox_relay.cli import status
from outbox_relay.consumer.daemon import Consumer
from outbox_relay.producer import Producer
from outbox_relay.relay import append, entry_ids, store
from outbox_relay.relay.daemon import Relay
from outbox_relay.relay.metrics import RelayMetrics
from outbox_relay.relay.refusals import StreamBackoff
from outbox_relay.shared import keys
from outbox_relay.shared.db import now_ms
from outbox_relay.shared.redis_conn import connect_redis
from outbox_relay.shared.schema import relay_leases
from tests.helpers import (
    GROUP,
    PARTITIONS,
    STREAM,
    Recorder,
    consumer_settings,
    dead_letters,
    documented_acl,
    effect_counts,
    enqueue_events,
    outbox_rows,
    partition_of,
    private_redis,
    relay_settings,
    rule_words,
    stream_entries,
    undelivered,
    wait_until,
)

pytestmark = pytest.mark.integration

MAX_ID = "18446744073709551615-18446744073709551615"
AGG = "agg-0"


def relay_until_delivered(relay: Relay, engine: Engine, what: str) -> None:
    """Relay rounds (a daemon's, not ``--until-idle``) until the outbox is drained."""
    wait_until(lambda: relay.run_once() >= 0 and undelivered(engine) == 0, timeout=15,
               what=what)


def ids_in_stream(client: redis.Redis, prefix: str) -> list[str]:
    return [f.get("id", "") for _p, _i, f in stream_entries(client, prefix)]


def foreign_letters(client: redis.Redis, prefix: str) -> list[dict[bytes, bytes]]:
    return [d for d in dead_letters(client, prefix, partition_of(AGG))
            if d.get(b"dlq.reason") == b"foreign_entry"]


@pytest.mark.slow
@pytest.mark.parametrize("foreign_id", [MAX_ID, "99999999999999-0"],
                         ids=["max-id", "far-future"])
def test_a_foreign_entry_is_dead_lettered_and_the_partition_resumes(
    effects_engine: Engine, redis_client: redis.Redis, key_prefix: str, foreign_id: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = effects_engine
    key = keys.stream_key(key_prefix, STREAM, partition_of(AGG))
    recorder = Recorder()
    consumer = Consumer(consumer_settings(key_prefix), engine, redis_client, recorder.handlers)
    relay = Relay(relay_settings(key_prefix), engine, redis_client)
    first = enqueue_events(engine, 3, aggregates=1)
    relay_until_delivered(relay, engine, "the first events")
    wait_until(lambda: consumer.run_once() >= 0 and len(effect_counts(engine)) == 3,
               what="the first events applied")
    # A second group reads everything, the foreign entry too, and acknowledges nothing.
    redis_client.xgroup_create(key, "g2", id="0")

    redis_client.xadd(key, {"foo": "bar", "n": "1"}, id=foreign_id)
    assert len(redis_client.xreadgroup("g2", "c", {key: ">"})[0][1]) == 4
    consumer.run_once()  # group g1 reads (and dead-letters) the foreign entry: read past it
    later = enqueue_events(engine, 3, aggregates=1, first=3)
    with caplog.at_level(logging.WARNING):
        relay_until_delivered(relay, engine, "the events after the foreign entry")

    assert ids_in_stream(redis_client, key_prefix) == first + later  # each once, in order
    (letter,) = foreign_letters(redis_client, key_prefix)
    assert letter[b"dlq.entry_id"] == foreign_id.encode()
    assert (letter[b"foo"], letter[b"n"]) == (b"bar", b"1")
    assert letter[b"dlq.stream"] == key.encode()
    assert relay.repairer.stats.foreign_entries == 1
    errors = [r for r in caplog.records if r.levelno == logging.ERROR
              and "foreign" in r.getMessage()]
    assert len(errors) == 1 and foreign_id in errors[0].getMessage()
    for row in outbox_rows(engine):
        assert entry_ids.greater(foreign_id, row.entry_id)  # never above the foreign id
        assert entry_ids.parse(row.entry_id)[0] < now_ms() + 60_000

    # The groups were set back to the stream's last id: both get the new events.
    wait_until(lambda: consumer.run_once() >= 0 and len(effect_counts(engine)) == 6,
               what="the new events applied")
    assert effect_counts(engine) == Counter(first + later)
    groups = {g["name"].decode(): g for g in redis_client.xinfo_groups(key)}
    top = redis_client.xinfo_stream(key)["last-generated-id"]
    assert groups[GROUP]["last-delivered-id"] == top
    got = redis_client.xreadgroup("g2", "c", {key: ">"})
    assert [f[b"id"].decode() for _i, f in got[0][1]] == later
    # g2's pending entries are the real events only: the foreign one was acknowledged.
    pending = redis_client.xpending_range(key, "g2", "-", "+", 100)
    assert len(pending) == 6 and all(p["message_id"].decode() != foreign_id for p in pending)


@pytest.mark.slow
def test_a_bare_foreign_last_id_out_of_reach_is_set_back(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    """The foreign entry was deleted, but the stream's last id stays at the maximum: no
    explicit id can follow it. Nothing to dead-letter; the last id goes back."""
    key = keys.stream_key(key_prefix, STREAM, partition_of(AGG))
    relay = Relay(relay_settings(key_prefix), engine, redis_client)
    first = enqueue_events(engine, 2, aggregates=1)
    relay_until_delivered(relay, engine, "the first events")
    redis_client.xadd(key, {"foo": "bar"}, id=MAX_ID)
    redis_client.xdel(key, MAX_ID)
    later = enqueue_events(engine, 2, aggregates=1, first=2)
    relay_until_delivered(relay, engine, "the events after the foreign last id")
    assert ids_in_stream(redis_client, key_prefix) == first + later
    assert foreign_letters(redis_client, key_prefix) == []
    assert relay.repairer.stats.foreign_tops == 1


def test_entries_the_relay_appended_are_never_foreign(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    """A batch appended and never settled (the relay died after its XADD) is above every
    delivered id, but at or below the lease row's last assigned id: it is the relay's own."""
    ids = enqueue_events(engine, 3, aggregates=1)
    relay = Relay(relay_settings(key_prefix), engine, redis_client)
    relay_until_delivered(relay, engine, "the first events")
    more = enqueue_events(engine, 2, aggregates=1, first=3)
    partition = partition_of(AGG)
    epoch = relay.leases[partition]
    rows = store.take_batch(engine, partition, relay.node_id, epoch, 100, 10_000)
    verdicts = append.append(redis_client, key_prefix, rows, epoch)
    assert len(verdicts.delivered) == 2  # in the stream, not marked delivered

    relay.repairer.run(relay.leases)
    assert relay.repairer.stats.foreign_entries == relay.repairer.stats.foreign_tops == 0
    assert ids_in_stream(redis_client, key_prefix) == ids + more
    relay_until_delivered(relay, engine, "the unsettled batch settled")
    assert ids_in_stream(redis_client, key_prefix) == ids + more  # found there, not again
    assert foreign_letters(redis_client, key_prefix) == []


def test_a_near_foreign_last_id_with_no_entry_is_adopted(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    """A last id a little ahead of the clock with no entry left: the relay's ids continue
    above it (nothing to move, no rebuild), as before."""
    key = keys.stream_key(key_prefix, STREAM, partition_of(AGG))
    relay = Relay(relay_settings(key_prefix), engine, redis_client)
    first = enqueue_events(engine, 1, aggregates=1)
    relay_until_delivered(relay, engine, "the first event")
    ahead = f"{now_ms() + 600_000}-0"
    redis_client.xadd(key, {"foo": "bar"}, id=ahead)
    redis_client.xdel(key, ahead)
    later = enqueue_events(engine, 2, aggregates=1, first=1)
    relay_until_delivered(relay, engine, "the later events")
    assert ids_in_stream(redis_client, key_prefix) == first + later
    assert relay.repairer.stats.foreign_entries == 0
    for row in outbox_rows(engine)[1:]:
        assert entry_ids.greater(row.entry_id, ahead)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def backoff_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "outbox_relay.relay.refusals" and r.levelno == logging.WARNING]


def test_a_stream_without_write_access_backs_off_alone_and_recovers(
    engine: Engine, key_prefix: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An ACL user that may not write the partition stream of ``runs`` (its fence and dead
    stream, and the ``other`` stream, it may): the ``runs`` rows wait with backoff while the
    ``other`` rows of the same partition are delivered; lifted, everything arrives in order."""
    with private_redis(tmp_path / "redis") as url:
        admin = connect_redis(url)
        port = url.rsplit(":", 1)[1].split("/")[0]
        runs_keys = f"{key_prefix}:{{{STREAM}:*"
        admin.execute_command(
            "ACL", "SETUSER", "relay", "reset", "on", "nopass", "+@all", "&*",
            f"%R~{runs_keys}", f"~{key_prefix}:{{other:*", f"~{runs_keys}}}:*",
            f"~{key_prefix}:{{{STREAM}:*:rebuild")
        client = connect_redis(f"redis://relay:x@127.0.0.1:{port}/0")
        clock = FakeClock()
        relay = Relay(relay_settings(key_prefix, redis_url=url), engine, client)
        relay.refusals = StreamBackoff(first_s=1.0, max_s=8.0, clock=clock)
        metrics = RelayMetrics(relay)
        runs = enqueue_events(engine, 3, aggregates=1)
        other = enqueue_other(engine, 3)

        with caplog.at_level(logging.WARNING):
            for _ in range(20):
                relay.run_once()
            rows = {r.event_id: r for r in outbox_rows(engine)}
            assert all(rows[i].delivered_at_ms is not None for i in other)  # flowed
            assert [rows[i].attempts for i in runs] == [1, 0, 0]  # not 20
            assert rows[runs[0]].last_error == "redis_acl"
            assert len(backoff_warnings(caplog)) == 1
            assert "redis_acl" in backoff_warnings(caplog)[0]
            assert sample(metrics.registry, STREAM, partition_of(AGG), "redis_acl") == 1

            clock.now += 1.5  # the first wait is over: one more attempt, refused, silent
            for _ in range(5):
                relay.run_once()
            assert outbox_rows_by_id(engine)[runs[0]].attempts == 2
            assert len(backoff_warnings(caplog)) == 1

            admin.execute_command("ACL", "SETUSER", "relay", "resetkeys", "~*")  # lifted
            clock.now += 10
            wait_until(lambda: relay.run_once() >= 0 and undelivered(engine) == 0,
                       timeout=15, what="the refused stream delivered")
        assert [f["id"] for _p, _i, f in stream_entries(client, key_prefix)] == runs
        assert [f["id"] for _p, _i, f in stream_entries(client, key_prefix,
                                                        stream="other")] == other
        warnings = backoff_warnings(caplog)
        assert len(warnings) == 2 and "again" in warnings[1]
        assert sample(metrics.registry, STREAM, partition_of(AGG), "redis_acl") is None
        client.close()
        admin.close()


def test_out_of_memory_backs_off_then_delivers_once_in_order(
    engine: Engine, key_prefix: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with private_redis(tmp_path / "redis") as url:
        client = connect_redis(url)
        clock = FakeClock()
        relay = Relay(relay_settings(key_prefix, redis_url=url), engine, client)
        relay.refusals = StreamBackoff(first_s=1.0, max_s=8.0, clock=clock)
        ids = enqueue_events(engine, 1, aggregates=1)
        relay_until_delivered(relay, engine, "the first event")
        ids += enqueue_events(engine, 3, aggregates=1, first=1)
        client.config_set("maxmemory", 1)  # noeviction: every write is refused with OOM
        with caplog.at_level(logging.WARNING):
            for _ in range(20):
                relay.run_once()
            assert [r.attempts for r in outbox_rows(engine)][1:] == [1, 0, 0]
            assert [r.last_error for r in outbox_rows(engine)][1:] == ["redis_oom", None, None]
            for _ in range(4):  # each wait over: one attempt each, no more WARNING
                clock.now += 20
                relay.run_once()
            assert outbox_rows_by_id(engine)[ids[1]].attempts == 5
            assert len(backoff_warnings(caplog)) == 1
            shown = status.render(status.collect(engine, client, key_prefix))
            assert (f"relay: stream {STREAM}:{partition_of(AGG)} refused by Redis (redis_oom): "
                    "1 rows wait") in shown
            client.config_set("maxmemory", 0)
            clock.now += 20
            wait_until(lambda: relay.run_once() >= 0 and undelivered(engine) == 0,
                       timeout=15, what="delivery after the OOM")
        assert [f["id"] for _p, _i, f in stream_entries(client, key_prefix)] == ids
        assert len(backoff_warnings(caplog)) == 2
        assert relay.refusals.refused == {}
        client.close()


def test_a_repair_refused_for_lack_of_memory_is_retried_never_fatal(
    engine: Engine, key_prefix: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis lost a stream and is at maxmemory: the repair's refill is refused with OOM. The
    relay says so and goes on (before, the error ended the relay with exit 1: found by the
    torture's refused-append fault); once memory is back the next check refills the stream."""
    with private_redis(tmp_path / "redis") as url:
        client = connect_redis(url)
        relay = Relay(relay_settings(key_prefix, redis_url=url), engine, client)
        ids = enqueue_events(engine, 3, aggregates=1)
        relay_until_delivered(relay, engine, "the first events")
        stream_key = keys.stream_key(key_prefix, STREAM, partition_of(AGG))
        client.delete(stream_key)  # Redis lost it
        client.config_set("maxmemory", 1)
        with caplog.at_level(logging.WARNING):
            relay.repairer.check_soon()
            relay.run_once()  # the check runs: its refill is refused, the round goes on
        assert relay.repairer.stats.refused == 1
        assert f"repair of {stream_key} (stream_missing) refused by Redis: redis_oom" in caplog.text
        assert client.exists(stream_key) == 0
        client.config_set("maxmemory", 0)
        relay.repairer.check_soon()
        relay.run_once()
        assert [f["id"] for _p, _i, f in stream_entries(client, key_prefix)] == ids
        client.close()


def enqueue_other(engine: Engine, count: int) -> list[str]:
    """Events of aggregate ``agg-0`` (the same partition) on the stream ``other``."""
    producer = Producer(source="tests", partitions=PARTITIONS)
    with engine.begin() as conn:
        return [producer.enqueue(conn, type="other.happened", stream="other", data={"i": i},
                                 aggregate_type="thing", aggregate_id=AGG, revision=i + 1)
                for i in range(count)]


def outbox_rows_by_id(engine: Engine) -> dict[str, Any]:
    return {r.event_id: r for r in outbox_rows(engine)}


def sample(registry: CollectorRegistry, stream: str, partition: int, reason: str) -> float | None:
    return registry.get_sample_value("outbox_relay_stream_backoff",
                                     {"stream": stream, "partition": str(partition),
                                      "reason": reason})



@pytest.mark.slow
def test_the_foreign_move_needs_no_more_than_the_documented_relay_acl(
    engine: Engine, key_prefix: str, tmp_path: Path
) -> None:
    """The move runs through the rebuild's scripts: the relay's documented ACL user
    (docs/security.md) is enough, on a stream with a group that read the foreign entry."""
    rules = documented_acl()["relay"].replace("~outbox:*", f"~{key_prefix}:*")
    rules = re.sub(r">\S+", ">relay-pw", rules)
    with private_redis(tmp_path / "redis") as url:
        admin = connect_redis(url)
        admin.execute_command("ACL", "SETUSER", "outbox-relay", "reset", *rule_words(rules))
        port = url.rsplit(":", 1)[1].split("/")[0]
        client = connect_redis(f"redis://outbox-relay:relay-pw@127.0.0.1:{port}/0")
        key = keys.stream_key(key_prefix, STREAM, partition_of(AGG))
        relay = Relay(relay_settings(key_prefix, redis_url=url), engine, client)
        first = enqueue_events(engine, 2, aggregates=1)
        relay_until_delivered(relay, engine, "the first events")
        admin.xgroup_create(key, GROUP, id="0")
        admin.xadd(key, {"foo": "bar"}, id=MAX_ID)
        admin.xreadgroup(GROUP, "c", {key: ">"})
        later = enqueue_events(engine, 2, aggregates=1, first=2)
        relay_until_delivered(relay, engine, "the events after the foreign entry")
        assert ids_in_stream(client, key_prefix) == first + later
        assert len(foreign_letters(admin, key_prefix)) == 1
        got = admin.xreadgroup(GROUP, "c", {key: ">"})
        assert [f[b"id"].decode() for _i, f in got[0][1]] == later
        client.close()
        admin.close()


def test_a_lease_row_left_out_of_reach_by_an_earlier_version_is_set_back(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    """Before the fix, the relay adopted the foreign maximum id as its last assigned id, and
    the next take went above it (an id Redis refuses): upgraded, the partition resumes."""
    key = keys.stream_key(key_prefix, STREAM, partition_of(AGG))
    relay = Relay(relay_settings(key_prefix), engine, redis_client)
    first = enqueue_events(engine, 2, aggregates=1)
    relay_until_delivered(relay, engine, "the first events")
    redis_client.xadd(key, {"foo": "bar"}, id=MAX_ID)
    with engine.begin() as conn:  # what the old settle and the take after it recorded
        conn.execute(update(relay_leases).where(relay_leases.c.partition == partition_of(AGG))
                     .values(last_entry_id="18446744073709551616-3", inflight="[]"))
    later = enqueue_events(engine, 2, aggregates=1, first=2)
    relay.repairer.check_soon()
    relay_until_delivered(relay, engine, "the events after the reset")
    assert ids_in_stream(redis_client, key_prefix) == first + later
    (letter,) = foreign_letters(redis_client, key_prefix)
    assert letter[b"dlq.entry_id"] == MAX_ID.encode()


def test_a_foreign_entry_behind_the_clock_halts_nothing_and_stays(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    """``XADD … *`` gets an id the relay's next ids pass: nothing is halted, so nothing is
    moved; the entry stays for the consumers (which dead-letter it if invalid or unsigned)."""
    key = keys.stream_key(key_prefix, STREAM, partition_of(AGG))
    relay = Relay(relay_settings(key_prefix), engine, redis_client)
    first = enqueue_events(engine, 1, aggregates=1)
    relay_until_delivered(relay, engine, "the first event")
    foreign = redis_client.xadd(key, {"foo": "bar"}).decode()
    relay.repairer.run(relay.leases)
    later = enqueue_events(engine, 1, aggregates=1, first=1)
    relay_until_delivered(relay, engine, "the later event")
    assert ids_in_stream(redis_client, key_prefix) == [*first, "", *later]
    assert redis_client.xrange(key, foreign, foreign)
    assert foreign_letters(redis_client, key_prefix) == []
    assert relay.repairer.stats.foreign_entries == relay.repairer.stats.foreign_tops == 0
