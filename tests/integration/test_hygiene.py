"""Group hygiene (consumer/hygiene.py) against the real Redis, and both databases where the
database matters (consumer ownership: which keys are looked after; heartbeat rows).

Redis reports a consumer's idle time from its own clock and nothing can set it, so the tests use
small limits and poll until a consumer has been idle long enough (never a fixed sleep).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import Engine, insert, select

from outbox_relay.consumer import Handlers, dead_letters, hygiene, ownership, streams
from outbox_relay.consumer.daemon import Consumer
from outbox_relay.shared import keys
from outbox_relay.shared.db import now_ms
from outbox_relay.shared.errors import UnavailableError
from outbox_relay.shared.periodic import Periodic
from outbox_relay.shared.redis_conn import connect_redis
from outbox_relay.shared.schema import consumer_nodes
from outbox_relay.shared.settings import ConsumerSettings
from tests.helpers import (
    GROUP,
    PARTITIONS,
    STREAM,
    consumer_settings,
    private_redis,
    wait_until,
)

pytestmark = pytest.mark.integration

ME = "c1"


def tidy(
    engine: Engine, client: redis.Redis, prefix: str, *, leases: ownership.Leases | None = None,
    **overrides: Any,
) -> hygiene.GroupHygiene:
    """The hygiene of consumer ``c1`` of ``g1``; without ``leases`` it looks after every key."""
    settings = consumer_settings(prefix, consumer=ME, **overrides)
    if leases is None:
        ids = {keys.stream_key(prefix, STREAM, p): (STREAM, p) for p in range(PARTITIONS)}
        leases = ownership.Leases(engine, GROUP, ME, ids, settings.lease_ttl_ms, enabled=False)
    return hygiene.GroupHygiene(settings, engine, client, leases)


def key0(prefix: str) -> str:
    return keys.stream_key(prefix, STREAM, 0)


def group_with(client: redis.Redis, prefix: str, *names: str) -> str:
    """Partition 0's stream with group ``g1`` and the given consumers, nothing pending; its key.
    Partitions 1-3 have no stream at all (hygiene must take that in its stride)."""
    key = key0(prefix)
    streams.ensure_groups(client, [key], GROUP)
    for name in names:
        client.xgroup_createconsumer(key, GROUP, name)
    return key


def consumers(client: redis.Redis, key: str) -> dict[str, dict[str, Any]]:
    """``XINFO CONSUMERS``: ``{name: {"pending": n, "idle": ms}}``."""
    return {c["name"].decode(): {"pending": int(c["pending"]), "idle": int(c["idle"])}
            for c in client.xinfo_consumers(key, GROUP)}


def idle_over(client: redis.Redis, key: str, name: str, ms: float) -> bool:
    return consumers(client, key)[name]["idle"] > ms


def removed(h: hygiene.GroupHygiene, client: redis.Redis, key: str, name: str) -> bool:
    """One hygiene pass; whether ``name`` has left the group (for ``wait_until``)."""
    h.run()
    return name not in consumers(client, key)


def test_an_idle_consumer_with_nothing_pending_is_removed(
    sqlite_engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    key = group_with(redis_client, key_prefix, "gone")
    h = tidy(sqlite_engine, redis_client, key_prefix, consumer_idle_s=0.2)
    h.run()
    assert "gone" in consumers(redis_client, key)  # idle for less than 0.2 s so far
    wait_until(lambda: removed(h, redis_client, key, "gone"), what="'gone' to be removed")
    assert h.stats.consumers_removed == 1


def test_a_consumer_with_pending_entries_is_kept_whatever_its_idle(
    sqlite_engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    key = group_with(redis_client, key_prefix)
    entry = redis_client.xadd(key, {"a": "1"})
    redis_client.xreadgroup(GROUP, "busy", {key: ">"})  # pending for "busy" from now on
    redis_client.xgroup_createconsumer(key, GROUP, "gone")  # created after "busy"
    h = tidy(sqlite_engine, redis_client, key_prefix, consumer_idle_s=0.2)
    wait_until(lambda: removed(h, redis_client, key, "gone"), what="'gone' to be removed")
    busy = consumers(redis_client, key)["busy"]
    assert busy["pending"] == 1 and busy["idle"] > 200  # idle long enough, but kept
    assert [r["message_id"] for r in redis_client.xpending_range(key, GROUP, "-", "+", 10)] \
        == [entry]  # and its pending list intact
    assert h.stats.consumers_removed == 1


def test_the_caller_itself_is_never_removed(
    sqlite_engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    key = group_with(redis_client, key_prefix, ME, "gone")
    h = tidy(sqlite_engine, redis_client, key_prefix, consumer_idle_s=0.2)
    wait_until(lambda: removed(h, redis_client, key, "gone"), what="'gone' to be removed")
    me = consumers(redis_client, key)[ME]
    assert me["pending"] == 0 and me["idle"] > 200


def test_a_consumer_idle_for_less_than_the_limit_is_kept(
    sqlite_engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    key = group_with(redis_client, key_prefix, "old")
    wait_until(lambda: idle_over(redis_client, key, "old", 1_000), what="'old' idle > 1 s")
    redis_client.xgroup_createconsumer(key, GROUP, "fresh")
    h = tidy(sqlite_engine, redis_client, key_prefix, consumer_idle_s=1.0)
    h.run()
    assert set(consumers(redis_client, key)) == {"fresh"}


def test_consumer_removal_is_off_at_zero(
    sqlite_engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    key = group_with(redis_client, key_prefix, "old")
    wait_until(lambda: idle_over(redis_client, key, "old", 50), what="'old' idle > 50 ms")
    h = tidy(sqlite_engine, redis_client, key_prefix, consumer_idle_s=0)
    h.run()
    assert set(consumers(redis_client, key)) == {"old"}


def letter(client: redis.Redis, prefix: str, partition: int, at_ms: int | None = None) -> str:
    """A dead letter written as the consumer writes them (now), or with an id at ``at_ms``."""
    entry = streams.Entry(keys.stream_key(prefix, STREAM, partition), "1-1", {b"id": b"x"})
    if at_ms is None:
        streams.dead_letter(client, prefix, [(entry, "unknown_type", "m")], GROUP, "c0")
        return str(client.xrevrange(keys.dead_letter_key(prefix, STREAM, partition),
                                    count=1)[0][0].decode())
    fields: Any = {b"id": b"x", b"dlq.reason": b"unknown_type", b"dlq.group": GROUP.encode()}
    dead_id = client.xadd(keys.dead_letter_key(prefix, STREAM, partition), fields,
                          id=f"{at_ms}-0")
    return str(dead_id.decode())


def dead_ids(client: redis.Redis, prefix: str, partition: int) -> list[str]:
    key = keys.dead_letter_key(prefix, STREAM, partition)
    return [i.decode() for i, _f in client.xrange(key)]


def test_dead_letters_older_than_the_retention_are_trimmed_newer_kept(
    sqlite_engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    now = int(time.time() * 1000)
    old = [letter(redis_client, key_prefix, 0, now - 20_000),
           letter(redis_client, key_prefix, 0, now - 11_000)]
    kept = [letter(redis_client, key_prefix, 0, now - 9_000), letter(redis_client, key_prefix, 0)]
    letter(redis_client, key_prefix, 1, now - 60_000)
    h = tidy(sqlite_engine, redis_client, key_prefix, retention_dead_letters=10.0,
             consumer_idle_s=0)
    h.run()
    assert dead_ids(redis_client, key_prefix, 0) == kept
    assert dead_ids(redis_client, key_prefix, 1) == []
    assert h.stats.dead_letters_trimmed == len(old) + 1
    # ``outbox dlq`` reads what is left
    listed = dead_letters.list_letters(redis_client, key_prefix)
    assert [x.dead_id for x in listed] == kept
    assert dead_letters.show(redis_client, key_prefix, listed[-1].letter_id) == listed[-1]
    h.run()  # nothing more to trim
    assert dead_ids(redis_client, key_prefix, 0) == kept and h.stats.dead_letters_trimmed == 3


def test_dead_letter_retention_is_off_at_zero(
    sqlite_engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    ancient = letter(redis_client, key_prefix, 0, 1_000)
    h = tidy(sqlite_engine, redis_client, key_prefix, retention_dead_letters=0)
    h.run()
    assert dead_ids(redis_client, key_prefix, 0) == [ancient]


def test_only_the_keys_this_consumer_owns_are_looked_after(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    ids = {keys.stream_key(key_prefix, STREAM, p): (STREAM, p) for p in range(PARTITIONS)}
    ownership.acquire(engine, GROUP, "other", [(STREAM, 0), (STREAM, 1)], 60_000)
    leases = ownership.Leases(engine, GROUP, ME, ids, 60_000)
    leases.renew()  # two consumers alive: "other" holds 0 and 1, we take 2 and 3
    assert sorted(ids[k][1] for k in leases.held) == [2, 3]
    for p in range(PARTITIONS):
        key = keys.stream_key(key_prefix, STREAM, p)
        streams.ensure_groups(redis_client, [key], GROUP)
        redis_client.xgroup_createconsumer(key, GROUP, "gone")
        letter(redis_client, key_prefix, p, 1_000)
    h = tidy(engine, redis_client, key_prefix, leases=leases, consumer_idle_s=0.2,
             retention_dead_letters=1.0)

    def mine_tidied() -> bool:
        h.run()
        return h.stats.consumers_removed == 2

    wait_until(mine_tidied, what="'gone' removed from our two keys")
    for p in range(PARTITIONS):
        key = keys.stream_key(key_prefix, STREAM, p)
        ours = p in (2, 3)
        assert ("gone" in consumers(redis_client, key)) is not ours, p
        assert (dead_ids(redis_client, key_prefix, p) == []) is ours, p
    assert h.stats.dead_letters_trimmed == 2


def node_rows(engine: Engine) -> set[tuple[str, str]]:
    with engine.connect() as conn:
        return {(r.group_name, r.consumer) for r in conn.execute(select(consumer_nodes))}


def test_heartbeat_rows_expired_longer_than_the_limit_are_deleted(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    now, hour = now_ms(), 3_600_000
    rows = {("gone-group", "host:1"): now - 48 * hour,  # a group nobody runs any more
            (GROUP, "host:2"): now - 25 * hour,
            (GROUP, "host:3"): now - 23 * hour,  # expired, but not long enough ago
            (GROUP, "live"): now + hour}
    with engine.begin() as conn:
        conn.execute(insert(consumer_nodes), [
            {"group_name": g, "consumer": c, "expires_at_ms": e} for (g, c), e in rows.items()])
    h = tidy(engine, redis_client, key_prefix, consumer_idle_s=24 * 3600.0)
    h.run()
    assert node_rows(engine) == {(GROUP, "host:3"), (GROUP, "live")}
    assert h.stats.node_rows_removed == 2
    assert ownership.forget_nodes(engine, 0) == 1  # host:3 has expired; "live" has not
    assert node_rows(engine) == {(GROUP, "live")}


def test_forget_nodes_deletes_in_bounded_batches(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(insert(consumer_nodes), [
            {"group_name": GROUP, "consumer": f"host:{i}", "expires_at_ms": 1} for i in range(5)])
    assert [ownership.forget_nodes(engine, 0, limit=2) for _ in range(4)] == [2, 2, 1, 0]


def test_install_registers_the_periodic_task_and_its_counters(
    sqlite_engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    def consumer(**overrides: Any) -> Consumer:
        settings: ConsumerSettings = consumer_settings(key_prefix, **overrides)
        return Consumer(settings, sqlite_engine, redis_client, Handlers(), ownership=True)

    default = consumer()
    h = hygiene.install(default)
    assert h is not None and default.hygiene_stats is h.stats
    (task,) = [t for t in default.periodic if t.name == "group hygiene"]
    assert task.interval_s == 60.0
    short = consumer(consumer_idle_s=0.2)
    assert hygiene.install(short) is not None and short.periodic[-1].interval_s == 0.05
    off = consumer(consumer_idle_s=0, retention_dead_letters=0)
    assert hygiene.install(off) is None
    assert [t.name for t in off.periodic] == ["partition count check", "progress"]
    assert off.hygiene_stats is None


def test_the_consumer_loop_runs_hygiene(
    sqlite_engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    settings = consumer_settings(key_prefix, consumer_idle_s=0.2, partitions=1)
    c = Consumer(settings, sqlite_engine, redis_client, Handlers(), ownership=True)
    hygiene.install(c)
    key = group_with(redis_client, key_prefix, "gone")
    wait_until(lambda: c.run_once(block_ms=1) >= 0 and "gone" not in consumers(redis_client, key),
               what="the loop to remove 'gone'")
    assert c.hygiene_stats is not None and c.hygiene_stats.consumers_removed == 1
    assert ME in consumers(redis_client, key)


def test_an_acl_refusal_inside_the_script_is_reported_and_retried(
    sqlite_engine: Engine, key_prefix: str, tmp_path: Path
) -> None:
    with private_redis(tmp_path / "redis") as url:
        admin = redis.Redis.from_url(url)
        admin.execute_command("ACL", "SETUSER", "nodel", "on", ">pw", "~*", "-@all", "+evalsha",
                              "+script|load", "+xinfo|consumers", "+xtrim", "+ping")
        key = group_with(admin, key_prefix, "gone")
        wait_until(lambda: idle_over(admin, key, "gone", 50), what="'gone' idle > 50 ms")
        client = connect_redis(url.replace("redis://", "redis://nodel:pw@"))
        h = tidy(sqlite_engine, client, key_prefix, consumer_idle_s=0.01)
        with pytest.raises(UnavailableError, match="ACL"):
            h.run()
        task = Periodic("group hygiene", 60, h.run)
        assert task.maybe_run() and task.failures == 1  # logged, retried at the next interval
        assert "gone" in consumers(admin, key)
        client.close()
        admin.close()
