"""Producers under concurrency (issue 24): transactions/s of ``threads`` writer threads, each
on its own pooled connection, one event per transaction.

Three variants, measured in interleaved blocks (the order reversed every other round, so the
drift of a shared machine hits all of them): ``bare``, a transaction with one business insert;
``enqueue``, the same plus :meth:`Producer.enqueue` (``pg_notify`` in the insert);
``no notify``, the same with ``Producer(notify=False)`` (relays find the rows by polling).
Each variant's figure is the median of its blocks' rates; its ratio to ``bare`` is the median
of the rounds' paired ratios (each block against the ``bare`` block of the same round).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import Connection, insert

from bench import report
from bench.env import EVENT_TYPE, STREAM, Target
from bench.scenarios import _meta, orders
from outbox_relay.producer import Producer
from outbox_relay.shared import db

VARIANTS = ("bare", "enqueue", "no notify")
RATIOS = {"enqueue": "enqueue / bare", "no notify": "no notify / bare"}


def concurrent(
    target: Target, thread_counts: tuple[int, ...], block_s: float, rounds: int
) -> dict[str, Any]:
    """``{"<n> threads": {variant: tx/s summary, "<variant> / bare": ratio summary,
    "python_cpu_us_per_tx": {variant: median CPU µs of this process per transaction}}}``."""
    _meta.create_all(target.engine)
    target.reset(4)
    engine = db.make_engine(target.url, pool_size=max(thread_counts), max_overflow=0)
    producers = {"enqueue": Producer(source="bench", partitions=4, key_prefix=target.prefix),
                 "no notify": Producer(source="bench", partitions=4, key_prefix=target.prefix,
                                       notify=False)}
    out: dict[str, Any] = {}
    try:
        for threads in thread_counts:
            rates: dict[str, list[float]] = {v: [] for v in VARIANTS}
            cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
            for number in range(rounds):
                order = VARIANTS if number % 2 == 0 else VARIANTS[::-1]
                for variant in order:
                    work = _work(producers.get(variant), f"{threads}-{number}-{variant}")
                    rate, cpu_us = _block(engine, threads, block_s, work)
                    rates[variant].append(rate)
                    cpu[variant].append(cpu_us)
            row: dict[str, Any] = {v: report.summary(r) for v, r in rates.items()}
            row["python_cpu_us_per_tx"] = {v: statistics.median(c) for v, c in cpu.items()}
            for variant, name in RATIOS.items():
                row[name] = report.summary([a / b for a, b in zip(rates[variant], rates["bare"],
                                                                  strict=True)])
            out[f"{threads} threads"] = row
    finally:
        engine.dispose()
    return out


def targets(kind: str, producer: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 24: at 16 threads, ``enqueue`` >= 0.9x the bare transaction (each variant)."""
    sixteen = producer.get("threads", {}).get("16 threads", {})
    return [{"name": f"{kind} producer at 16 threads, {name}", "value": sixteen[name]["median"],
             "goal": ">= 0.9", "met": sixteen[name]["median"] >= 0.9}
            for name in RATIOS.values() if name in sixteen]


def _work(producer: Producer | None, tag: str) -> Callable[[Connection, int, int], None]:
    """One transaction's body: the business insert, and the event unless ``bare``."""

    def body(conn: Connection, thread: int, n: int) -> None:
        conn.execute(insert(orders).values(sku="A-1", qty=2, created_at_ms=db.now_ms()))
        if producer is not None:
            producer.enqueue(conn, type=EVENT_TYPE, stream=STREAM, data={"n": n},
                             aggregate_type="order", aggregate_id=f"o-{tag}-{thread}-{n}",
                             revision=1)

    return body


def _block(
    engine: Any, threads: int, seconds: float, body: Callable[[Connection, int, int], None]
) -> tuple[float, float]:
    """Transactions/s of ``threads`` threads running ``body`` for ``seconds`` (each thread
    opens its connection before the common start), and this process's CPU µs per
    transaction."""
    counts = [0] * threads
    start = threading.Barrier(threads + 1)
    stop = threading.Event()
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            with engine.connect() as conn:
                start.wait()
                n = 0
                while not stop.is_set():
                    with conn.begin():
                        body(conn, i, n)
                    n += 1
                counts[i] = n
        except BaseException as err:  # reported by the caller, never lost in a thread
            errors.append(err)
            start.abort()

    pool = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(threads)]
    for t in pool:
        t.start()
    try:
        start.wait()
    except threading.BrokenBarrierError:
        for t in pool:
            t.join()
        raise errors[0] from None
    t0, cpu0 = time.perf_counter(), time.process_time()
    time.sleep(seconds)
    stop.set()
    for t in pool:
        t.join()
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    if errors:
        raise errors[0]
    done = max(sum(counts), 1)
    return done / elapsed, cpu / done * 1e6
