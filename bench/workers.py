"""Child-process bodies: relay, consumer and steady producer, each measured from a start signal.

The benchmark runs relays and consumers as separate processes (``multiprocessing`` spawn), as
they run in production: on a 2-core machine threads would share one interpreter lock and
understate what several relays can do. Each child imports and connects first, reports ready,
and waits for the common start event, so start-up time is never measured. Throughput times
are ``time.monotonic()``, latency stamps ``time.time()`` (the relay's entry ids carry the wall
clock's milliseconds); both are one system-wide clock on Linux, so they compare across
processes.

Every relay and consumer child also reports the CPU seconds it used between the start signal
and its end (``time.process_time``: all its threads), and on PostgreSQL those of its database
backends (``/proc/<backend pid>/stat``; the pids from ``pg_backend_pid()`` on every connection
its engine opened), so a run can say whether Python, the database or Redis was the limit.

With ``record`` (the latency runs), two observation points are added *in the child process*,
without changing product code: the relay's ``append.append`` is wrapped to stamp when each
batch's append script returned (one ``time.time()`` and one dict write per batch), and the
consumer's ``streams.read`` is wrapped to stamp when each ``XREADGROUP`` returned, per entry.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, event

from bench import consumer_loop
from bench.env import EVENT_TYPE, STREAM
from outbox_relay.consumer import streams as consumer_streams
from outbox_relay.consumer.daemon import Consumer
from outbox_relay.consumer.handlers import Handlers
from outbox_relay.producer import Producer
from outbox_relay.relay import append as relay_append
from outbox_relay.relay import entry_ids
from outbox_relay.relay.daemon import Relay
from outbox_relay.shared import db, gc_pace, keys
from outbox_relay.shared.envelope import Event
from outbox_relay.shared.redis_conn import connect_redis
from outbox_relay.shared.settings import ConsumerSettings, RelaySettings

CLOCK_TICK = os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU seconds of this process and of its PostgreSQL backends since :meth:`start`."""

    def __init__(self, engine: Engine) -> None:
        self.backends: set[int] = set()
        if engine.dialect.name == "postgresql":
            @event.listens_for(engine, "connect")
            def _backend(dbapi_connection: Any, _record: Any) -> None:
                cursor = dbapi_connection.cursor()
                cursor.execute("SELECT pg_backend_pid()")
                self.backends.add(int(cursor.fetchone()[0]))
                cursor.close()
                dbapi_connection.commit()

        self._own = 0.0
        self._db = 0.0
        self._seen: dict[int, float] = {}

    def start(self) -> None:
        self._own = time.process_time()
        self._seen = {pid: proc_cpu(pid) for pid in self.backends}

    def stop(self) -> dict[str, float]:
        """``{"python": s, "db": s}``: a backend opened after :meth:`start` counts whole."""
        used = sum(proc_cpu(pid) - self._seen.get(pid, 0.0) for pid in self.backends)
        return {"python": time.process_time() - self._own, "db": used}


