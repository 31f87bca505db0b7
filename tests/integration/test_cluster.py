"""Redis Cluster (3 masters, 1 replica each, started here on free ports by
:class:`torture.redis_sets.LocalCluster`): the relay, a consumer and the CLI connect through
``redis+cluster://``, with 8 partitions whose streams live on all 3 masters.

* End to end: every event reaches its partition's stream on its slot's master once and is
  applied once, in revision order per aggregate.
* ``outbox status`` and ``outbox dlq list`` see streams and dead letters on every master.
* A master killed with ``OUTBOX_WAIT_REPLICAS=1``: the outbox marks a batch delivered only once
  the replica has it, so the promoted replica holds exactly what the outbox calls delivered
  (a batch appended while the replica was cut off stays unmarked and is appended again once
  the old master is back as the new one's replica).
* A master killed without WAIT, its replica cut off its replication stream while a batch was
  delivered and consumed: the promoted replica lacks exactly that batch; ``outbox reconcile``
  names the streams behind, the relay's repair puts back exactly the missing entries under
  their original ids, and every event is applied once.

Tests that kill nodes get a cluster of their own; the others share one (keys apart by prefix).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, select

from outbox_relay.consumer import Handlers
from outbox_relay.consumer.daemon import Consumer
from outbox_relay.producer import Producer
from outbox_relay.relay import entry_ids
from outbox_relay.relay.daemon import Relay
from outbox_relay.shared import keys
from outbox_relay.shared.envelope import Event
from outbox_relay.shared.errors import UnavailableError
from outbox_relay.shared.redis_conn import connect_redis
from outbox_relay.shared.schema import outbox
from tests.helpers import (
    GROUP,
    OUTBOX,
    STREAM,
    consumer_settings,
    create_effects,
    effect_counts,
    effects,
    record_effect,
    relay_settings,
    undelivered,
    wait_until,
)
from torture.redis_sets import LocalCluster, TopologyUnsupported

pytestmark = [pytest.mark.integration, pytest.mark.torture]  # starts a Redis Cluster

PARTITIONS = 8
AGGREGATES = 24  # every partition of 8 has aggregates; 24 consecutive events reach them all


def start_cluster(workdir: Path) -> LocalCluster:
    try:
        return LocalCluster(workdir, masters=3, replicas=1).start()
    except TopologyUnsupported as err:
        pytest.skip(f"no local Redis Cluster: {err}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """One cluster for the tests that do not break it (each test has its own key prefix)."""
    started = start_cluster(tmp_path_factory.mktemp("cluster"))
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture
def fresh_cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    """A cluster of this test's own (it kills a node)."""
    started = start_cluster(tmp_path / "cluster")
    try:
        yield started
    finally:
        started.stop()


def stream_key(prefix: str, partition: int) -> str:
    return keys.stream_key(prefix, STREAM, partition)


