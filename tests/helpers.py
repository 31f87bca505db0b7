"""Small helpers for the integration and acceptance tests.

Settings factories with short timings, a polling wait (never a bare sleep standing in for a
condition), stream readers, a test table handlers write their effects to, and a private
``redis-server`` for tests that must stall or break their own Redis.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import redis
from sqlalchemy import Column, Connection, Engine, Integer, MetaData, String, Table, select

from outbox_relay.producer import Producer
from outbox_relay.relay.outgoing import OutboxRow
from outbox_relay.shared import keys
from outbox_relay.shared.envelope import Event
from outbox_relay.shared.schema import outbox
from outbox_relay.shared.settings import ConsumerSettings, RelaySettings
from tests.conftest import REDIS_URL

PARTITIONS = 4
STREAM = "runs"
GROUP = "g1"

effects_metadata = MetaData()
effects = Table(
    "test_effects",
    effects_metadata,
    Column("n", Integer, primary_key=True, autoincrement=True),
    Column("event_id", String(512), nullable=False),
    Column("note", String(64)),
)


def wait_until(
    predicate: Callable[[], object], *, timeout: float = 20.0, what: str = "condition"
) -> None:
    """Poll ``predicate`` until it is truthy; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


def relay_settings(key_prefix: str, **overrides: Any) -> RelaySettings:
    """Relay settings for tests: our Redis, our prefix, short polls."""
    values: dict[str, Any] = {
        "redis_url": REDIS_URL,
        "key_prefix": key_prefix,
        "partitions": PARTITIONS,
        "poll_min_ms": 1,
        "poll_max_ms": 20,
        "node_id": "relay-a",
    }
    values.update(overrides)
    return RelaySettings(**values)


def consumer_settings(key_prefix: str, **overrides: Any) -> ConsumerSettings:
    """Consumer settings for tests: short blocks and idle times, few deliveries."""
    values: dict[str, Any] = {
        "redis_url": REDIS_URL,
        "key_prefix": key_prefix,
        "partitions": PARTITIONS,
        "group": GROUP,
        "consumer": "c1",
        "streams": STREAM,
        "block_ms": 10,
        "claim_idle_ms": 100,
        "claim_interval_ms": 100,
        "max_deliveries": 3,
        "retry_first_delay_s": 0,  # a failed entry is due again at the next pending pass
        "retry_max_delay_s": 0,
        "redis_timeout_s": 5.0,
    }
    values.update(overrides)
    return ConsumerSettings(**values)


def event(
    aggregate_id: str,
    revision: int,
    *,
    type: str = "thing.happened",
    data: Any = None,
    **extra: Any,
) -> Event:
    """A valid event of one aggregate, with the producer's deterministic id."""
    return Event(
        id=f"{aggregate_id}:{type}:{revision}",
        source="tests",
        type=type,
        time=datetime.now(UTC),
        subject=aggregate_id,
        data=data,
        aggregatetype="thing",
        aggregateid=aggregate_id,
        revision=revision,
        **extra,
    )


def partition_of(aggregate_id: str) -> int:
    """The partition the producer maps an aggregate to."""
    return keys.partition_for(aggregate_id, PARTITIONS)


def key_of(prefix: str, aggregate_id: str) -> str:
    """The stream key of an aggregate's partition."""
    return keys.stream_key(prefix, STREAM, partition_of(aggregate_id))


def xadd_event(client: redis.Redis, prefix: str, ev: Event) -> str:
    """Append an event by hand (as a relay would, but with a Redis-chosen id)."""
    key = keys.stream_key(prefix, STREAM, partition_of(ev.aggregateid or ev.id))
    entry_id = client.xadd(key, ev.to_fields())  # type: ignore[arg-type]
    return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)


def stream_entries(
    client: redis.Redis, prefix: str, *, stream: str = STREAM
) -> list[tuple[int, str, dict[str, str]]]:
    """Every entry of every partition: ``(partition, entry id, decoded fields)``."""
    out = []
    for p in range(PARTITIONS):
        for entry_id, fields in client.xrange(keys.stream_key(prefix, stream, p)):
            decoded = {k.decode(): v.decode() for k, v in fields.items()}
            out.append((p, entry_id.decode(), decoded))
    return out


def dead_letters(client: redis.Redis, prefix: str, partition: int) -> list[dict[bytes, bytes]]:
    """The raw fields of every entry of a partition's dead-letter stream."""
    key = keys.dead_letter_key(prefix, STREAM, partition)
    return [fields for _id, fields in client.xrange(key)]


