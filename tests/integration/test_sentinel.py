"""A Redis Sentinel set (1 master, 1 replica, 3 sentinels, started here on free ports): the relay
and a consumer connect through ``redis+sentinel://``, the master fails over mid-run, and every
event still reaches its stream once and is applied once.

With ``OUTBOX_WAIT_REPLICAS=1`` the relay marks a batch delivered only once a replica has it,
so the promoted replica holds every entry the outbox calls delivered: checked right after the
failover, before any repair could refill anything.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from sqlalchemy import Connection, Engine

from outbox_relay.consumer import Handlers
from outbox_relay.consumer.daemon import Consumer
from outbox_relay.relay.daemon import Relay
from outbox_relay.shared import keys
from outbox_relay.shared.envelope import Event
from outbox_relay.shared.errors import ConfigError, UnavailableError
from outbox_relay.shared.redis_conn import connect_redis
from tests.helpers import (
    PARTITIONS,
    STREAM,
    consumer_settings,
    create_effects,
    effect_counts,
    enqueue_events,
    outbox_rows,
    record_effect,
    relay_settings,
    wait_until,
)
from torture.redis_sets import LocalSentinelSet, TopologyUnsupported

pytestmark = [pytest.mark.integration, pytest.mark.torture]  # starts a Sentinel set

@pytest.fixture
def sentinel_set(tmp_path: Path) -> Iterator[LocalSentinelSet]:
    try:
        sset = LocalSentinelSet(tmp_path).start()
    except TopologyUnsupported as err:
        pytest.skip(str(err))
    try:
        yield sset
    finally:
        sset.stop()


def _stream_lengths(port: int, prefix: str) -> int:
    client = redis.Redis(port=port)
    return sum(int(client.xlen(keys.stream_key(prefix, STREAM, p))) for p in range(PARTITIONS))


def test_a_sentinel_failover_loses_nothing_and_applies_nothing_twice(
    engine: Engine, sentinel_set: LocalSentinelSet, key_prefix: str,
) -> None:
    url = sentinel_set.url
    create_effects(engine)
    handlers = Handlers()

    @handlers.on("thing.happened")
    def apply(conn: Connection, event: Event) -> None:
        record_effect(conn, event)

    relay = Relay(relay_settings(key_prefix, redis_url=url, wait_replicas=1,
                                 wait_timeout_ms=500), engine, connect_redis(url, timeout_s=2))
    consumer = Consumer(consumer_settings(key_prefix, redis_url=url, redis_timeout_s=2),
                        engine, connect_redis(url, timeout_s=2), handlers)

    def consume_until(count: int) -> None:
        def step() -> bool:
            # The old master's connections fail once; the next call reconnects.
            with contextlib.suppress(UnavailableError):
                consumer.run_once(block_ms=20)
            return sum(effect_counts(engine).values()) >= count
        wait_until(step, timeout=60, what=f"{count} effects")

    ids = enqueue_events(engine, 20)
    relay.run(until_idle=True)
    consume_until(20)
    assert _stream_lengths(sentinel_set.master_port, key_prefix) == 20

    sentinel_set.sentinel().execute_command(  # type: ignore[no-untyped-call]
        "SENTINEL", "FAILOVER", sentinel_set.service)
    wait_until(lambda: sentinel_set.master_port_now() == sentinel_set.replica_port,
               timeout=30, what="the replica promoted")
    # WAIT 1 before marking: the promoted replica has every entry the outbox calls delivered.
    assert _stream_lengths(sentinel_set.replica_port, key_prefix) == 20

    ids += enqueue_events(engine, 20, first=20)
    relay.run(until_idle=True)  # reconnects to the new master (unavailable errors are retried)
    consume_until(40)
    assert all(r.delivered_at_ms is not None for r in outbox_rows(engine))
    assert _stream_lengths(sentinel_set.replica_port, key_prefix) == 40
    assert effect_counts(engine) == dict.fromkeys(ids, 1)


@pytest.mark.parametrize("url", [
    "redis+sentinel://127.0.0.1:26379/",            # no service name
    "redis+sentinel://127.0.0.1:port/outbox",       # a port that is not a number
    "redis+sentinel://127.0.0.1/outbox/zero",       # a db that is not a number
    "redis+sentinel://:26379/outbox",               # no host
])
def test_a_bad_sentinel_url_is_invalid_config_without_its_password(url: str) -> None:
    with pytest.raises(ConfigError) as info:
        connect_redis(url.replace("://", "://u:hunter2@"))
    assert "hunter2" not in info.value.message and "service" in info.value.message


def test_sentinel_url_parameters_and_hosts() -> None:
    """A misspelt parameter is refused by name, never ignored; IPv6 hosts and default ports."""
    with pytest.raises(ConfigError) as info:
        connect_redis("redis+sentinel://u:hunter2@h/outbox?sentinel_pasword=s")
    assert "sentinel_pasword" in info.value.message and "hunter2" not in info.value.message
    client = connect_redis("redis+sentinel://[::1]:26380,[::1],h/outbox/3?sentinel_password=s")
    pool = client.connection_pool
    assert [(s.connection_pool.connection_kwargs["host"], s.connection_pool.connection_kwargs[
        "port"]) for s in pool.sentinel_manager.sentinels] == [  # type: ignore[attr-defined]
        ("::1", 26380), ("::1", 26379), ("h", 26379)]
    assert pool.connection_kwargs["db"] == 3
