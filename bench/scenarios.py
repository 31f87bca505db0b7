"""One function per measured scenario; each returns plain numbers for the report.

Relays and consumers run as child processes (see :mod:`bench.workers`); the baseline, the
Redis ceiling and the producer overhead run in this process, serially, as their definitions say.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import queue
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import BigInteger, Column, Integer, MetaData, String, Table, insert

from bench import workers
from bench.baseline import drain_baseline
from bench.env import EVENT_TYPE, STREAM, Target, fill_streams
from outbox_relay.consumer import streams
from outbox_relay.producer import Producer
from outbox_relay.shared import db

CTX = multiprocessing.get_context("spawn")
UNDELIVERED = "SELECT count(*) FROM outbox_events WHERE delivered_at_ms IS NULL"
CLAIMED = "SELECT count(*) FROM outbox_inbox"


@dataclass
class Cluster:
    """Child processes that report ready, start together and report results."""

    ready: Any = field(default_factory=CTX.Queue)
    results: Any = field(default_factory=CTX.Queue)
    start: Any = field(default_factory=CTX.Event)
    stop: Any = field(default_factory=CTX.Event)
    procs: list[Any] = field(default_factory=list)
    t0: float = 0.0

    def spawn(self, target: Callable[..., None], *args: Any) -> Any:
        proc = CTX.Process(target=target, args=args, daemon=True)
        proc.start()
        self.procs.append(proc)
        return proc

    def go(self, timeout: float = 60.0) -> float:
        for _ in self.procs:
            self.ready.get(timeout=timeout)
        self.t0 = time.monotonic()
        self.start.set()
        return self.t0

    def collect(self, count: int, timeout: float) -> list[dict[str, Any]]:
        return [self.results.get(timeout=timeout) for _ in range(count)]


@contextmanager
def cluster() -> Iterator[Cluster]:
    """A :class:`Cluster` whose children are always stopped and joined (by their own pid)."""
    c = Cluster()
    try:
        yield c
    finally:
        c.stop.set()
        c.start.set()
        for p in c.procs:
            p.join(timeout=20)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)


def wait_for(check: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``check`` until true; raise with ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"benchmark timed out waiting for {what}")
        time.sleep(0.02)


def baseline(target: Target, events: int, batch: int) -> float:
    """Events/s of the hand-written serial loop over ``events`` rows in one partition."""
    target.reset(1)
    target.seed(events, 1)
    t0 = time.perf_counter()
    done = drain_baseline(target, 0, batch)
    elapsed = time.perf_counter() - t0
    assert done == events, f"baseline delivered {done} of {events}"
    return events / elapsed


def relay_throughput(target: Target, events: int, partitions: int, batch: int) -> float:
    """Events/s of ``partitions`` relay processes (one partition each) draining a backlog."""
    target.reset(partitions)
    target.seed(events, partitions)
    nodes = [f"bench-relay-{i}" for i in range(partitions)]
    target.register_nodes(nodes, db.now_ms())
    with cluster() as c:
        for node in nodes:
            c.spawn(workers.relay_child, target.url, target.prefix, partitions, batch, node,
                    c.ready, c.start, c.stop, c.results, True)
        t0 = c.go()
        results = c.collect(len(nodes), timeout=600)
    left = target.count(UNDELIVERED)
    assert left == 0, f"{left} rows left undelivered"
    assert sum(r["delivered"] for r in results) == events
    return float(events / (max(r["end"] for r in results) - t0))


def consumer_throughput(
    target: Target, events: int, processes: int, batch: int, partitions: int
) -> float:
    """Claims/s of ``processes`` consumers (no-op handler) over a full stream backlog."""
    target.reset(partitions)
    fill_streams(target.redis, target.prefix, events, partitions)
    keys = streams.partition_keys(target.prefix, [STREAM], partitions)
    streams.ensure_groups(target.redis, keys, "bench")
    with cluster() as c:
        for i in range(processes):
            c.spawn(workers.consumer_child, target.url, target.prefix, partitions, batch,
                    f"bench-consumer-{i}", c.ready, c.start, c.stop, c.results, False)
        t0 = c.go()
        wait_for(lambda: target.count(CLAIMED) >= events, 600, "the consumers")
        c.stop.set()
        results = c.collect(processes, timeout=60)
    assert sum(r["applied"] for r in results) == events
    return float(events / (max(r["end"] for r in results) - t0))


@dataclass
class Pipeline:
    """What one steady-rate run of producer → relay → consumer measured."""

    latencies_ms: list[float]
    rss_kb: dict[str, list[tuple[float, int]]]
    missing: int = 0  # events not claimed by the deadline: the pipeline did not keep up


def rss_kb(pid: int) -> int:
    """Resident set size of a process, from ``/proc`` (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def pipeline(
    target: Target, rate: float, seconds: float, partitions: int, sample_every: float = 0.0,
    *, record: bool = True,
) -> Pipeline:
    """Steady producer at ``rate`` → one relay → one consumer; commit→claim latency per event.

    With ``sample_every`` > 0 the relay's and consumer's RSS is sampled during the run. With
    ``record`` False the consumer does not keep each event's claim time (no latencies): in a
    10-minute memory run that map alone (600,000 entries) grew its RSS by 60%.
    """
    target.reset(partitions)
    keys = streams.partition_keys(target.prefix, [STREAM], partitions)
    streams.ensure_groups(target.redis, keys, "bench")
    total = int(rate * seconds)
    with cluster() as c:
        relay = c.spawn(workers.relay_child, target.url, target.prefix, partitions, 500,
                        "bench-relay", c.ready, c.start, c.stop, c.results, False)
        consumer = c.spawn(workers.consumer_child, target.url, target.prefix, partitions, 500,
                           "bench-consumer", c.ready, c.start, c.stop, c.results, record)
        c.spawn(workers.producer_child, target.url, target.prefix, partitions, rate, seconds,
                c.ready, c.start, c.results)
        rss: dict[str, list[tuple[float, int]]] = {"relay": [], "consumer": []}
        t0 = c.go()
        _sample(rss, relay.pid, consumer.pid, 0.0)
        next_sample = t0 + sample_every
        deadline = t0 + seconds * 3 + 60

        def done() -> bool:
            nonlocal next_sample
            now = time.monotonic()
            if sample_every and now >= next_sample:
                _sample(rss, relay.pid, consumer.pid, now - t0)
                next_sample += sample_every
            return now > t0 + seconds and target.count(CLAIMED) >= total

        # Falling behind is a finding, not a crash: report what was claimed and the rest.
        with contextlib.suppress(TimeoutError):
            wait_for(done, deadline - t0, "the pipeline to deliver every event")
        _sample(rss, relay.pid, consumer.pid, time.monotonic() - t0)
        c.stop.set()
        try:
            results = {r.get("name", r.get("node")): r for r in c.collect(3, timeout=120)}
        except queue.Empty:  # a child never reported: the run is lost, not the whole bench
            return Pipeline([], rss, missing=total)
    committed = results["producer"]["committed"]
    claimed = results["bench-consumer"]["claimed"]
    lat = [(claimed[i] - t) * 1000 for i, t in committed.items() if i in claimed]
    return Pipeline(lat, rss, missing=total - len(lat))


def _sample(rss: dict[str, list[tuple[float, int]]], relay: int, consumer: int, t: float) -> None:
    rss["relay"].append((round(t, 1), rss_kb(relay)))
    rss["consumer"].append((round(t, 1), rss_kb(consumer)))


_meta = MetaData()
orders = Table(
    "bench_orders", _meta,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("sku", String(32), nullable=False),
    Column("qty", Integer, nullable=False),
    Column("created_at_ms", BigInteger, nullable=False),
)


def producer_overhead(target: Target, transactions: int) -> tuple[float, float]:
    """Mean ms of a transaction with one business insert, without and with ``enqueue``.

    The two kinds alternate in blocks of 50 so that drift of a noisy machine hits both.
    """
    _meta.create_all(target.engine)
    target.reset(4)
    producer = Producer(source="bench", partitions=4, key_prefix=target.prefix)
    bare: list[float] = []
    with_enqueue: list[float] = []
    n = 0
    for block in range(max(transactions // 50, 2)):
        enqueue = block % 2 == 1
        for _ in range(50):
            n += 1
            t = time.perf_counter()
            with target.engine.begin() as conn:
                conn.execute(insert(orders).values(sku="A-1", qty=2, created_at_ms=db.now_ms()))
                if enqueue:
                    producer.enqueue(conn, type=EVENT_TYPE, stream=STREAM, data={"n": n},
                                     aggregate_type="order", aggregate_id=f"o-{n}", revision=1)
            (with_enqueue if enqueue else bare).append((time.perf_counter() - t) * 1000)
    return statistics.mean(bare), statistics.mean(with_enqueue)
