"""One function per measured scenario; each returns plain numbers for the report.

Relays and consumers run as child processes (see :mod:`bench.workers`); the baseline, the
Redis ceiling and the producer overhead run in this process, serially, as their definitions say.
Relay and consumer runs return a :class:`Run`: the rate, and the CPU seconds of each side
(the children, their PostgreSQL backends, the whole machine, and with a private Redis Cluster
``topology`` its masters), from which the report says where the next bottleneck is. The
steady-rate :func:`pipeline` also splits every event's latency into :data:`STAGES`.
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

import redis
from sqlalchemy import BigInteger, Column, Integer, MetaData, String, Table, insert, text

from bench import consumer_loop, workers
from bench.baseline import Phases, drain_baseline
from bench.env import EVENT_TYPE, REDIS_URL, STREAM, Target, entry_fields, fill_streams, outbox_rows
from bench.topologies import Topology
from outbox_relay.consumer import async_handlers, streams
from outbox_relay.consumer.daemon import Consumer
from outbox_relay.producer import Producer
from outbox_relay.relay import entry_ids
from outbox_relay.shared import db, keys
from outbox_relay.shared.redis_conn import connect_redis
from outbox_relay.shared.schema import inbox, inbox_heads
from outbox_relay.shared.settings import ConsumerSettings

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


def baseline(target: Target, events: int, batch: int, phases: Phases | None = None) -> float:
    """Events/s of the strong serial loop (:mod:`bench.baseline`) over ``events`` rows in one
    partition; checks that its entries are the relay's fields, byte for byte."""
    target.reset(1)
    target.seed(events, 1)
    t0 = time.perf_counter()
    done = drain_baseline(target, 0, batch, phases)
    elapsed = time.perf_counter() - t0
    assert done == events, f"baseline delivered {done} of {events}"
    reply: Any = target.redis.xrange(keys.stream_key(target.prefix, STREAM, 0), count=1)
    first = reply[0][1]
    sent = {k.decode(): v.decode() for k, v in first.items()}
    want = entry_fields(next(outbox_rows(1, 1)))
    assert list(sent) == list(want) and sent == {**want, "time": sent["time"]}, (sent, want)
    return events / elapsed


@dataclass
class Run:
    """One throughput run: the rate, its wall time and the CPU seconds each side used."""

    rate: float
    wall: float
    cpu: dict[str, float]  # python (the children), python_max, db, machine, redis, redis_max


