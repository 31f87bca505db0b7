"""``python -m bench.profile relay|consumer [--database postgresql|sqlite]``: cProfile one daemon.

Runs the relay (draining a seeded backlog) or the consumer (claiming a filled stream) in this
process under :mod:`cProfile` and prints the functions with the most own time and the most
cumulative time. This is how the hot spots named in ``bench/PERFORMANCE.md`` were found.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile
import time

from bench import env
from outbox_relay.consumer import streams
from outbox_relay.consumer.daemon import Consumer
from outbox_relay.consumer.handlers import Handlers
from outbox_relay.relay.daemon import Relay
from outbox_relay.shared.envelope import Event
from outbox_relay.shared.redis_conn import connect_redis
from outbox_relay.shared.settings import ConsumerSettings, RelaySettings


def _noop(_conn: object, _event: Event) -> None:
    """No-op handler."""


def profile_relay(
    target: env.Target, events: int, batch: int
) -> cProfile.Profile:
    target.reset(1)
    target.seed(events, 1)
    settings = RelaySettings.model_validate({
        "database_url": target.url, "redis_url": env.REDIS_URL, "key_prefix": target.prefix,
        "partitions": 1, "batch_size": batch, "node_id": "profile",
    })
    relay = Relay(settings, target.engine, connect_redis(env.REDIS_URL))
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.runcall(relay.run, until_idle=True)
    print(f"relay: {events / (time.perf_counter() - t0):,.0f} events/s under the profiler")
    return prof


def profile_consumer(
    target: env.Target, events: int, batch: int
) -> cProfile.Profile:
    target.reset(4)
    env.fill_streams(target.redis, target.prefix, events, 4)
    keys = streams.partition_keys(target.prefix, [env.STREAM], 4)
    streams.ensure_groups(target.redis, keys, "bench")
    handlers = Handlers()
    handlers.register("*", _noop)
    settings = ConsumerSettings.model_validate({
        "database_url": target.url, "redis_url": env.REDIS_URL, "key_prefix": target.prefix,
        "partitions": 4, "streams": env.STREAM, "group": "bench", "consumer": "profile",
        "batch_size": batch,
    })
    consumer = Consumer(settings, target.engine, connect_redis(env.REDIS_URL), handlers)

    def drain() -> None:
        while consumer.stats.applied < events:
            consumer.run_once(block_ms=50)

    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.runcall(drain)
    print(f"consumer: {events / (time.perf_counter() - t0):,.0f} claims/s under the profiler")
    return prof


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__)
    p.add_argument("daemon", choices=("relay", "consumer"))
    p.add_argument("--database", default="postgresql", choices=("postgresql", "sqlite"))
    p.add_argument("--events", type=int, default=20_000)
    p.add_argument("--batch", type=int, default=500)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    workdir = tempfile.mkdtemp(prefix="outbox-profile-")
    target = env.open_target(args.database, workdir)
    try:
        run = profile_relay if args.daemon == "relay" else profile_consumer
        prof = run(target, args.events, args.batch)
    finally:
        target.close()
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(args.top)
        print(out.getvalue())


if __name__ == "__main__":
    main()
