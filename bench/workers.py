"""Child-process bodies: relay, consumer and steady producer, each measured from a start signal.

The benchmark runs relays and consumers as separate processes (``multiprocessing`` spawn), as
they run in production: on a 2-core machine threads would share one interpreter lock and
understate what several relays can do. Each child imports and connects first, reports ready,
and waits for the common start event, so start-up time is never measured. Times are
``time.monotonic()``, which is one system-wide clock on Linux, so they compare across processes.
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import Connection

from bench.env import EVENT_TYPE, REDIS_URL, STREAM
from outbox_relay.consumer.daemon import Consumer
from outbox_relay.consumer.handlers import Handlers
from outbox_relay.producer import Producer
from outbox_relay.relay.daemon import Relay
from outbox_relay.shared import db
from outbox_relay.shared.envelope import Event
from outbox_relay.shared.redis_conn import connect_redis
from outbox_relay.shared.settings import ConsumerSettings, RelaySettings


def relay_child(
    url: str, prefix: str, partitions: int, batch: int, node_id: str,
    ready: Any, start: Any, stop: Any, results: Any, until_idle: bool,
) -> None:
    """One relay: drain until idle (throughput) or run until ``stop`` (latency, memory)."""
    settings = RelaySettings.model_validate({
        "database_url": url, "redis_url": REDIS_URL, "key_prefix": prefix,
        "partitions": partitions, "batch_size": batch, "node_id": node_id,
    })
    engine = db.make_engine(url)
    relay = Relay(settings, engine, connect_redis(REDIS_URL))
    with engine.connect():
        relay.client.ping()
    ready.put(node_id)
    start.wait()
    if until_idle:
        stats = relay.run(until_idle=True)
    else:
        _stop_when(stop, relay.stop)
        stats = relay.run()
    results.put({"node": node_id, "end": time.monotonic(), "delivered": stats.delivered})
    engine.dispose()


def _stop_when(event: Any, stop: Any) -> None:
    import threading

    threading.Thread(target=lambda: (event.wait(), stop()), daemon=True).start()


def _noop(_conn: Connection, _event: Event) -> None:
    """The benchmark handler: does nothing, so only the claim's own cost is measured."""


def consumer_child(
    url: str, prefix: str, partitions: int, batch: int, name: str,
    ready: Any, start: Any, stop: Any, results: Any, record: bool,
) -> None:
    """One consumer of group ``bench``; with ``record``, the claim time of every event id."""
    claimed: dict[str, float] = {}
    current: list[str] = []

    def handler(_conn: Connection, event: Event) -> None:
        current.append(event.id)

    def after_batch() -> None:  # runs after the claim transaction committed (and XACK)
        now = time.monotonic()
        for event_id in current:
            claimed.setdefault(event_id, now)
        current.clear()

    handlers = Handlers()
    handlers.register("*", handler if record else _noop)
    settings = ConsumerSettings.model_validate({
        "database_url": url, "redis_url": REDIS_URL, "key_prefix": prefix,
        "partitions": partitions, "streams": STREAM, "group": "bench", "consumer": name,
        "batch_size": batch, "block_ms": 20,
    })
    engine = db.make_engine(url)
    consumer = Consumer(settings, engine, connect_redis(REDIS_URL), handlers,
                        after_batch=after_batch if record else None)
    with engine.connect():
        consumer.client.ping()
    ready.put(name)
    start.wait()
    last = time.monotonic()
    while not stop.is_set():
        if consumer.run_once(block_ms=20):
            last = time.monotonic()
    results.put({"name": name, "end": last, "applied": consumer.stats.applied,
                 "claimed": claimed})
    engine.dispose()


def producer_child(
    url: str, prefix: str, partitions: int, rate: float, seconds: float,
    ready: Any, start: Any, results: Any,
) -> None:
    """Enqueue at a steady ``rate`` for ``seconds``; one transaction per tick holds the events
    due by then (one, at low rates); records each event's commit time."""
    producer = Producer(source="bench", partitions=partitions, key_prefix=prefix)
    engine = db.make_engine(url)
    with engine.connect():
        pass
    ready.put("producer")
    start.wait()
    committed: dict[str, float] = {}
    t0 = time.monotonic()
    made = 0
    total = int(rate * seconds)
    while made < total:
        due = min(int((time.monotonic() - t0) * rate) + 1, total) - made
        if due <= 0:
            time.sleep(max(0.0, t0 + (made + 1) / rate - time.monotonic()))
            continue
        ids = []
        with engine.begin() as conn:
            for n in range(made, made + min(due, 100)):
                ids.append(producer.enqueue(
                    conn, type=EVENT_TYPE, stream=STREAM, data={"n": n},
                    aggregate_type="order", aggregate_id=f"order-{n}", revision=1,
                ))
        now = time.monotonic()
        committed.update(dict.fromkeys(ids, now))
        made += len(ids)
    results.put({"name": "producer", "committed": committed, "end": time.monotonic()})
    engine.dispose()