def machine_cpu() -> float:
    """CPU-seconds the whole machine has been busy (``/proc/stat``: all but idle and iowait),
    whoever used them: with :func:`_cpu`, tells our processes from other load."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / workers.CLOCK_TICK


def _cpu(
    results: list[dict[str, Any]], machine: float, redis_cpu: dict[int, float] | None = None
) -> dict[str, float]:
    python = [r["cpu"]["python"] for r in results]
    out = {"python": sum(python), "python_max": max(python),
           "db": sum(r["cpu"]["db"] for r in results), "machine": machine}
    if redis_cpu is not None:
        out["redis"] = sum(redis_cpu.values())
        out["redis_max"] = max(redis_cpu.values(), default=0.0)
    return out


def relay_throughput(
    target: Target, events: int, partitions: int, batch: int, relays: int | None = None,
    topology: Topology | None = None,
) -> Run:
    """Events/s of ``relays`` relay processes (default: one per partition) draining a
    backlog spread over ``partitions``; on the shared Redis or a private ``topology``."""
    relays = relays or partitions
    target.reset(partitions)
    if topology is not None:
        topology.flush()
    target.seed(events, partitions)
    nodes = [f"bench-relay-{i}" for i in range(relays)]
    target.register_nodes(nodes, db.now_ms())
    redis_url = topology.url if topology is not None else REDIS_URL
    with cluster() as c:
        for node in nodes:
            c.spawn(workers.relay_child, target.url, redis_url, target.prefix, partitions,
                    batch, node, c.ready, c.start, c.stop, c.results, True)
        t0 = c.go()
        before = topology.cpu_seconds() if topology is not None else None
        busy = machine_cpu()
        results = c.collect(len(nodes), timeout=600)
        busy = machine_cpu() - busy
        used = _redis_used(topology, before)
    left = target.count(UNDELIVERED)
    assert left == 0, f"{left} rows left undelivered"
    assert sum(r["delivered"] for r in results) == events
    wall = max(r["end"] for r in results) - t0
    return Run(events / wall, wall, _cpu(results, busy, used))


def _redis_used(topology: Topology | None, before: dict[int, float] | None) -> dict[
        int, float] | None:
    if topology is None or before is None:
        return None
    after = topology.cpu_seconds()
    return {port: after[port] - before[port] for port in after}


def consumer_throughput(
    target: Target, events: int, processes: int, batch: int, partitions: int,
    topology: Topology | None = None,
) -> Run:
    """Claims/s of ``processes`` consumers (no-op handler) over a full stream backlog; on
    the shared Redis or a private ``topology``."""
    target.reset(partitions)
    client = target.redis if topology is None else topology.client
    if topology is not None:
        topology.flush()
    fill_streams(client, target.prefix, events, partitions)
    stream_keys = streams.partition_keys(target.prefix, [STREAM], partitions)
    streams.ensure_groups(client, stream_keys, "bench")
    redis_url = topology.url if topology is not None else REDIS_URL
    with cluster() as c:
        for i in range(processes):
            c.spawn(workers.consumer_child, target.url, redis_url, target.prefix, partitions,
                    batch, f"bench-consumer-{i}", c.ready, c.start, c.stop, c.results, False)
        t0 = c.go()
        before = topology.cpu_seconds() if topology is not None else None
        busy = machine_cpu()
        wait_for(lambda: target.count(CLAIMED) >= events, 600, "the consumers")
        busy = machine_cpu() - busy
        c.stop.set()
        results = c.collect(processes, timeout=60)
        used = _redis_used(topology, before)
    assert sum(r["applied"] for r in results) == events
    wall = max(r["end"] for r in results) - t0
    return Run(events / wall, wall, _cpu(results, busy, used))


def consumer_handlers(
    target: Target, events: int, batch: int, rounds: int, partitions: int = 1
) -> dict[str, list[Run]]:
    """Claims/s of one consumer, in this process, with each handler of
    :data:`consumer_loop.VARIANTS` and of the hand-written loop (:func:`consumer_loop.drain_loop`)
    over the same ``events``-entry stream backlog, batch ``batch``; ``rounds`` rounds, the
    order of the rows reversed every other round so drift of a busy machine hits all of them.

    The backlog is written once; every run reads it from the start with a consumer group of
    its own, on emptied inbox and effect tables. A run's time starts once its connections are
    open (as the child processes' start signal does) and ends when its last claim committed and
    was acknowledged; its CPU is this process's (``time.process_time``) and, on PostgreSQL,
    its database backend's."""
    target.reset(partitions)
    consumer_loop.create_effects(target)
    fill_streams(target.redis, target.prefix, events, partitions)
    stream_keys = streams.partition_keys(target.prefix, [STREAM], partitions)
    runs: dict[str, list[Run]] = {v: [] for v in consumer_loop.VARIANTS}
    for number in range(rounds):
        order = consumer_loop.VARIANTS if number % 2 == 0 else consumer_loop.VARIANTS[::-1]
        for variant in order:
            group = f"bench-{number}-{variant.replace(' ', '-')}"
            _empty_claim_tables(target)
            streams.ensure_groups(target.redis, stream_keys, group)
            if variant == "loop":
                run = _loop_run(target, stream_keys, group, batch, events)
            else:
                run = _handler_run(target, variant, group, batch, events, partitions)
            claimed = target.count(f"SELECT count(*) FROM outbox_inbox WHERE group_name = "
                                   f"'{group}'")
            written = target.count("SELECT count(*) FROM bench_effects")
            assert claimed == events, f"{variant}: {claimed} of {events} claimed"
            assert written == (0 if variant == "no-op" else events), (variant, written)
            target.redis.xgroup_destroy(stream_keys[0], group)
            for key in stream_keys[1:]:
                target.redis.xgroup_destroy(key, group)
            runs[variant].append(run)
    return runs


def _empty_claim_tables(target: Target) -> None:
    with target.engine.begin() as conn:
        for table in (inbox, inbox_heads, consumer_loop.effects):
            conn.execute(table.delete())
    if target.kind == "postgresql":
        with target.engine.connect() as conn:
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            for name in ("outbox_inbox", "outbox_inbox_heads", "bench_effects"):
                conn.execute(text(f"VACUUM ANALYZE {name}"))


def _loop_run(
    target: Target, stream_keys: list[str], group: str, batch: int, events: int
) -> Run:
    client = redis.Redis.from_url(REDIS_URL)
    client.ping()
    started: dict[str, float] = {}

    def ready(backend: int | None) -> None:
        if backend is not None:
            started["backend"] = backend
            started["db"] = workers.proc_cpu(backend)
        started["cpu"] = time.process_time()
        started["t0"] = time.perf_counter()

    try:
        done = consumer_loop.drain_loop(target, client, stream_keys, group, batch, events,
                                        ready=ready)
        wall = time.perf_counter() - started["t0"]
        cpu = time.process_time() - started["cpu"]
        backend = started.get("backend")
        db_cpu = workers.proc_cpu(int(backend)) - started["db"] if backend else 0.0
    finally:
        client.close()
    return Run(done / wall, wall, {"python": cpu, "db": db_cpu})


def _handler_run(
    target: Target, variant: str, group: str, batch: int, events: int, partitions: int
) -> Run:
    settings = ConsumerSettings.model_validate({
        "database_url": target.url, "redis_url": REDIS_URL, "key_prefix": target.prefix,
        "partitions": partitions, "streams": STREAM, "group": group,
        "consumer": "bench-consumer", "batch_size": batch, "block_ms": 20,
    })
    engine = db.make_engine(target.url)
    meter = workers.CpuMeter(engine)
    consumer = Consumer(settings, engine, connect_redis(REDIS_URL),
                        consumer_loop.handlers_for(variant, EVENT_TYPE))
    try:
        with engine.connect():
            consumer.client.ping()
        meter.start()
        t0 = time.perf_counter()
        deadline = time.monotonic() + 600
        while consumer.stats.applied < events:
            consumer.run_once(block_ms=20)
            if time.monotonic() > deadline:
                raise TimeoutError(f"consumer ({variant}) applied {consumer.stats.applied}")
        wall = time.perf_counter() - t0
        cpu = meter.stop()
    finally:
        consumer.client.close()
        async_handlers.close()  # the async row's engine and loop
        engine.dispose()
    return Run(consumer.stats.applied / wall, wall, cpu)


STAGES = ("commit → take", "take → XADD acked", "XADD acked → read", "read → claim committed")
"""The stages of an event's way, in order; their sum is the end-to-end latency.

* commit → take: the producer's commit returned → the relay took the row (the ``ms`` of the
  row's entry id ``<ms>-<seq>``, which the relay sets from the wall clock in the take
  transaction: millisecond resolution, read from Redis at no cost to the relay);
* take → XADD acked: → the relay's append script call returned (the take commit, waiting for
  the batch in flight before it, the ``EVALSHA``);
* XADD acked → read: → the consumer's ``XREADGROUP`` returned the entry (its block wakes up
  when the entry lands; longer when the consumer was busy with a claim);
* read → claim committed: validation, the claim transaction and its commit, the ``XACK``.
"""


@dataclass
class Pipeline:
    """What one steady-rate run of producer → relay → consumer measured."""

    latencies_ms: list[float]
    rss_kb: dict[str, list[tuple[float, int]]]
    missing: int = 0  # events not claimed by the deadline: the pipeline did not keep up
    stages_ms: dict[str, list[float]] = field(default_factory=dict)
    # Events claimed per second, from the first commit to the last claim: the offered rate
    # when the pipeline kept up, less when it fell behind.
    achieved: float = 0.0
    # Events committed per second by the producer, first commit to last: below the offered
    # rate when the writers themselves could not offer it.
    produced: float = 0.0


def rss_kb(pid: int) -> int:
    """Resident set size of a process, from ``/proc`` (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def pipeline(
    target: Target, rate: float, seconds: float, partitions: int, sample_every: float = 0.0,
    *, record: bool = True, notify: bool = True, producer_threads: int = 1,
    one_row: bool = False, per_txn: int = 1,
) -> Pipeline:
    """Steady producer at ``rate`` → one relay → one consumer; commit→claim latency per event.

    With ``notify`` False the producer is made with ``notify=False``: no ``pg_notify``, the
    relay finds its rows by polling. ``producer_threads`` > 1: that many writer threads, each
    committing the events due, at most ``per_txn`` per transaction
    (:func:`workers.producer_child`); ``one_row``: the consumer's
    handler writes one row per event (``bench_effects``, emptied first).

    With ``sample_every`` > 0 the relay's and consumer's RSS is sampled during the run. With
    ``record`` False the consumer does not keep each event's claim time (no latencies): in a
    10-minute memory run that map alone (600,000 entries) grew its RSS by 60%.
    """
    target.reset(partitions)
    if one_row:
        consumer_loop.create_effects(target)
        with target.engine.begin() as conn:
            conn.execute(consumer_loop.effects.delete())
    keys = streams.partition_keys(target.prefix, [STREAM], partitions)
    streams.ensure_groups(target.redis, keys, "bench")
    total = int(rate * seconds)
    with cluster() as c:
        relay = c.spawn(workers.relay_child, target.url, REDIS_URL, target.prefix, partitions,
                        500, "bench-relay", c.ready, c.start, c.stop, c.results, False, record)
        consumer = c.spawn(workers.consumer_child, target.url, REDIS_URL, target.prefix,
                           partitions, 500, "bench-consumer", c.ready, c.start, c.stop,
                           c.results, record, one_row)
        c.spawn(workers.producer_child, target.url, target.prefix, partitions, rate, seconds,
                c.ready, c.start, c.results, notify, producer_threads, per_txn)
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
    stages = stage_latencies(committed, results["bench-relay"]["landed"],
                             results["bench-consumer"]["read"], claimed)
    first = min(committed.values(), default=0.0)
    span = max(claimed.values(), default=0.0) - first
    writing = max(committed.values(), default=0.0) - first
    return Pipeline(lat, rss, missing=total - len(lat), stages_ms=stages,
                    achieved=len(lat) / span if span > 0 else 0.0,
                    produced=len(committed) / writing if writing > 0 else 0.0)


def stage_latencies(
    committed: dict[str, float],
    landed: dict[tuple[str, int], float],
    read: dict[str, tuple[str, str, float]],
    claimed: dict[str, float],
) -> dict[str, list[float]]:
    """Per event with every stamp, the ms each :data:`STAGES` stage took (wall clock)."""
    out: dict[str, list[float]] = {name: [] for name in STAGES}
    for event_id, commit in committed.items():
        seen = read.get(event_id)
        done = claimed.get(event_id)
        if seen is None or done is None:
            continue
        key, entry_id, read_at = seen
        take_ms = entry_ids.parse(entry_id)[0]
        acked = landed.get((key, take_ms))
        if acked is None:
            continue
        take = take_ms / 1000
        for name, start, end in zip(STAGES, (commit, take, acked, read_at),
                                    (take, acked, read_at, done), strict=True):
            out[name].append((end - start) * 1000)
    return out


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
