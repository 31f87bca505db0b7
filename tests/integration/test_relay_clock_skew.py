"""Relay hosts whose clocks disagree by more than the lease TTL share the partitions (issue #25).

Partition leases and relay heartbeats expire by the database's clock. When each relay wrote and
compared expiries with its own host's clock, a host ahead by more than the TTL saw the other
relays' leases and heartbeats as already expired, counted itself the only live relay and took
every partition (and a host behind saw the others' heartbeats expired and kept everything), so
leases flapped between hosts. Two relays of one process stand in for two hosts: each acts while
the host clock of every relay module (its ``now_ms``) is set to that host's.
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest
import redis
from sqlalchemy import Engine

import outbox_relay.relay
from outbox_relay.relay import entry_ids
from outbox_relay.relay import leases as relay_leases
from outbox_relay.relay.daemon import Relay
from outbox_relay.shared import keys
from outbox_relay.shared.db import now_ms as true_now_ms
from outbox_relay.shared.errors import LeaseLostError
from tests.helpers import (
    PARTITIONS,
    STREAM,
    assert_all_marked,
    assert_each_once,
    enqueue_events,
    lease_owners,
    relay_settings,
    undelivered,
    wait_until,
)

pytestmark = pytest.mark.integration

TTL = 10_000
SKEW_MS = 30_000  # each way: the hosts are a minute apart, six TTLs
EVERY = set(range(PARTITIONS))


def set_host_clock(monkeypatch: pytest.MonkeyPatch, skew_ms: int) -> None:
    """The host clock as every relay module reads it (its ``now_ms``) runs ``skew_ms`` off."""
    for info in pkgutil.iter_modules(outbox_relay.relay.__path__):
        module = importlib.import_module(f"outbox_relay.relay.{info.name}")
        if hasattr(module, "now_ms"):
            monkeypatch.setattr(module, "now_ms", lambda: true_now_ms() + skew_ms)


def lease_round(relay: Relay, monkeypatch: pytest.MonkeyPatch, skew_ms: int) -> set[int]:
    """One lease round (heartbeat, renew, release, take) of ``relay`` on a host whose clock is
    ``skew_ms`` off; the partitions it holds after it."""
    set_host_clock(monkeypatch, skew_ms)
    relay._next_lease_check = 0.0  # due now
    relay._refresh_leases()
    return set(relay.leases)


def relay_all(relay: Relay, monkeypatch: pytest.MonkeyPatch, skew_ms: int) -> None:
    """Take, append and settle every partition ``relay`` holds, on its host's clock: each take
    and settle fences (and extends) the lease; a lost lease raises."""
    set_host_clock(monkeypatch, skew_ms)
    for partition, epoch in sorted(relay.leases.items()):
        while relay.relay_partition(partition, epoch):
            pass


@pytest.mark.parametrize(
    ("skew_a", "skew_b"),
    [(-SKEW_MS, SKEW_MS), (SKEW_MS, -SKEW_MS)],
    ids=["newcomer-ahead", "newcomer-behind"],
)
def test_relays_on_hosts_a_minute_apart_share_partitions_by_the_database_clock(
    engine: Engine, redis_client: redis.Redis, key_prefix: str,
    monkeypatch: pytest.MonkeyPatch, skew_a: int, skew_b: int,
) -> None:
    a = Relay(relay_settings(key_prefix, node_id="relay-a", lease_ttl_ms=TTL), engine,
              redis_client)
    b = Relay(relay_settings(key_prefix, node_id="relay-b", lease_ttl_ms=TTL), engine,
              redis_client)
    assert lease_round(a, monkeypatch, skew_a) == EVERY  # alone: every partition
    taken_by_a = dict(a.leases)

    # B heartbeats: A's leases and heartbeat are seconds old by the database's clock, so B
    # takes nothing, whatever B's own clock says.
    assert lease_round(b, monkeypatch, skew_b) == set()
    assert lease_owners(engine) == dict.fromkeys(EVERY, "relay-a")

    # A's fences (every take and settle) still hold, and its lease round renews, under the
    # same epochs, the fair share of two live relays and releases the rest.
    ids = enqueue_events(engine, 16)  # rows in every partition
    relay_all(a, monkeypatch, skew_a)
    assert undelivered(engine) == 0 and a.stats.lease_losses == 0
    kept = lease_round(a, monkeypatch, skew_a)
    assert len(kept) == PARTITIONS // 2
    assert a.leases == {p: taken_by_a[p] for p in kept}
    # B takes exactly what A released, at the next epoch.
    assert lease_round(b, monkeypatch, skew_b) == EVERY - kept
    assert b.leases == {p: taken_by_a[p] + 1 for p in EVERY - kept}
    assert lease_round(a, monkeypatch, skew_a) == kept  # no flapping back
    assert lease_round(b, monkeypatch, skew_b) == EVERY - kept

    # A's last heartbeat, with a lease of half a second, and A is gone: once that has passed
    # by the database's clock, B counts itself alone and takes A's partitions over.
    short = Relay(relay_settings(key_prefix, node_id="relay-a", lease_ttl_ms=500), engine,
                  redis_client)
    assert lease_round(short, monkeypatch, skew_a) == kept
    wait_until(lambda: lease_round(b, monkeypatch, skew_b) == EVERY, timeout=10,
               what="relay B taking relay A's partitions once A's lease ran out")
    assert all(b.leases[p] == taken_by_a[p] + 1 for p in kept)
    set_host_clock(monkeypatch, skew_a)
    for partition in kept:  # A, were it still there, is fenced out
        with pytest.raises(LeaseLostError):
            a.relay_partition(partition, taken_by_a[partition])

    ids += enqueue_events(engine, 16, first=16)
    relay_all(b, monkeypatch, skew_b)
    assert undelivered(engine) == 0 and b.stats.lease_losses == 0
    assert_each_once(redis_client, key_prefix, ids)
    assert_all_marked(engine, redis_client, key_prefix)


def test_a_relay_host_an_hour_ahead_keeps_entries_for_stream_keep_s_by_the_database_clock(
    engine: Engine, redis_client: redis.Redis, key_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The trim's keep-for cutoff and the entry ids it compares with are both the database's
    clock: a relay host whose clock runs an hour ahead (past ``stream_keep_s``) must not trim
    entries every group acknowledged a moment ago, and a host's ids carry no skew."""
    relay = Relay(relay_settings(key_prefix, stream_keep_s=1800, stream_keep=0), engine,
                  redis_client)
    set_host_clock(monkeypatch, 3_600_000)
    relay._next_lease_check = 0.0
    relay._refresh_leases()
    ids = enqueue_events(engine, 16)
    relay_all(relay, monkeypatch, 3_600_000)
    streams = {(STREAM, p) for p in EVERY}
    for _, partition in streams:
        key = keys.stream_key(key_prefix, STREAM, partition)
        redis_client.xgroup_create(key, "g", id="0")
        entries = redis_client.xreadgroup("g", "c", {key: ">"})[0][1]
        redis_client.xack(key, "g", *[i for i, _ in entries])
        # the ids' milliseconds are the database's clock, not an hour ahead
        assert all(entry_ids.parse(i.decode())[0] < true_now_ms() + 60_000 for i, _ in entries)
    assert relay.trimmer.run(relay.leases, streams) == 0
    assert_each_once(redis_client, key_prefix, ids)


def test_status_and_progress_read_waits_and_lease_expiry_by_the_database_clock(
    engine: Engine, redis_client: redis.Redis, key_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``outbox status``'s lease expiry and the progress line's "oldest waiting" compare the
    database's times (``expires_at_ms``, ``available_at_ms``) with the database's clock: on a
    host an hour ahead, the leases are still held with at most a TTL left, and the rows have
    waited seconds, not an hour."""
    relay = Relay(relay_settings(key_prefix, node_id="relay-a", lease_ttl_ms=TTL), engine,
                  redis_client)
    assert lease_round(relay, monkeypatch, 3_600_000) == EVERY
    enqueue_events(engine, 8)
    shown = relay_leases.holders(engine)
    assert {r["partition"] for r in shown} == EVERY
    assert all(r["owner"] == "relay-a" and 0 < r["expires_in_ms"] <= TTL for r in shown)
    line = relay.log_progress()
    waited = line.rpartition("oldest waiting ")[2]
    assert waited.endswith(" s"), line  # seconds: neither "60.0 min" nor "1.0 h"
