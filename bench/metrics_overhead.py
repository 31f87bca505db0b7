"""``python -m bench.metrics_overhead``: what metrics cost the relay and the consumer.

Two measurements:

- per call (``timeit``, best of 5, no I/O): the relay's per-batch hook
  (:meth:`relay.metrics.RelayMetrics.appended`), the consumer's per-batch hook
  (:meth:`consumer.metrics.ConsumerMetrics.claimed`, 200 outcomes) and the handler timing
  wrapper per call;
- end to end, A/B (``--ab``): a relay draining ``--events`` seeded rows, then a consumer
  reading and claiming them (no-op handler), each with metrics off and on (hooks installed,
  the port served and scraped every ``--scrape-s`` seconds, far more often than Prometheus'
  usual 15 s; ``--scrape-s 0``: the hooks alone), alternating modes in fresh processes
  ``--runs`` times; medians in events/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import timeit
import urllib.request
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection

from bench import env
from outbox_relay.consumer import Handlers
from outbox_relay.consumer.daemon import Consumer
from outbox_relay.consumer.metrics import ConsumerMetrics
from outbox_relay.consumer.ordering import APPLIED, Delivery, Outcome
from outbox_relay.relay.append import Verdicts
from outbox_relay.relay.daemon import Relay
from outbox_relay.relay.metrics import RelayMetrics
from outbox_relay.shared.envelope import Event
from outbox_relay.shared.metrics_server import MetricsServer
from outbox_relay.shared.redis_conn import connect_redis
from outbox_relay.shared.settings import ConsumerSettings, RelaySettings


def _per_call_ns(func: Callable[[], object], number: int) -> float:
    return min(timeit.repeat(func, number=number, repeat=5)) / number * 1e9


def per_call(number: int) -> dict[str, float]:
    """Hook costs in ns, no I/O (the daemons are built but never run)."""
    target = env.open_target("sqlite", tempfile.gettempdir())
    try:
        relay = Relay(_relay_settings(target, 4), target.engine, target.redis)
        relay_metrics = RelayMetrics(relay)
        verdicts = Verdicts(delivered=[(i, f"1-{i}") for i in range(500)])
        handlers = Handlers()
        handlers.register(env.EVENT_TYPE, _noop)
        raw = handlers.get(env.EVENT_TYPE)
        consumer = Consumer(_consumer_settings(target, 4), target.engine, target.redis, handlers)
        consumer_metrics = ConsumerMetrics(consumer)
        timed = handlers.get(env.EVENT_TYPE)
        assert raw is not None and timed is not None and timed is not raw
        event = Event(id="e-1", source="bench", type=env.EVENT_TYPE, time=datetime.now(UTC),
                      data={})
        outcomes = [Outcome(Delivery("k", f"1-{i}", event, 1, None), APPLIED)
                    for i in range(200)]
        conn: Any = None
        return {
            "relay_appended_per_batch_ns": _per_call_ns(
                lambda: relay_metrics.appended(500, verdicts, 0.001), number),
            "consumer_claimed_per_200_ns": _per_call_ns(
                lambda: consumer_metrics.claimed(outcomes, 0.01), max(number // 10, 1)),
            "handler_call_raw_ns": _per_call_ns(lambda: raw(conn, event), number),
            "handler_call_timed_ns": _per_call_ns(lambda: timed(conn, event), number),
        }
    finally:
        target.close()


def _noop(conn: Connection, event: Event, /) -> None:
    """A handler that does nothing: what is left is the consumer's own cost."""


def _relay_settings(target: env.Target, partitions: int) -> RelaySettings:
    return RelaySettings.model_validate({
        "database_url": target.url, "redis_url": env.REDIS_URL, "key_prefix": target.prefix,
        "partitions": partitions, "batch_size": 500, "node_id": "metrics-ab",
        "stream_trim": False})