def pending_total(client: redis.Redis, prefix: str, group: str = GROUP) -> int:
    """Entries delivered to ``group`` but not acknowledged, over all partitions."""
    total = 0
    for p in range(PARTITIONS):
        key = keys.stream_key(prefix, STREAM, p)
        if client.exists(key) and any(
            g["name"] == group.encode() for g in client.xinfo_groups(key)
        ):
            total += int(client.xpending(key, group)["pending"])
    return total


def create_effects(engine: Engine) -> None:
    """Create the table test handlers write to (outside the reference schema)."""
    effects_metadata.create_all(engine)


def record_effect(conn: Connection, ev: Event, note: str = "applied") -> None:
    """What a test handler does: one row per call, in the claim transaction."""
    conn.execute(effects.insert().values(event_id=ev.id, note=note))


def effect_counts(engine: Engine) -> Counter[str]:
    """How many effect rows each event id has."""
    with engine.connect() as conn:
        return Counter(row[0] for row in conn.execute(select(effects.c.event_id)))


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def private_redis(workdir: Path, *extra: str) -> Iterator[str]:
    """Start our own ``redis-server`` (no persistence, DEBUG allowed); yield its URL.

    For tests that stall or stop Redis: never the shared server. Stopped by its pid.
    """
    binary = shutil.which("redis-server")
    assert binary is not None, "redis-server is not installed"
    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir), "--enable-debug-command", "yes", *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    probe = redis.Redis.from_url(url, socket_timeout=1)
    try:
        def up() -> bool:
            try:
                return bool(probe.ping())
            except redis.ConnectionError:
                return False

        wait_until(up, timeout=10, what="the private redis-server")
        yield url
    finally:
        probe.close()
        proc.terminate()
        proc.wait(timeout=10)


def enqueue_events(
    engine: Engine, count: int, *, aggregates: int = 8, prefix: str = "agg", first: int = 0
) -> list[str]:
    """Commit ``count`` events spread round-robin over ``aggregates`` aggregates (revision
    order within each), in one transaction; return their ids in enqueue order."""
    producer = Producer(source="tests", partitions=PARTITIONS)
    ids = []
    with engine.begin() as conn:
        for i in range(first, first + count):
            ids.append(producer.enqueue(
                conn, type="thing.happened", stream=STREAM, data={"i": i},
                aggregate_type="thing", aggregate_id=f"{prefix}-{i % aggregates}",
                revision=i // aggregates + 1,
            ))
    return ids


def outbox_rows(engine: Engine) -> list[Any]:
    """Every outbox row, in ``seq`` order."""
    with engine.connect() as conn:
        return list(conn.execute(select(outbox).order_by(outbox.c.seq)))


def undelivered(engine: Engine) -> int:
    """Outbox rows not yet marked delivered."""
    return sum(1 for r in outbox_rows(engine) if r.delivered_at_ms is None)


TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def outbox_row(**overrides: Any) -> OutboxRow:
    """An outbox row as the relay takes it, every optional column set (``overrides`` change
    any of them): what the relay's wire encoders are checked on."""
    values: dict[str, Any] = {
        "seq": 7, "event_id": "o-1:order.placed:3", "stream": "orders", "partition": 0,
        "aggregate_type": "order", "aggregate_id": "o-1", "revision": 3,
        "type": "order.placed", "source": "shop", "payload": '{"total":42,"note":"é"}',
        "headers": json.dumps({"traceparent": TRACEPARENT, "tracestate": "k=v"}),
        "created_at_ms": 1_764_000_000_123, "entry_id": "1764000000123-7",
    }
    values.update(overrides)
    return OutboxRow(**values)


def deliveries(events: list[Event], key: str = "k") -> list[Any]:
    """``events`` as a claim's batch (``inbox.Delivery``), entry ids ``1-0``, ``1-1`` …"""
    from outbox_relay.consumer import inbox

    return [inbox.Delivery(key, f"1-{i}", ev, 1) for i, ev in enumerate(events)]


def receipt_outcomes(engine: Engine) -> dict[str, str]:
    """Every receipt's outcome by event id (any group)."""
    from outbox_relay.shared.schema import inbox as inbox_table

    with engine.connect() as conn:
        rows = conn.execute(select(inbox_table.c.event_id, inbox_table.c.outcome))
        return {event_id: outcome for event_id, outcome in rows}
