"""``python -m bench.profile relay|consumer|baseline [--database postgresql|sqlite]``.

Runs the relay (draining a seeded backlog), the consumer (claiming a filled stream) or the
strong baseline loop (:mod:`bench.baseline`, draining a seeded backlog) in this process under
:mod:`cProfile` and prints the functions with the most own time and the most cumulative time;
for the baseline also the wall time per phase of its loop (claim, XADD batch, mark, commit),
measured in a second, unprofiled drain. This is how the hot spots named in
``bench/PERFORMANCE.md`` were found.

``python -m bench.profile consumer --handler one-row --partitions 1 --warmup 1000 --events
500`` profiles one claim of 500 events with a handler writing one row per event (``batch``:
the batch handler; see :mod:`bench.consumer_loop`).

``python -m bench.profile relay --statements`` instead drains once without the profiler and
prints the relay's database time per statement (SQLAlchemy cursor events, and the commits),
next to the phases of the strong baseline on the same data: where the relay's time per batch
goes compared with the loop it is measured against.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import re
import tempfile
import time
from collections import defaultdict
from typing import Any

from sqlalchemy import event

from bench import consumer_loop, env
from bench.baseline import PHASES, drain_baseline
from outbox_relay.consumer import streams
from outbox_relay.consumer.daemon import Consumer
from outbox_relay.relay.daemon import Relay
from outbox_relay.shared.redis_conn import connect_redis
from outbox_relay.shared.settings import ConsumerSettings, RelaySettings


def _relay(target: env.Target, events: int, batch: int) -> Relay:
    target.reset(1)
    target.seed(events, 1)
    settings = RelaySettings.model_validate({
        "database_url": target.url, "redis_url": env.REDIS_URL, "key_prefix": target.prefix,
        "partitions": 1, "batch_size": batch, "node_id": "profile",
    })
    return Relay(settings, target.engine, connect_redis(env.REDIS_URL))


def profile_relay(
    target: env.Target, events: int, batch: int
) -> cProfile.Profile:
    relay = _relay(target, events, batch)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.runcall(relay.run, until_idle=True)
    print(f"relay: {events / (time.perf_counter() - t0):,.0f} events/s under the profiler")
    return prof


def profile_consumer(
    target: env.Target, events: int, batch: int, *, handler: str = "no-op",
    partitions: int = 4, warmup: int = 0,
) -> cProfile.Profile:
    """Claim ``events`` entries under the profiler with the ``handler`` row of
    :mod:`bench.consumer_loop` (no-op, one-row, batch), after ``warmup`` entries claimed
    without it (statement compilation and caches out of the picture)."""
    target.reset(partitions)
    consumer_loop.create_effects(target)
    env.fill_streams(target.redis, target.prefix, warmup + events, partitions)
    keys = streams.partition_keys(target.prefix, [env.STREAM], partitions)
    streams.ensure_groups(target.redis, keys, "bench")
    settings = ConsumerSettings.model_validate({
        "database_url": target.url, "redis_url": env.REDIS_URL, "key_prefix": target.prefix,
        "partitions": partitions, "streams": env.STREAM, "group": "bench",
        "consumer": "profile", "batch_size": batch,
    })
    consumer = Consumer(settings, target.engine, connect_redis(env.REDIS_URL),
                        consumer_loop.handlers_for(handler, env.EVENT_TYPE))

    def drain(until: int) -> None:
        while consumer.stats.applied < until:
            consumer.run_once(block_ms=50)

    drain(warmup)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.runcall(drain, warmup + events)
    elapsed = time.perf_counter() - t0
    print(f"consumer ({handler} handler): {events / elapsed:,.0f} claims/s under the profiler, "
          f"{elapsed * 1000 * batch / events:.1f} ms per claim of {batch}")
    return prof


def profile_baseline(
    target: env.Target, events: int, batch: int, *, profiled: bool = True
) -> cProfile.Profile:
    phases: dict[str, float] = {}
    target.reset(1)
    target.seed(events, 1)
    t0, cpu0 = time.perf_counter(), time.process_time()
    drain_baseline(target, 0, batch, phases)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    batches = -(-events // batch)
    print(f"baseline: {events / elapsed:,.0f} events/s without the profiler, this process's "
          f"CPU {cpu * 1e6 / events:.1f} µs per event; per batch of "
          f"{batch}: " + ", ".join(f"{k} {phases[k] * 1000 / batches:.2f} ms" for k in PHASES)
          + f" (of {elapsed * 1000 / batches:.2f} ms)")
    prof = cProfile.Profile()
    if not profiled:
        return prof
    target.reset(1)
    target.seed(events, 1)
    t0 = time.perf_counter()
    prof.runcall(drain_baseline, target, 0, batch)
    print(f"baseline: {events / (time.perf_counter() - t0):,.0f} events/s under the profiler")
    return prof


def relay_statements(target: env.Target, events: int, batch: int) -> None:
    """Drain once (no profiler); print the database time per statement kind per batch."""
    relay = _relay(target, events, batch)  # seeds first: only the drain is timed
    times: dict[str, list[float]] = defaultdict(list)
    started: dict[int, float] = {}

    @event.listens_for(target.engine, "before_cursor_execute")
    def _before(conn: Any, _cursor: Any, _statement: str, *_args: Any) -> None:
        started[id(conn)] = time.perf_counter()

    @event.listens_for(target.engine, "after_cursor_execute")
    def _after(conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        times[_statement_kind(statement)].append(time.perf_counter() - started[id(conn)])

    dialect: Any = target.engine.dialect
    commit = dialect.do_commit

    def timed_commit(dbapi_connection: Any) -> None:
        t = time.perf_counter()
        commit(dbapi_connection)
        times["COMMIT"].append(time.perf_counter() - t)

    dialect.do_commit = timed_commit
    t0, cpu0 = time.perf_counter(), time.process_time()
    relay.run(until_idle=True)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    batches = -(-events // batch)
    print(f"relay: {events / elapsed:,.0f} events/s, {elapsed * 1000 / batches:.2f} ms per "
          f"batch of {batch}, this process's CPU {cpu * 1e6 / events:.1f} µs per event; "
          "database time per batch by statement (relay thread):")
    total = 0.0
    for kind, spent in sorted(times.items(), key=lambda kv: -sum(kv[1])):
        total += sum(spent)
        print(f"  {sum(spent) * 1000 / batches:8.2f} ms  {len(spent) / batches:5.2f} x "
              f"{sum(spent) * 1000 / len(spent):6.2f} ms  {kind}")
    print(f"  {total * 1000 / batches:8.2f} ms  in all")
    dialect.do_commit = commit
    event.remove(target.engine, "before_cursor_execute", _before)
    event.remove(target.engine, "after_cursor_execute", _after)
    profile_baseline(target, events, batch, profiled=False)


def _statement_kind(statement: str) -> str:
    """A short name for a statement: its verb and table(s), enough to tell the relay's apart."""
    text = " ".join(statement.split())
    verb = text.split(" ", 1)[0].upper()
    tables = sorted(set(re.findall(r"(?:FROM|UPDATE|INTO|JOIN) (\w+)", text)))
    extra = ""
    if "json_to_recordset" in text or "json_each" in text:
        extra = " (json batch)"
    elif "RETURNING" in text:
        extra = " RETURNING"
    return f"{verb} {', '.join(tables)}{extra}"


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__)
    p.add_argument("daemon", choices=("relay", "consumer", "baseline"))
    p.add_argument("--database", default="postgresql", choices=("postgresql", "sqlite"))
    p.add_argument("--events", type=int, default=20_000)
    p.add_argument("--batch", type=int, default=500)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--handler", default="no-op", choices=consumer_loop.VARIANTS[1:],
                   help="consumer: the handler (bench/consumer_loop.py)")
    p.add_argument("--partitions", type=int, default=4,
                   help="consumer: partition streams (1: every claim is --batch entries)")
    p.add_argument("--warmup", type=int, default=0,
                   help="consumer: entries claimed before the profiler starts")
    p.add_argument("--statements", action="store_true",
                   help="relay: database time per statement instead of cProfile")
    args = p.parse_args()
    workdir = tempfile.mkdtemp(prefix="outbox-profile-")
    target = env.open_target(args.database, workdir)
    try:
        if args.statements:
            relay_statements(target, args.events, args.batch)
            return
        if args.daemon == "consumer":
            prof = profile_consumer(target, args.events, args.batch, handler=args.handler,
                                    partitions=args.partitions, warmup=args.warmup)
        else:
            run = {"relay": profile_relay, "baseline": profile_baseline}[args.daemon]
            prof = run(target, args.events, args.batch)
    finally:
        target.close()
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(args.top)
        print(out.getvalue())


if __name__ == "__main__":
    main()