def proc_cpu(pid: int) -> float:
    """utime + stime of a process in seconds (0 when it is gone or not readable)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICK


def relay_child(
    url: str, redis_url: str, prefix: str, partitions: int, batch: int, node_id: str,
    ready: Any, start: Any, stop: Any, results: Any, until_idle: bool, record: bool = False,
) -> None:
    """One relay: drain until idle (throughput) or run until ``stop`` (latency, memory).

    With ``record``, the time each batch's append returned, by ``(stream key, batch ms)``
    (the ms of the batch's entry ids ``<ms>-<seq>``: the moment the relay took it)."""
    settings = RelaySettings.model_validate({
        "database_url": url, "redis_url": redis_url, "key_prefix": prefix,
        "partitions": partitions, "batch_size": batch, "node_id": node_id,
    })
    gc_pace.pace(settings.gc_threshold)  # as `outbox relay` runs
    engine = db.make_engine(url)
    cpu = CpuMeter(engine)
    relay = Relay(settings, engine, connect_redis(redis_url))
    landed: dict[tuple[str, int], float] = {}
    if record:
        _stamp_appends(landed)
    with engine.connect():
        relay.client.ping()
    ready.put(node_id)
    start.wait()
    cpu.start()
    if until_idle:
        stats = relay.run(until_idle=True)
    else:
        _stop_when(stop, relay.stop)
        stats = relay.run()
    end = time.monotonic()
    results.put({"node": node_id, "end": end, "delivered": stats.delivered,
                 "cpu": cpu.stop(), "landed": landed})
    engine.dispose()


def _stamp_appends(landed: dict[tuple[str, int], float]) -> None:
    """Wrap ``relay.append.append_many`` (looked up at each call, by the relay's rounds and
    by ``append`` for one batch) in this process; a batch is stamped when it landed (a
    failed one is stamped by its retry)."""
    original = relay_append.append_many

    def append_many(client: Any, prefix: str, batches: list[Any], *args: Any,
                    **kwargs: Any) -> Any:
        outcomes = original(client, prefix, batches, *args, **kwargs)
        now = time.time()
        for (rows, _epoch), outcome in zip(batches, outcomes, strict=True):
            if rows and isinstance(outcome, relay_append.Verdicts) and outcome.delivered:
                first, last = rows[0], rows[-1]
                key = keys.stream_key(prefix, first.stream, first.partition)
                for row in (first, last):
                    landed.setdefault((key, entry_ids.parse(row.entry_id)[0]), now)
        return outcomes

    relay_append.append_many = append_many


def _stop_when(event: Any, stop: Any) -> None:
    import threading

    threading.Thread(target=lambda: (event.wait(), stop()), daemon=True).start()


def _noop(_conn: Connection, _event: Event) -> None:
    """The benchmark handler: does nothing, so only the claim's own cost is measured."""


def consumer_child(
    url: str, redis_url: str, prefix: str, partitions: int, batch: int, name: str,
    ready: Any, start: Any, stop: Any, results: Any, record: bool, one_row: bool = False,
) -> None:
    """One consumer of group ``bench``; with ``record``, for every event id the time its
    ``XREADGROUP`` returned (with its stream key and entry id) and the time its claim
    committed (stamped after the commit and the ``XACK``, in ``after_batch``). ``one_row``:
    its handler also writes one row per event (:func:`bench.consumer_loop.one_row_handler`,
    table ``bench_effects``), as a real handler does."""
    claimed: dict[str, float] = {}
    read: dict[str, tuple[str, str, float]] = {}
    current: list[str] = []

    def handler(conn: Connection, event: Event) -> None:
        current.append(event.id)
        if one_row:
            consumer_loop.one_row_handler(conn, event)

    def after_batch() -> None:  # runs after the claim transaction committed (and XACK)
        now = time.time()
        for event_id in current:
            claimed.setdefault(event_id, now)
        current.clear()

    handlers = Handlers()
    handlers.register("*", handler if record else _noop)
    settings = ConsumerSettings.model_validate({
        "database_url": url, "redis_url": redis_url, "key_prefix": prefix,
        "partitions": partitions, "streams": STREAM, "group": "bench", "consumer": name,
        "batch_size": batch, "block_ms": 20,
    })
    gc_pace.pace(settings.gc_threshold)  # as `outbox consume` runs
    engine = db.make_engine(url)
    cpu = CpuMeter(engine)
    if record:
        _stamp_reads(read)
    consumer = Consumer(settings, engine, connect_redis(redis_url), handlers,
                        after_batch=after_batch if record else None)
    with engine.connect():
        consumer.client.ping()
    ready.put(name)
    start.wait()
    cpu.start()
    last = time.monotonic()
    while not stop.is_set():
        if consumer.run_once(block_ms=20):
            last = time.monotonic()
    used = cpu.stop()
    results.put({"name": name, "end": last, "applied": consumer.stats.applied,
                 "claimed": claimed, "read": read, "cpu": used})
    engine.dispose()


def _stamp_reads(read: dict[str, tuple[str, str, float]]) -> None:
    """Wrap ``consumer.streams.read`` (looked up by the consumer at each call) in this
    process: every entry's event id → (stream key, entry id, time the read returned)."""
    original = consumer_streams.read

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        entries = original(*args, **kwargs)
        now = time.time()
        for e in entries:
            event_id = e.fields.get(b"id") if e.fields else None
            if event_id is not None:
                read.setdefault(event_id.decode(), (e.key, e.entry_id, now))
        return entries

    consumer_streams.read = wrapped


def producer_child(
    url: str, prefix: str, partitions: int, rate: float, seconds: float,
    ready: Any, start: Any, results: Any, notify: bool = True, threads: int = 1,
    per_txn: int = 1,
) -> None:
    """Enqueue at a steady ``rate`` for ``seconds``; records each event's commit time
    (``time.time()``). ``notify``: the producer's (``False``: no ``pg_notify``, relays poll).

    One thread (``threads`` 1): one transaction per tick holds the events due by then (one, at
    low rates). Several: each thread is a writer of its own, ``rate / threads`` each, whose
    transaction holds the events due by then up to ``per_txn`` (the capacity sweep: 1, a
    request handler's one event; more, a writer that commits what came in meanwhile).
    """
    producer = Producer(source="bench", partitions=partitions, key_prefix=prefix,
                        notify=notify)
    engine = db.make_engine(url, pool_size=max(5, threads), max_overflow=0)
    with engine.connect():
        pass
    ready.put("producer")
    start.wait()
    committed: dict[str, float] = {}
    total = int(rate * seconds)
    if threads <= 1:
        _produce(engine, producer, committed, range(total), rate, 100)
    else:
        workers = [threading.Thread(target=_produce, args=(
            engine, producer, committed, range(i, total, threads), rate / threads, per_txn))
            for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    results.put({"name": "producer", "committed": committed, "end": time.monotonic()})
    engine.dispose()


def _produce(engine: Engine, producer: Producer, committed: dict[str, float],
             numbers: range, rate: float, per_txn: int) -> None:
    """Enqueue the events numbered ``numbers`` at ``rate``, at most ``per_txn`` of those due
    in one transaction; each commit time into ``committed`` (one dict for every thread: a
    dict update is atomic under the GIL)."""
    t0 = time.monotonic()
    made, total = 0, len(numbers)
    while made < total:
        due = min(int((time.monotonic() - t0) * rate) + 1, total) - made
        if due <= 0:
            time.sleep(max(0.0, t0 + (made + 1) / rate - time.monotonic()))
            continue
        ids = []
        with engine.begin() as conn:
            for n in numbers[made:made + min(due, per_txn)]:
                ids.append(producer.enqueue(
                    conn, type=EVENT_TYPE, stream=STREAM, data={"n": n},
                    aggregate_type="order", aggregate_id=f"order-{n}", revision=1,
                ))
        now = time.time()
        committed.update(dict.fromkeys(ids, now))
        made += len(ids)
