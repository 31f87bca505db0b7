"""A Redis Sentinel set (1 master, 1 replica, 3 sentinels, started here on free ports): the relay
and a consumer connect through ``redis+sentinel://``, the master fails over mid-run, and every
event still reaches its stream once and is applied once.

With ``OUTBOX_WAIT_REPLICAS=1`` the relay marks a batch delivered only once a replica has it,
so the promoted replica holds every entry the outbox calls delivered: checked right after the
failover, before any repair could refill anything.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
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
    free_port,
    outbox_rows,
    record_effect,
    relay_settings,
    wait_until,
)

pytestmark = pytest.mark.integration

SERVICE = "outboxmaster"


@dataclass
class SentinelSet:
    master_port: int
    replica_port: int
    sentinel_ports: list[int]
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def sentinel(self, i: int = 0) -> redis.Redis:
        return redis.Redis(port=self.sentinel_ports[i], socket_timeout=2)

    def master_port_now(self) -> int:
        _host, port = self.sentinel().execute_command(
            "SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
        return int(port)


def _start(cmd: list[str], sset: SentinelSet) -> None:
    sset.procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL))


def _answers(port: int) -> bool:
    try:
        return bool(redis.Redis(port=port, socket_timeout=1).ping())
    except redis.RedisError:
        return False


@pytest.fixture
def sentinel_set(tmp_path: Path) -> Iterator[SentinelSet]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("no redis-server binary")
    sset = SentinelSet(free_port(), free_port(), [free_port() for _ in range(3)])
    try:
        for name, port, extra in (("master", sset.master_port, []),
                                  ("replica", sset.replica_port,
                                   ["--replicaof", "127.0.0.1", str(sset.master_port)])):
            (tmp_path / name).mkdir()
            _start([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                    "--appendonly", "no", "--dir", str(tmp_path / name), *extra], sset)
        for i, port in enumerate(sset.sentinel_ports):
            folder = tmp_path / f"sentinel{i}"
            folder.mkdir()
            (folder / "sentinel.conf").write_text("\n".join([
                f"port {port}", "bind 127.0.0.1", f"dir {folder}",
                f"sentinel monitor {SERVICE} 127.0.0.1 {sset.master_port} 2",
                f"sentinel down-after-milliseconds {SERVICE} 2000",
                f"sentinel failover-timeout {SERVICE} 5000",
            ]) + "\n")
            _start([binary, str(folder / "sentinel.conf"), "--sentinel"], sset)
        for port in (sset.master_port, sset.replica_port, *sset.sentinel_ports):
            wait_until(lambda p=port: _answers(p), timeout=15, what=f"redis on {port}")

        def replica_known() -> bool:
            info = redis.Redis(port=sset.replica_port).info("replication")
            return (info.get("master_link_status") == "up"
                    and all(len(sset.sentinel(i).execute_command("SENTINEL", "REPLICAS",
                                                                 SERVICE)) == 1
                            for i in range(3)))

        wait_until(replica_known, timeout=40, what="the sentinels to know the replica")
        yield sset
    finally:
        for proc in sset.procs:
            proc.terminate()
        for proc in sset.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _stream_lengths(port: int, prefix: str) -> int:
    client = redis.Redis(port=port)
    return sum(int(client.xlen(keys.stream_key(prefix, STREAM, p))) for p in range(PARTITIONS))


def test_a_sentinel_failover_loses_nothing_and_applies_nothing_twice(
    engine: Engine, sentinel_set: SentinelSet, key_prefix: str,
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

    sentinel_set.sentinel().execute_command("SENTINEL", "FAILOVER", SERVICE)
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