def _consumer_settings(target: env.Target, partitions: int) -> ConsumerSettings:
    return ConsumerSettings.model_validate({
        "database_url": target.url, "redis_url": env.REDIS_URL, "key_prefix": target.prefix,
        "partitions": partitions, "streams": env.STREAM, "group": "bench", "consumer": "c1",
        "batch_size": 200, "block_ms": 10})


def _scraping(registry: Any, every_s: float) -> Callable[[], None]:
    """Serve ``registry`` and scrape it every ``every_s`` on a thread; returns ``stop``."""
    server = MetricsServer("127.0.0.1", 0, registry)
    done = threading.Event()

    def loop() -> None:
        while not done.wait(every_s):
            with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics") as answer:
                answer.read()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()

    def stop() -> None:
        done.set()
        thread.join()
        server.stop()

    return stop


def one_run(kind: str, metrics: bool, events: int, partitions: int,
            scrape_s: float) -> dict[str, float]:
    """Seed, drain with the relay, then consume everything; events/s of each phase."""
    target = env.open_target(kind, tempfile.gettempdir())
    try:
        target.reset(partitions)
        target.seed(events, partitions)
        relay = Relay(_relay_settings(target, partitions), target.engine,
                      connect_redis(env.REDIS_URL))
        handlers = Handlers()
        handlers.register(env.EVENT_TYPE, _noop)
        consumer = Consumer(_consumer_settings(target, partitions), target.engine,
                            connect_redis(env.REDIS_URL), handlers)
        stops = []
        if metrics:
            relay.metrics = RelayMetrics(relay)
            consumer.metrics = ConsumerMetrics(consumer)
            if scrape_s > 0:  # 0: the hooks alone, nothing served
                stops = [_scraping(relay.metrics.registry, scrape_s),
                         _scraping(consumer.metrics.registry, scrape_s)]
        t0 = time.perf_counter()
        stats = relay.run(until_idle=True)
        relay_s = time.perf_counter() - t0
        assert stats.delivered == events, stats
        t0 = time.perf_counter()
        while consumer.stats.read < events:
            consumer.run_once()
        consumer_s = time.perf_counter() - t0
        assert consumer.stats.applied == events, consumer.stats
        for stop in stops:
            stop()
        return {"relay_events_per_s": events / relay_s,
                "consumer_events_per_s": events / consumer_s}
    finally:
        target.close()


def ab(kind: str, events: int, partitions: int, runs: int,
       scrape_s: float) -> dict[str, dict[str, float]]:
    """Alternate off/on in fresh processes; medians per mode, and on/off ratios."""
    got: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    for _ in range(runs):
        for mode in ("off", "on"):
            out = subprocess.run(
                [sys.executable, "-m", "bench.metrics_overhead", "--one", kind, mode,
                 str(events), str(partitions), str(scrape_s)],
                check=True, capture_output=True, text=True).stdout
            got[mode].append(json.loads(out.strip().splitlines()[-1]))
    medians: dict[str, dict[str, float]] = {
        mode: {k: float(round(statistics.median(r[k] for r in rows))) for k in rows[0]}
        for mode, rows in got.items()}
    medians["on/off"] = {k: round(medians["on"][k] / medians["off"][k], 3)
                         for k in medians["off"]}
    return medians


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--number", type=int, default=20_000, help="calls per timeit repeat")
    parser.add_argument("--ab", choices=["sqlite", "postgresql"], help="run the end-to-end A/B")
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--scrape-s", type=float, default=1.0)
    parser.add_argument("--one", nargs=5, metavar=("KIND", "MODE", "EVENTS", "PARTS", "SCRAPE"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        kind, mode, n, p, s = args.one
        print(json.dumps(one_run(kind, mode == "on", int(n), int(p), float(s))))
        return 0
    if args.ab:
        print(json.dumps(ab(args.ab, args.events, args.partitions, args.runs, args.scrape_s)))
        return 0
    print(json.dumps({k: round(v) for k, v in per_call(args.number).items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