def enqueue(engine: Engine, count: int, *, first: int = 0) -> list[str]:
    """``count`` events round-robin over :data:`AGGREGATES` aggregates, revision order within
    each, in one transaction; their ids."""
    producer = Producer(source="tests", partitions=PARTITIONS)
    with engine.begin() as conn:
        return [producer.enqueue(conn, type="thing.happened", stream=STREAM, data={"i": i},
                                 aggregate_type="thing", aggregate_id=f"agg-{i % AGGREGATES}",
                                 revision=i // AGGREGATES + 1)
                for i in range(first, first + count)]


def delivered_rows(engine: Engine) -> dict[int, list[tuple[str, str]]]:
    """Per partition: ``(entry id, event id)`` of every delivered row, in entry id order."""
    with engine.connect() as conn:
        rows = conn.execute(select(outbox.c.partition, outbox.c.entry_id, outbox.c.event_id)
                            .where(outbox.c.delivered_at_ms.is_not(None))).all()
    out: dict[int, list[tuple[str, str]]] = {p: [] for p in range(PARTITIONS)}
    for partition, entry_id, event_id in rows:
        out[partition].append((entry_id, event_id))
    return {p: sorted(v, key=lambda t: entry_ids.parse(t[0])) for p, v in out.items()}


def in_stream(cluster: LocalCluster, prefix: str, partition: int,
              port: int | None = None) -> list[tuple[str, str]]:
    """``(entry id, event id)`` of every entry of a partition stream, read with a plain client
    from ``port`` (default: the master of its slot now)."""
    key = stream_key(prefix, partition)
    with cluster.client(port or cluster.master_of(key)) as client:
        return [(i.decode(), f[b"id"].decode()) for i, f in client.xrange(key)]


def applied_revisions(engine: Engine) -> dict[str, list[int]]:
    """Per aggregate, the revisions its effects were recorded with, in the order applied."""
    out: dict[str, list[int]] = defaultdict(list)
    with engine.connect() as conn:
        for event_id, note in conn.execute(select(effects.c.event_id, effects.c.note)
                                           .order_by(effects.c.n)):
            out[event_id.split(":", 1)[0]].append(int(note))
    return dict(out)


class World:
    """A relay and a consumer of one test on the cluster's URL."""

    def __init__(self, engine: Engine, cluster: LocalCluster, prefix: str,
                 **relay_overrides: Any) -> None:
        self.engine, self.cluster, self.prefix = engine, cluster, prefix
        self.ids: list[str] = []
        url = cluster.url
        create_effects(engine)
        handlers = Handlers()

        @handlers.on("thing.happened")
        def apply(conn: Connection, event: Event) -> None:
            record_effect(conn, event, note=str(event.revision))

        self.relay = Relay(relay_settings(prefix, redis_url=url, partitions=PARTITIONS,
                                          startup_timeout_s=5, **relay_overrides),
                           engine, connect_redis(url, timeout_s=2))
        self.consumer = Consumer(
            consumer_settings(prefix, redis_url=url, partitions=PARTITIONS, redis_timeout_s=2),
            engine, connect_redis(url, timeout_s=2), handlers)

    def enqueue(self, count: int) -> list[str]:
        new = enqueue(self.engine, count, first=len(self.ids))
        self.ids += new
        return new

    def relay_all(self, timeout: float = 60) -> None:
        """Relay until the outbox has nothing undelivered (an unavailable Redis is retried:
        the old master's connections fail after a failover)."""
        def step() -> bool:
            with contextlib.suppress(UnavailableError):
                self.relay.run(until_idle=True)
            return undelivered(self.engine) == 0

        wait_until(step, timeout=timeout, what="every outbox row delivered")

    def consume_until(self, count: int, timeout: float = 60) -> None:
        def step() -> bool:
            with contextlib.suppress(UnavailableError):
                self.consumer.run_once(block_ms=20)
            return sum(effect_counts(self.engine).values()) >= count

        wait_until(step, timeout=timeout, what=f"{count} effects")

    def settle_then_pick_master(self, count: int = 50) -> tuple[int, int, list[int]]:
        """Deliver and apply ``count`` events, then the master holding partition 0, its replica
        (caught up: everything so far is on it) and the partitions that master holds."""
        self.enqueue(count)
        self.relay_all()
        self.consume_until(count)
        master = self.cluster.master_of(stream_key(self.prefix, 0))
        replica = self.cluster.replica_of(master)
        self.cluster.wait_replica_synced(replica)
        return master, replica, partitions_on(self.cluster, self.prefix, master)

    def assert_exactly_once_in_order(self) -> None:
        """Every row delivered, each stream exactly the outbox's delivered rows (no entry twice,
        none missing), every event applied once, each aggregate in revision order."""
        assert undelivered(self.engine) == 0
        expected = delivered_rows(self.engine)
        assert sum(map(len, expected.values())) == len(self.ids)
        streams = {p: in_stream(self.cluster, self.prefix, p) for p in range(PARTITIONS)}
        for p in range(PARTITIONS):
            assert streams[p] == expected[p], f"partition {p}"
        assert Counter(e for entries in streams.values() for _, e in entries) == dict.fromkeys(
            self.ids, 1)
        assert effect_counts(self.engine) == dict.fromkeys(self.ids, 1)
        counts = Counter(i.split(":", 1)[0] for i in self.ids)
        assert applied_revisions(self.engine) == {
            agg: list(range(1, n + 1)) for agg, n in counts.items()}


def outbox_cli(engine: Engine, cluster: LocalCluster, prefix: str,
               *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.update({"OUTBOX_DATABASE_URL": engine.url.render_as_string(hide_password=False),
                "OUTBOX_REDIS_URL": cluster.url, "OUTBOX_KEY_PREFIX": prefix,
                "OUTBOX_PARTITIONS": str(PARTITIONS)})
    return subprocess.run([str(OUTBOX), *args], env=env, capture_output=True, text=True,
                          timeout=60, check=False)


def partitions_on(cluster: LocalCluster, prefix: str, port: int) -> list[int]:
    return [p for p in range(PARTITIONS) if cluster.master_of(stream_key(prefix, p)) == port]


def test_aggregates_cover_every_partition() -> None:
    assert {keys.partition_for(f"agg-{a}", PARTITIONS) for a in range(AGGREGATES)} == set(
        range(PARTITIONS))


def test_end_to_end_over_three_masters(
    engine: Engine, cluster: LocalCluster, key_prefix: str
) -> None:
    world = World(engine, cluster, key_prefix)
    world.enqueue(200)
    world.relay.run(until_idle=True)
    world.consume_until(200)

    world.assert_exactly_once_in_order()
    masters = cluster.master_ports()
    assert len(masters) == 3
    per_master: Counter[int] = Counter()
    for port in masters:
        with cluster.client(port) as client:
            for p in partitions_on(cluster, key_prefix, port):
                per_master[port] += int(client.xlen(stream_key(key_prefix, p)))
    assert sum(per_master.values()) == 200
    assert all(per_master[port] > 0 for port in masters), per_master


def test_status_lists_the_streams_of_every_master(
    engine: Engine, cluster: LocalCluster, key_prefix: str
) -> None:
    world = World(engine, cluster, key_prefix)
    world.enqueue(48)
    world.relay.run(until_idle=True)
    world.consume_until(48)

    result = outbox_cli(engine, cluster, key_prefix, "status", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["outbox"] == {"undelivered": 0, "delivered": 48,
                                "oldest_undelivered_age_s": None, "errors": {}}
    expected = {p: len(rows) for p, rows in delivered_rows(engine).items()}
    assert {s["partition"]: s["length"] for s in report["streams"]} == expected
    assert {s["key"] for s in report["streams"]} == {
        stream_key(key_prefix, p) for p in range(PARTITIONS)}
    assert len({cluster.master_of(s["key"]) for s in report["streams"]}) == 3
    for s in report["streams"]:
        assert [(g["name"], g["pending"], g["lag"]) for g in s["groups"]] == [(GROUP, 0, 0)]
        assert s["dead_letters"] == 0


def test_dlq_list_finds_a_letter_beyond_the_first_node(
    engine: Engine, cluster: LocalCluster, key_prefix: str
) -> None:
    first = cluster.master_ports()[0]  # the URL's first node
    partition = next(p for p in range(PARTITIONS)
                     if cluster.master_of(stream_key(key_prefix, p)) != first)
    key = stream_key(key_prefix, partition)
    world = World(engine, cluster, key_prefix)
    with cluster.client(cluster.master_of(key)) as client:
        entry_id = client.xadd(key, {b"type": b"\xff"}).decode()  # never parses

        def lettered() -> bool:
            world.consumer.run_once(block_ms=20)
            return int(client.xlen(keys.dead_letter_key(key_prefix, STREAM, partition))) == 1

        wait_until(lettered, timeout=30, what="the malformed entry dead-lettered")

    result = outbox_cli(engine, cluster, key_prefix, "dlq", "list", "--json")
    assert result.returncode == 0, result.stderr
    [letter] = json.loads(result.stdout)
    assert (letter["stream_key"], letter["entry_id"], letter["reason"], letter["group"]) == (
        key, entry_id, "bad_encoding", GROUP)
    assert letter["dead_letter_key"] == keys.dead_letter_key(key_prefix, STREAM, partition)
    assert letter["fields"] == {"type": "\\xff"}


def test_failover_with_wait_keeps_everything_marked_delivered(
    engine: Engine, fresh_cluster: LocalCluster, key_prefix: str
) -> None:
    cluster = fresh_cluster
    world = World(engine, cluster, key_prefix, wait_replicas=1, wait_timeout_ms=500)
    master, replica, mine = world.settle_then_pick_master()

    # The replica is cut off its master's replication stream: a batch appended to the master
    # now is not confirmed by WAIT 1 and stays unmarked (the round stops at that batch).
    cluster.cut_off(replica)
    try:
        world.enqueue(AGGREGATES)
        with pytest.raises(UnavailableError):
            world.relay.run_once()
        unconfirmed = {p: len(in_stream(cluster, key_prefix, p, master))
                       - len(delivered_rows(engine)[p]) for p in mine}
    finally:
        cluster.kill(master)
        cluster.resume(replica)
    assert sum(unconfirmed.values()) > 0, unconfirmed
    assert cluster.wait_failover(master, replica) == replica

    # Before anything is relayed again: the promoted replica holds exactly what is marked.
    delivered = delivered_rows(engine)
    for p in mine:
        assert in_stream(cluster, key_prefix, p, replica) == delivered[p], f"partition {p}"

    # WAIT 1 needs a replica of the new master: the old one comes back as such.
    cluster.restart(master)
    assert cluster.replica_of(replica) == master
    world.enqueue(100 - len(world.ids))
    world.relay_all()
    world.consume_until(100)
    world.assert_exactly_once_in_order()


def test_failover_without_wait_is_repaired_from_the_outbox(
    engine: Engine, fresh_cluster: LocalCluster, key_prefix: str
) -> None:
    cluster = fresh_cluster
    world = World(engine, cluster, key_prefix)
    master, replica, mine = world.settle_then_pick_master()
    synced = delivered_rows(engine)

    # Delivered, marked and consumed while the replica takes nothing: lost with the master.
    cluster.cut_off(replica)
    try:
        world.enqueue(AGGREGATES)
        world.relay.run(until_idle=True)
        world.consume_until(50 + AGGREGATES)
    finally:
        cluster.kill(master)
        cluster.resume(replica)
    before_kill = delivered_rows(engine)
    lost = {p: len(before_kill[p]) - len(synced[p]) for p in mine}
    assert all(n > 0 for n in lost.values()), lost
    assert cluster.wait_failover(master, replica) == replica

    # The promoted replica has exactly what it had synced: the later entries are lost ...
    for p in mine:
        assert in_stream(cluster, key_prefix, p, replica) == synced[p], f"partition {p}"
    # ... and the outbox knows which streams are behind, and by how much.
    check = outbox_cli(engine, cluster, key_prefix, "reconcile", "--dry-run", "--json")
    assert check.returncode == 0, check.stderr
    behind = {s["key"]: (s["behind"], s["length"], s["delivered"])
              for s in json.loads(check.stdout)["streams"] if s["behind"]}
    assert behind == {stream_key(key_prefix, p): ("top_behind", len(synced[p]),
                                                  len(before_kill[p])) for p in mine}

    world.enqueue(100 - len(world.ids))
    world.relay_all()
    world.consume_until(100)
    assert world.relay.repairer.stats.repaired_entries == sum(lost.values())
    world.assert_exactly_once_in_order()

    again = outbox_cli(engine, cluster, key_prefix, "reconcile", "--dry-run", "--json")
    assert again.returncode == 0, again.stderr
    assert [s["key"] for s in json.loads(again.stdout)["streams"] if s["behind"]] == []
