"""Fenced repair that keeps consumer groups, against the real Redis and both databases.

A partial loss is simulated on our own keys: the stream is re-created with a prefix of its
entries (a failover to a lagging replica), then newer entries arrive above it, so the lost
middle can only come back through a rebuild.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis
from sqlalchemy import Engine, update

from outbox_relay.relay import entry_ids, repair, repair_store, repair_streams
from outbox_relay.relay.daemon import Relay
from outbox_relay.relay.leases import take_free_lease
from outbox_relay.shared import keys
from outbox_relay.shared.errors import LeaseLostError
from outbox_relay.shared.schema import relay_leases
from tests.helpers import (
    delivered_entries,
    repair_enqueue,
    repair_settings,
    stream_contents,
)

pytestmark = pytest.mark.integration


def _take_lease(engine: Engine, partition: int) -> int:
    epoch = take_free_lease(engine, partition, "rebuild-test", 30_000)
    assert epoch is not None
    return epoch


def _lose_the_middle(
    engine: Engine, client: redis.Redis, prefix: str, kept: int
) -> tuple[int, str, list[Any]]:
    """Relay 30 events, keep the first ``kept`` entries of the fullest partition, append one
    newer entry above the old top (a relay after the failover): ``(partition, key, entries)``."""
    repair_enqueue(engine, prefix, 0, 30)
    Relay(repair_settings(engine, prefix), engine, client).run(until_idle=True)
    p = max((0, 1), key=lambda q: len(delivered_entries(engine, q)))
    key = keys.stream_key(prefix, "things", p)
    entries = client.xrange(key)
    client.delete(key)
    for entry_id, fields in entries[:kept]:
        client.xadd(key, fields, id=entry_id)
    top_ms = entry_ids.parse(entries[-1][0].decode())[0]
    client.xadd(key, {"id": "not-marked-yet"}, id=f"{top_ms + 1000}-1")
    return p, key, entries


def _groups(client: redis.Redis, key: str) -> dict[bytes, tuple[Any, ...]]:
    """Per group: last-delivered id, entries-read, and its pending list."""
    out = {}
    for g in client.xinfo_groups(key):
        pending = client.xpending_range(key, g["name"], "-", "+", 1000)
        out[g["name"]] = (
            g["last-delivered-id"], g["entries-read"],
            [(e["message_id"], e["consumer"], e["times_delivered"]) for e in pending],
        )
    return out


def _repair(engine: Engine, client: redis.Redis, prefix: str, p: int, **kw: Any) -> tuple[str, int]:
    delivered = repair_store.delivered_counts(engine, [p])[("things", p)]
    finding = repair.compare(engine, client, prefix, "things", p, delivered)
    assert finding.reason is not None
    return repair.repair(engine, client, finding, epoch=_take_lease(engine, p), **kw)


def test_rebuild_keeps_groups_pending_entries_and_consumers(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    r = redis_client
    p, key, entries = _lose_the_middle(engine, r, key_prefix, kept=6)
    r.xgroup_create(key, "early", id="0")  # reads within the kept prefix only
    r.xreadgroup("early", "c1", {key: ">"}, count=3)
    r.xreadgroup("early", "c1", {key: "0"})  # c1 got its 3 twice: delivery count 2
    r.xreadgroup("early", "c2", {key: ">"}, count=1)
    r.xack(key, "early", entries[0][0])
    r.xgroup_createconsumer(key, "early", "idle")
    r.xgroup_create(key, "late", id="0")  # has read past the lost middle
    r.xreadgroup("late", "c3", {key: ">"})
    r.xack(key, "late", *[e for e, _ in entries[:6]])
    before = _groups(r, key)

    how, restored = _repair(engine, r, key_prefix, p)

    assert (how, restored) == ("rebuild", len(entries) - 6)
    after = _groups(r, key)
    assert after[b"early"] == before[b"early"]  # id, entries-read and pending list as they were
    assert after[b"early"][0] == entries[3][0]
    assert {c["name"] for c in r.xinfo_consumers(key, "early")} == {b"c1", b"c2", b"idle"}
    back = r.xreadgroup("early", "c1", {key: "0"})[0][1]
    assert [e for e, _ in back] == [e for e, _ in entries[1:3]]
    # "late" had read past the restored entries: rewound to just before the first of them,
    # its pending entry (the newer one) kept; it is given the restored entries next.
    assert after[b"late"][0] == entries[5][0]
    assert after[b"late"][2] == before[b"late"][2]
    given = r.xreadgroup("late", "c3", {key: ">"}, count=len(entries))[0][1]
    assert [e for e, _ in given][: len(entries) - 6] == [e for e, _ in entries[6:]]


def test_rebuild_never_removes_an_entry_it_did_not_put_there(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    p, key, entries = _lose_the_middle(engine, redis_client, key_prefix, kept=4)
    foreign = redis_client.xrange(key)[-1]

    assert _repair(engine, redis_client, key_prefix, p) == ("rebuild", len(entries) - 4)

    after = redis_client.xrange(key)
    assert after == [*entries, foreign]
    info = redis_client.xinfo_stream(key)
    assert info["last-generated-id"] == foreign[0]
    assert info["entries-added"] >= len(entries) + 1
    assert redis_client.ttl(key) == -1  # the temporary key's expiry did not come along
    assert not redis_client.exists(repair_streams.rebuild_key(key))


def test_rebuild_fenced_out_before_the_swap_changes_nothing(
    engine: Engine, redis_client: redis.Redis, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    r = redis_client
    p, key, _ = _lose_the_middle(engine, r, key_prefix, kept=6)
    r.xgroup_create(key, "g", id="0")
    r.xreadgroup("g", "c1", {key: ">"}, count=4)
    before_entries, before_groups = r.xrange(key), _groups(r, key)
    before_info = r.xinfo_stream(key)
    fence_key = keys.fence_key(key_prefix, "things", p)
    real_swap = repair_streams.swap

    def taken_over(client: redis.Redis, *args: Any, **kw: Any) -> Any:
        client.set(fence_key, _take_lease_after_expiry(engine, p))  # the new owner appended
        return real_swap(client, *args, **kw)

    monkeypatch.setattr(repair_streams, "swap", taken_over)
    with pytest.raises(LeaseLostError):
        _repair(engine, r, key_prefix, p)

    assert r.xrange(key) == before_entries
    assert _groups(r, key) == before_groups
    assert r.xinfo_stream(key)["entries-added"] == before_info["entries-added"]
    assert 0 < r.pttl(repair_streams.rebuild_key(key)) <= 3_600_000  # expires on its own


def _take_lease_after_expiry(engine: Engine, partition: int) -> int:
    """Another node takes the partition once our lease lapsed (its epoch is higher). The lapse
    is written on the lease row: leases expire by the database's clock, not a caller's."""
    with engine.begin() as conn:
        conn.execute(update(relay_leases).where(relay_leases.c.partition == partition)
                     .values(expires_at_ms=0))
    epoch = take_free_lease(engine, partition, "other-node", 30_000)
    assert epoch is not None
    return epoch


def test_fenced_out_refill_writes_nothing(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    repair_enqueue(engine, key_prefix, 0, 10)
    Relay(repair_settings(engine, key_prefix), engine, redis_client).run(until_idle=True)
    p = max((0, 1), key=lambda q: len(delivered_entries(engine, q)))
    key = keys.stream_key(key_prefix, "things", p)
    redis_client.delete(key)
    epoch = _take_lease(engine, p)
    redis_client.set(keys.fence_key(key_prefix, "things", p), epoch + 1)
    finding = repair.compare(engine, redis_client, key_prefix, "things", p,
                             len(delivered_entries(engine, p)))

    with pytest.raises(LeaseLostError):
        repair.repair(engine, redis_client, finding, epoch=epoch)
    assert not redis_client.exists(key)

    fixer = repair.Repairer(repair_settings(engine, key_prefix), engine, redis_client,
                            "rebuild-test")
    assert fixer.run({p: epoch}) == 0
    assert fixer.stats.fenced == 1


@pytest.mark.parametrize("how", ["refill", "rebuild"])
def test_large_history_goes_back_in_order_in_chunks(
    engine: Engine, redis_client: redis.Redis, key_prefix: str,
    monkeypatch: pytest.MonkeyPatch, how: str,
) -> None:
    settings = repair_settings(engine, key_prefix).model_copy(update={"partitions": 1})
    from outbox_relay.producer import Producer

    producer = Producer(source="rebuild-test", partitions=1, key_prefix=key_prefix)
    with engine.begin() as conn:
        for n in range(5000):
            producer.enqueue(conn, type="thing.done", stream="things", data={"n": n},
                             event_id=f"evt-{n:05d}")
    Relay(settings, engine, redis_client).run(until_idle=True)
    key = keys.stream_key(key_prefix, "things", 0)
    expected = delivered_entries(engine, 0)
    assert len(expected) == 5000
    redis_client.delete(key)
    if how == "rebuild":  # a newer entry arrived after the loss: the rest goes in below it
        top_ms = entry_ids.parse(expected[-1][0])[0]
        redis_client.xadd(key, {"id": "newer"}, id=f"{top_ms + 1}-1")
    calls: list[int] = []
    for name in ("refill", "add_to_rebuild"):
        real = getattr(repair_streams, name)

        def counted(*args: Any, _real: Any = real, **kw: Any) -> Any:
            calls.append(len(args[4]))
            return _real(*args, **kw)

        monkeypatch.setattr(repair_streams, name, counted)

    assert _repair(engine, redis_client, key_prefix, 0, chunk=500) == (how, 5000)

    stream = stream_contents(redis_client, key_prefix, 0)
    assert stream[:5000] == expected  # in id order, each event once
    assert len({event_id for _, event_id in stream}) == len(stream)
    assert calls == [500] * 10 + ([1] if how == "rebuild" else [])
